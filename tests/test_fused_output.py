"""The output layer fused with the log-prob inside a megatron GPTModel, against today's path (the
model's own logits, then the chunked logits kernel): log-probs, entropy and the gradient of every
parameter, the output layer's and the tied word embeddings' included, at TP=1 and over two gloo
ranks with and without sequence parallelism (fp32, 1e-6 relative)."""

from __future__ import annotations

import torch
from helpers import tiny_hf_config

from megatron_dapo.actor.spawn import run_ranks

VOCAB = 250  # padded to 256: the padding rows of the output layer must not leak


def _loss_and_grads(model, tokens, labels, g_lp, g_ent, tp_group, fused):
    from megatron_dapo.actor import fused_output
    from megatron_dapo.actor.logprobs import vocab_parallel_logprobs

    model.zero_grad(set_to_none=True)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    if fused:
        with fused_output.hidden_states_out(model):
            hidden = model(tokens, positions, None)
        lp, ent = fused_output.logprobs(
            model, hidden, labels, vocab_size=VOCAB, temperature=0.7, tp_group=tp_group, chunk_tokens=5
        )
    else:
        logits = model(tokens, positions, None)
        lp, ent = vocab_parallel_logprobs(
            logits, labels, vocab_size=VOCAB, temperature=0.7, tp_group=tp_group
        )
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-3))


def _rank(rank, world, cases):
    from megatron.core import parallel_state as ps

    from megatron_dapo.actor.model import build_gpt_model
    from megatron_dapo.actor.parallel import init_parallel

    init_parallel(tp=world)
    tp_group = ps.get_tensor_model_parallel_group() if world > 1 else None
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=gen)
    labels = torch.randint(0, VOCAB, (2, 8), generator=gen)
    g_lp, g_ent = torch.randn(2, 8, generator=gen), torch.randn(2, 8, generator=gen)
    out = {}
    for tied, sp in cases:
        model = build_gpt_model(tiny_hf_config(tie_word_embeddings=tied, vocab=VOCAB), sequence_parallel=sp)[
            0
        ]
        ref = _loss_and_grads(model, tokens, labels, g_lp, g_ent, tp_group, fused=False)
        ours = _loss_and_grads(model, tokens, labels, g_lp, g_ent, tp_group, fused=True)
        errors = {"logprobs": _rel(ours[0], ref[0]), "entropy": _rel(ours[1], ref[1])}
        errors.update({name: _rel(ours[2][name], g) for name, g in ref[2].items()})
        out[(tied, sp)] = dict(
            errors=errors,
            same_params=sorted(ours[2]) == sorted(ref[2]),
            restored="forward" not in vars(model.output_layer),
        )
    return out


def _check(results, cases):
    for result in results:
        for case in cases:
            r = result[case]
            assert r["same_params"] and r["restored"], case
            # the output layer's weight (or, tied, the embedding it shares) and the layers below
            assert ("output_layer.weight" in r["errors"]) != case[0]
            bad = {k: v for k, v in r["errors"].items() if not v < 1e-6}
            assert not bad, f"tied={case[0]} sp={case[1]}: {bad}"


def test_fused_output_layer_tp1_tied_and_untied():
    cases = [(True, False), (False, False)]
    _check(run_ranks(_rank, 1, cases, timeout_s=300), cases)


def test_fused_output_layer_tp2_sequence_parallel_and_tied():
    cases = [(False, False), (True, True)]
    _check(run_ranks(_rank, 2, cases, timeout_s=300), cases)
