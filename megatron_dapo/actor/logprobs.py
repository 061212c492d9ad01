"""Per-token log-probs of given target tokens, and entropy, from vocab-parallel logits.

Each tensor-parallel rank holds a contiguous vocabulary slice of the logits (megatron's
``parallel_output=True``: rank r owns columns ``[r * V_local, (r + 1) * V_local)``). The softmax
normaliser, the target logit and the entropy are assembled from per-rank partial reductions, so
no rank ever sees the full vocabulary. Memory stays bounded because the work is done in chunks
of token rows, each upcast to float32 on its own (a chunk is about ``chunk_bytes``); the full
float32 ``[tokens, vocab]`` matrix that ``log_softmax(logits.float())`` builds never exists.

The backward pass is an explicit formula (no autograd graph through the chunks): with
``x = logits / T``, ``p = softmax(x)``, ``H = -sum p log p``::

    d logprob[t] / d x_j = 1[j == t] - p_j
    d H / d x_j          = -p_j (log p_j + H)

It recomputes ``p`` chunk by chunk from the saved logits and the saved global log-normaliser, so
it needs no collective at all; only the forward talks to the other TP ranks (one MAX and one SUM
all-reduce per chunk).

Columns at and beyond ``vocab_size`` (megatron pads the vocabulary to a multiple of
``128 * TP``) are excluded from the softmax and receive zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEFAULT_CHUNK_BYTES = 256 << 20


def _group_size_rank(group) -> tuple[int, int]:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _chunk_rows(local_vocab: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (4 * max(local_vocab, 1)))


def _add_entropy_term(
    logp: torch.Tensor, entropy: torch.Tensor, g_h: torch.Tensor, g_lp: torch.Tensor
) -> None:
    """In place: ``logp <- g_lp + g_h (logp + H)``, the bracket of the entropy-carrying backward
    (its own function so tests can see whether the backward paid for it)."""
    logp.add_(entropy.unsqueeze(-1)).mul_(g_h.unsqueeze(-1))
    logp.add_(g_lp.unsqueeze(-1))


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_size, group, chunk_bytes, with_entropy):
        tp, rank = _group_size_rank(group)
        n, local_vocab = logits.shape
        start = rank * local_vocab
        valid = max(0, min(local_vocab, vocab_size - start))
        cdtype = torch.promote_types(logits.dtype, torch.float32)
        local_t = targets - start
        owns = (local_t >= 0) & (local_t < valid)
        local_t = torch.where(owns, local_t, torch.zeros_like(local_t))

        logprobs = torch.empty(n, dtype=cdtype, device=logits.device)
        entropy = torch.empty(n, dtype=cdtype, device=logits.device)
        # The max and the log-normaliser are kept apart: (x - m) - log_z loses less precision
        # in the backward recomputation than x - (m + log_z).
        maxes = torch.empty(n, dtype=cdtype, device=logits.device)
        log_zs = torch.empty(n, dtype=cdtype, device=logits.device)
        rows = _chunk_rows(local_vocab, chunk_bytes)
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            x = logits[lo:hi, :valid].to(cdtype, copy=True)
            if temperature != 1.0:
                x.div_(temperature)
            if valid:
                m = x.max(dim=-1).values
            else:
                m = torch.full((hi - lo,), float("-inf"), dtype=cdtype, device=x.device)
            if tp > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            x.sub_(m.unsqueeze(-1))
            # Partial sums of this rank: [sum e^(x-m), sum e^(x-m)(x-m), target's (x-m) if owned].
            parts = torch.zeros(3, hi - lo, dtype=cdtype, device=x.device)
            if valid:
                tgt = x.gather(-1, local_t[lo:hi].unsqueeze(-1)).squeeze(-1)
                parts[2] = torch.where(owns[lo:hi], tgt, torch.zeros_like(tgt))
                e = x.exp()
                parts[0] = e.sum(dim=-1)
                if with_entropy:
                    parts[1] = e.mul_(x).sum(dim=-1)
                del e
            del x
            if tp > 1:
                dist.all_reduce(parts, op=dist.ReduceOp.SUM, group=group)
            log_z = parts[0].log()
            logprobs[lo:hi] = parts[2] - log_z
            entropy[lo:hi] = log_z - parts[1] / parts[0]
            maxes[lo:hi] = m
            log_zs[lo:hi] = log_z
        # Outputs nothing differentiates through get None grads instead of zero tensors: the
        # entropy is usually computed for metrics only, and a zero grad_entropy would make the
        # backward pay for the entropy term of every logit.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, local_t, owns, maxes, log_zs, entropy)
        ctx.temperature = temperature
        ctx.valid = valid
        ctx.chunk_bytes = chunk_bytes
        ctx.with_entropy = with_entropy
        if not with_entropy:
            entropy = torch.zeros_like(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local_t, owns, maxes, log_zs, entropy = ctx.saved_tensors
        temperature, valid = ctx.temperature, ctx.valid
        n, local_vocab = logits.shape
        cdtype = maxes.dtype
        grad = torch.zeros_like(logits)
        if valid == 0 or (grad_logprobs is None and grad_entropy is None):
            return grad, None, None, None, None, None, None
        g_lp = torch.zeros(n, dtype=cdtype, device=maxes.device) if grad_logprobs is None else grad_logprobs
        g_h = None if grad_entropy is None or not ctx.with_entropy else grad_entropy.to(cdtype)
        g_lp = g_lp.to(cdtype)
        rows = _chunk_rows(local_vocab, ctx.chunk_bytes)
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            logp = logits[lo:hi, :valid].to(cdtype, copy=True)
            if temperature != 1.0:
                logp.div_(temperature)
            logp.sub_(maxes[lo:hi].unsqueeze(-1)).sub_(log_zs[lo:hi].unsqueeze(-1))
            p = logp.exp()
            # dL/dx_j = g_lp (1[j==t] - p_j) - g_h p_j (log p_j + H)
            #         = -p_j (g_lp + g_h (log p_j + H)) + g_lp 1[j==t]
            if g_h is not None:
                _add_entropy_term(logp, entropy[lo:hi], g_h[lo:hi], g_lp[lo:hi])
            else:
                logp.copy_(g_lp[lo:hi].unsqueeze(-1).expand_as(logp))
            gx = logp.mul_(p).neg_()
            del p
            own = torch.where(owns[lo:hi], g_lp[lo:hi], torch.zeros_like(g_lp[lo:hi]))
            gx.scatter_add_(-1, local_t[lo:hi].unsqueeze(-1), own.unsqueeze(-1))
            if temperature != 1.0:
                gx.div_(temperature)
            grad[lo:hi, :valid] = gx
            del gx
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    tp_group=None,
    with_entropy: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and the entropy of ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V_local]`` this rank's vocabulary slice (any float dtype; bf16 stays bf16
            in memory, each chunk is upcast to float32, float64 inputs compute in float64).
        targets: ``[...]`` global token ids in ``[0, vocab_size)``.
        vocab_size: the real vocabulary; columns at and beyond it (megatron's padding) are
            ignored. Defaults to ``V_local * TP`` (no padding).
        temperature: the sampling temperature of the engine (> 0); logits are divided by it so
            the trainer scores the distribution the engine sampled from.
        tp_group: the tensor-parallel process group holding the other vocabulary slices; None
            (or a group of one) when ``logits`` hold the whole vocabulary.
        with_entropy: compute the entropy (an extra multiply per element); zeros otherwise.
        chunk_bytes: float32 working-set size of one chunk of token rows.

    Returns:
        ``(logprobs, entropy)`` of shape ``targets.shape`` in float32 (float64 for float64
        logits). Both are differentiable with respect to ``logits``; every TP rank gets the same
        values.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}"
        )
    tp, _ = _group_size_rank(tp_group)
    local_vocab = logits.shape[-1]
    if vocab_size is None:
        vocab_size = local_vocab * tp
    if not 0 < vocab_size <= local_vocab * tp:
        raise ValueError(
            f"vocab_size={vocab_size} must be in (0, V_local * TP = {local_vocab} * {tp}]; pass the "
            "model's real (unpadded) vocabulary"
        )
    if targets.numel():
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"target ids must be in [0, {vocab_size}), got min {lo} max {hi}; padding positions "
                "need a valid id (e.g. the pad token), masked out later"
            )
    shape = targets.shape
    lp, ent = _VocabParallelLogprobEntropy.apply(
        logits.reshape(-1, local_vocab),
        targets.reshape(-1).long(),
        float(temperature),
        int(vocab_size),
        tp_group if tp > 1 else None,
        int(chunk_bytes),
        bool(with_entropy),
    )
    return lp.reshape(shape), ent.reshape(shape)


def naive_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full-vocabulary reference ``log_softmax(logits / T).gather`` and entropy, materialising
    ``[tokens, vocab]`` in ``dtype`` (for tests and the benchmark)."""
    x = logits.to(dtype)
    if temperature != 1.0:
        x = x / temperature
    logp = torch.log_softmax(x, dim=-1)
    lp = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(dim=-1)
    return lp, ent
