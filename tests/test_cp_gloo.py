"""CP log-prob gather and token-mean reduction over gloo with 2 processes, against the unsplit
(CP=1) computation on the same tokens, with a position-wise stand-in model (logits from the token
and its full-row position, exactly what a CP rank sees of each token) so the reductions are
checked apart from attention. The whole actor at CP=2 (megatron model, the CPU stand-in for TE's
CP attention) is tested in test_context_parallel_actor.py."""

from __future__ import annotations

import torch

from megatron_dapo.actor.context_parallel import cp_gather, cp_reduce_token_mean, cp_split, cp_split_inputs
from megatron_dapo.actor.spawn import run_ranks

VOCAB, SEQ = 11, 12


def _weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(VOCAB, VOCAB, generator=g), torch.randn(SEQ, VOCAB, generator=g)


def _logprobs(input_ids, position_ids, labels):
    emb, pos = _weights()
    logits = emb[input_ids] + pos[position_ids]
    return torch.log_softmax(logits.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    # Loss tokens only in the response tail: the ranks hold very different counts.
    mask = torch.zeros(3, SEQ)
    mask[:, 7:11] = 1
    mask[1, 9:] = 0
    return tokens, mask


def _rank(rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tokens, mask = _batch()
    inp = cp_split_inputs(tokens, world, rank)
    lp = _logprobs(inp["input_ids"], inp["position_ids"], inp["labels"])
    m = cp_split(mask, world, rank, dim=1)
    full = cp_gather(lp, dist.group.WORLD, dim=1)
    mean = cp_reduce_token_mean((lp * m).sum(), m.sum(), dist.group.WORLD)
    return full, mean.item(), m.sum().item()


def test_cp2_gathered_logprobs_and_token_mean_equal_the_unsplit_computation():
    tokens, mask = _batch()
    positions = torch.arange(SEQ).expand_as(tokens)
    labels = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
    ref = _logprobs(tokens, positions, labels)
    ref_mean = ((ref * mask).sum() / mask.sum()).item()
    results = run_ranks(_rank, 2, timeout_s=300)
    for full, mean, _ in results:
        torch.testing.assert_close(full, ref, rtol=0, atol=0)
        assert abs(mean - ref_mean) < 1e-12
    counts = [c for _, _, c in results]
    assert counts[0] != counts[1]  # the uneven case, where a per-rank mean would be wrong
