"""Vocab-parallel log-probs/entropy vs a float64 full-softmax reference (values and gradients).

The reference is autograd through ``log_softmax`` in float64 on the unsharded, unpadded logits;
the function under test sees fp32 (or float64) logits, split over 2 gloo ranks, with padded
vocabulary columns holding large garbage that must not leak into values or gradients.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.logprobs import fused_linear_logprobs, naive_logprobs, vocab_parallel_logprobs
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


# ---- the output layer fused with the log-prob, against today's kernel on hidden @ weight.T ----

HIDDEN = 24


def _fused_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(N, HIDDEN, generator=gen, dtype=torch.float64)
    weight = 0.6 * torch.randn(PADDED, HIDDEN, generator=gen, dtype=torch.float64)
    weight[VOCAB:] = 3.0  # padding rows: their logits must not leak, their gradient stays zero
    targets = torch.randint(0, VOCAB, (N,), generator=gen)
    targets[:3] = torch.tensor([0, VOCAB - 1, VOCAB // 2])
    g_lp = torch.randn(N, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(N, generator=gen, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), targets, g_lp, g_ent


def _backward(lp, ent, g_lp, g_ent):
    ((lp.double() * g_lp).sum() + (ent.double() * g_ent).sum()).backward()


def _unfused(dtype, temperature):
    """Today's path: the output layer's logits, then the chunked kernel (the whole vocabulary)."""
    hidden, weight, targets, g_lp, g_ent = _fused_inputs(dtype)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(
        h @ w.t(), targets, vocab_size=VOCAB, temperature=temperature, chunk_bytes=5 * 4 * PADDED
    )
    _backward(lp, ent, g_lp, g_ent)
    return lp.detach().double(), ent.detach().double(), h.grad.double(), w.grad.double()


def _fused(dtype, temperature, group=None, lo=0, hi=PADDED, chunk_tokens=5):
    hidden, weight, targets, g_lp, g_ent = _fused_inputs(dtype)
    h, w = hidden.clone().requires_grad_(True), weight[lo:hi].clone().requires_grad_(True)
    lp, ent = fused_linear_logprobs(
        h, w, targets, vocab_size=VOCAB, temperature=temperature, tp_group=group, chunk_tokens=chunk_tokens
    )
    _backward(lp, ent, g_lp, g_ent)
    return lp.detach().double(), ent.detach().double(), h.grad.double(), w.grad.double()


def _assert_close(ours, ref, tol):
    names = ("logprobs", "entropy", "hidden grad", "weight grad")
    for name, a, b in zip(names, ours, ref):
        err = float((a - b).abs().max() / b.abs().max().clamp(min=1.0))
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol}"


@pytest.mark.parametrize("chunk_tokens", [5, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_fused_tp1_matches_logits_kernel(temperature, dtype, tol, chunk_tokens):
    ours = _fused(dtype, temperature, chunk_tokens=chunk_tokens)
    _assert_close(ours, _unfused(dtype, temperature), tol)
    assert ours[3][VOCAB:].abs().max() == 0


def test_fused_bf16_weight_gradient_in_blocks():
    """Half-precision weights accumulate their gradient in float32 blocks of vocabulary rows
    (5 tokens per chunk, hidden 24: 52-row blocks); it matches the logits kernel to bf16 rounding."""
    ours = _fused(torch.bfloat16, 0.7)
    ref = _unfused(torch.bfloat16, 0.7)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    _assert_close(ours, ref, 2e-2)
    assert ours[3][VOCAB:].abs().max() == 0


def _fused_tp2_rank(rank, world, temperature):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group([0, 1])
    shard = PADDED // world
    out = {}
    for dtype in (torch.float32, torch.float64):
        lp, ent, h_grad, w_grad = _fused(
            dtype, temperature, group=group, lo=rank * shard, hi=(rank + 1) * shard
        )
        # This rank's share of the hidden gradient; the model's TP input mapping sums them.
        dist.all_reduce(h_grad, group=group)
        out[str(dtype)] = (lp, ent, h_grad, w_grad)
    return out


def test_fused_tp2_matches_logits_kernel_tp1():
    temperature = 0.7
    results = run_ranks(_fused_tp2_rank, 2, temperature, timeout_s=120)
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        ref = _unfused(dtype, temperature)
        ranks = [r[str(dtype)] for r in results]
        for lp, ent, h_grad, _ in ranks:
            _assert_close((lp, ent, h_grad), ref[:3], tol)
        full_w = torch.cat([r[3] for r in ranks], dim=0)
        _assert_close((full_w,), ref[3:], tol)
        assert full_w[VOCAB:].abs().max() == 0


def test_fused_unused_entropy_costs_no_backward_work(monkeypatch):
    from megatron_dapo.actor import logprobs as lp_mod

    calls = []
    real = lp_mod._add_entropy_term
    monkeypatch.setattr(lp_mod, "_add_entropy_term", lambda *a: calls.append(1) or real(*a))
    hidden, weight, targets, g_lp, _ = _fused_inputs(torch.float64)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = fused_linear_logprobs(h, w, targets, vocab_size=VOCAB, chunk_tokens=7)
    (lp * g_lp).sum().backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref, _ = vocab_parallel_logprobs(h2 @ w2.t(), targets, vocab_size=VOCAB)
    (ref * g_lp).sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w.grad, w2.grad, rtol=0, atol=1e-12)
    assert ent.abs().sum() > 0 and calls == []


def test_fused_bad_inputs_name_the_problem():
    hidden, weight = torch.zeros(3, 4), torch.zeros(8, 4)
    with pytest.raises(ValueError, match="chunk_tokens"):
        fused_linear_logprobs(hidden, weight, torch.zeros(3, dtype=torch.long), chunk_tokens=0)
    with pytest.raises(ValueError, match="hidden states' dtype"):
        fused_linear_logprobs(hidden, weight.double(), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="target ids"):
        fused_linear_logprobs(hidden, weight, torch.tensor([0, 1, 8]))
