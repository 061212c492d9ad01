"""Vocab-parallel log-probs/entropy vs a float64 full-softmax reference (values and gradients).

The reference is autograd through ``log_softmax`` in float64 on the unsharded, unpadded logits;
the function under test sees fp32 (or float64) logits, split over 2 gloo ranks, with padded
vocabulary columns holding large garbage that must not leak into values or gradients.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.logprobs import naive_logprobs, vocab_parallel_logprobs
from megatron_dapo.actor.spawn import run_ranks

N, VOCAB, PADDED = 37, 250, 256  # 6 padding columns; 37 rows over chunks of 5 rows


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    logits = 3.0 * torch.randn(N, PADDED, generator=gen, dtype=torch.float64)
    logits[:, VOCAB:] = 50.0  # padding rows must be ignored
    targets = torch.randint(0, VOCAB, (N,), generator=gen)
    targets[:3] = torch.tensor([0, VOCAB - 1, VOCAB // 2])  # first/last ids, shard boundary
    g_lp = torch.randn(N, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(N, generator=gen, dtype=torch.float64)
    return logits.to(dtype), targets, g_lp, g_ent


def _reference(temperature, dtype=torch.float64):
    """Float64 autograd on the same (possibly fp32-rounded) logits the function under test sees."""
    logits, targets, g_lp, g_ent = _inputs(dtype)
    x = logits[:, :VOCAB].double().requires_grad_(True)
    lp, ent = naive_logprobs(x, targets, temperature, dtype=torch.float64)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    grad = torch.zeros(N, PADDED, dtype=torch.float64)
    grad[:, :VOCAB] = x.grad
    return lp.detach(), ent.detach(), grad


def _ours(logits, targets, g_lp, g_ent, temperature, group=None, lo=0, hi=PADDED):
    x = logits[:, lo:hi].clone().requires_grad_(True)
    chunk_bytes = 5 * 4 * (hi - lo)  # 5 rows per chunk: exercises the chunk loop and a ragged tail
    lp, ent = vocab_parallel_logprobs(
        x, targets, vocab_size=VOCAB, temperature=temperature, tp_group=group, chunk_bytes=chunk_bytes
    )
    ((lp.double() * g_lp).sum() + (ent.double() * g_ent).sum()).backward()
    return lp.detach().double(), ent.detach().double(), x.grad.double()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_tp1_matches_float64_reference(temperature, dtype, tol):
    ref_lp, ref_ent, ref_grad = _reference(temperature, dtype)
    lp, ent, grad = _ours(*_inputs(dtype), temperature)
    assert (lp - ref_lp).abs().max() < tol * 10  # |logprob| ~ 10: relative 1e-6
    assert (ent - ref_ent).abs().max() < tol * 5
    assert (grad - ref_grad).abs().max() < tol
    assert grad[:, VOCAB:].abs().max() == 0


def test_only_logprob_gradient_and_batched_shape():
    logits, targets, g_lp, _ = _inputs(torch.float64)
    x = logits.reshape(1, N, PADDED)[..., :VOCAB].clone().requires_grad_(True)
    lp, _ = vocab_parallel_logprobs(x, targets.reshape(1, N), with_entropy=False)
    assert lp.shape == (1, N)
    (lp.reshape(-1) * g_lp).sum().backward()
    y = logits[:, :VOCAB].clone().requires_grad_(True)
    ref = torch.log_softmax(y, -1).gather(-1, targets[:, None]).squeeze(-1)
    (ref * g_lp).sum().backward()
    assert torch.allclose(x.grad.reshape(N, VOCAB), y.grad, atol=1e-12, rtol=0)


def test_bad_inputs_name_the_problem():
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="target ids"):
        vocab_parallel_logprobs(logits, torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, torch.tensor([0, 1]), temperature=0.0)
    with pytest.raises(ValueError, match="targets shape"):
        vocab_parallel_logprobs(logits, torch.tensor([0]))


def _tp2_rank(rank, world, temperature):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group([0, 1])
    shard = PADDED // world
    out = {}
    for dtype in (torch.float32, torch.float64):
        out[str(dtype)] = _ours(
            *_inputs(dtype), temperature, group=group, lo=rank * shard, hi=(rank + 1) * shard
        )
    return out


def test_tp2_matches_float64_reference():
    temperature = 0.7
    results = run_ranks(_tp2_rank, 2, temperature, timeout_s=120)
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        ref_lp, ref_ent, ref_grad = _reference(temperature, dtype)
        grads = []
        for lp, ent, grad in (r[str(dtype)] for r in results):
            assert (lp - ref_lp).abs().max() < tol * 10
            assert (ent - ref_ent).abs().max() < tol * 5
            grads.append(grad)
        full = torch.cat(grads, dim=1)
        assert (full - ref_grad).abs().max() < tol
        assert full[:, VOCAB:].abs().max() == 0


def test_unused_entropy_costs_no_backward_work(monkeypatch):
    """Entropy computed (for metrics) but not differentiated: the gradient equals the float64
    reference's and the backward never evaluates the entropy term."""
    from megatron_dapo.actor import logprobs as lp_mod

    calls = []
    real = lp_mod._add_entropy_term
    monkeypatch.setattr(lp_mod, "_add_entropy_term", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 50, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 50, (6,), generator=gen)
    weights = torch.randn(6, generator=gen, dtype=torch.float64)

    x = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(x, targets, with_entropy=True)
    (lp * weights).sum().backward()
    ref = logits.clone().requires_grad_(True)
    ref_lp, _ = naive_logprobs(ref, targets, dtype=torch.float64)
    (ref_lp * weights).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=1e-12)
    assert ent.abs().sum() > 0 and calls == []

    # When the loss does use the entropy, the term runs (and is still right).
    y = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(y, targets, with_entropy=True)
    (lp * weights + ent).sum().backward()
    ref2 = logits.clone().requires_grad_(True)
    rl, re = naive_logprobs(ref2, targets, dtype=torch.float64)
    (rl * weights + re).sum().backward()
    torch.testing.assert_close(y.grad, ref2.grad, rtol=0, atol=1e-12)
    assert calls
