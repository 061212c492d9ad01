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
# Tokens per chunk of the fused output layer + log-prob. Measured on CPU only (2048 tokens x 32768
# vocab x 256 hidden, fp32, `tools/bench_logprobs.py --chunks 128,256,512,2048` on a loaded
# 2-core machine): 128-512 ran 0.30-0.70x naive's time, 1024-2048 0.66-0.78x, memory growing with
# the chunk. At Qwen2.5's 151936 vocabulary one chunk of 512 is ~0.3 GiB of float32 logits (a
# few such buffers live at once); the GPU default is not measured.
DEFAULT_CHUNK_TOKENS = 512


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


def _chunk_forward(
    x: torch.Tensor, local_t: torch.Tensor, owns: torch.Tensor, group, tp: int, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob, entropy, max and log-normaliser of one chunk of token rows. ``x``: this rank's
    ``[rows, valid]`` scaled logits ``logits / T`` in the compute dtype, a copy it overwrites. The
    only collectives of the kernels: one MAX and one SUM all-reduce over the TP group."""
    rows, valid = x.shape
    if valid:
        m = x.max(dim=-1).values
    else:
        m = torch.full((rows,), float("-inf"), dtype=x.dtype, device=x.device)
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    x.sub_(m.unsqueeze(-1))
    # Partial sums of this rank: [sum e^(x-m), sum e^(x-m)(x-m), target's (x-m) if owned].
    parts = torch.zeros(3, rows, dtype=x.dtype, device=x.device)
    if valid:
        tgt = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
        parts[2] = torch.where(owns, tgt, torch.zeros_like(tgt))
        e = x.exp()
        parts[0] = e.sum(dim=-1)
        if with_entropy:
            parts[1] = e.mul_(x).sum(dim=-1)
        del e
    if tp > 1:
        dist.all_reduce(parts, op=dist.ReduceOp.SUM, group=group)
    log_z = parts[0].log()
    return parts[2] - log_z, log_z - parts[1] / parts[0], m, log_z


def _logit_grad(
    x: torch.Tensor,
    maxes: torch.Tensor,
    log_zs: torch.Tensor,
    entropy: torch.Tensor,
    g_lp: torch.Tensor,
    g_h: torch.Tensor | None,
    tgt: torch.Tensor,
    hit: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """d loss / d logits of a tile of ``[rows, cols]`` scaled logits ``x`` (a compute-dtype copy it
    overwrites and returns), from the saved global max and log-normaliser, so no collective:
    ``dL/dx_j = -p_j (g_lp + g_h (log p_j + H)) + g_lp 1[j == t]``, then ``/ T``. ``tgt``: each
    row's target column within the tile where ``hit``, any valid column elsewhere."""
    logp = x.sub_(maxes.unsqueeze(-1)).sub_(log_zs.unsqueeze(-1))
    p = logp.exp()
    if g_h is not None:
        _add_entropy_term(logp, entropy, g_h, g_lp)
    else:
        logp.copy_(g_lp.unsqueeze(-1).expand_as(logp))
    gx = logp.mul_(p).neg_()
    del p
    own = torch.where(hit, g_lp, torch.zeros_like(g_lp))
    gx.scatter_add_(-1, tgt.unsqueeze(-1), own.unsqueeze(-1))
    if temperature != 1.0:
        gx.div_(temperature)
    return gx


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
            stats = _chunk_forward(x, local_t[lo:hi], owns[lo:hi], group, tp, with_entropy)
            logprobs[lo:hi], entropy[lo:hi], maxes[lo:hi], log_zs[lo:hi] = stats
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
            x = logits[lo:hi, :valid].to(cdtype, copy=True)
            if temperature != 1.0:
                x.div_(temperature)
            rows_ = slice(lo, hi)
            gx = _logit_grad(
                x, maxes[rows_], log_zs[rows_], entropy[rows_], g_lp[rows_],
                None if g_h is None else g_h[rows_], local_t[rows_], owns[rows_], temperature,
            )  # fmt: skip
            grad[lo:hi, :valid] = gx
            del gx
        return grad, None, None, None, None, None, None


def _checked_vocab(targets, temperature: float, vocab_size: int | None, local_vocab: int, tp: int) -> int:
    """The real vocabulary (default ``V_local * TP``), after checking the arguments both kernels
    share."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
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
    return int(vocab_size)


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
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}"
        )
    tp, _ = _group_size_rank(tp_group)
    local_vocab = logits.shape[-1]
    vocab_size = _checked_vocab(targets, temperature, vocab_size, local_vocab, tp)
    shape = targets.shape
    lp, ent = _VocabParallelLogprobEntropy.apply(
        logits.reshape(-1, local_vocab),
        targets.reshape(-1).long(),
        float(temperature),
        vocab_size,
        tp_group if tp > 1 else None,
        int(chunk_bytes),
        bool(with_entropy),
    )
    return lp.reshape(shape), ent.reshape(shape)


def _vocab_block(valid: int, hidden_size: int, chunk_tokens: int) -> int:
    """Output-weight rows per backward block when the weight's gradient is accumulated apart
    (half precision): the float32 accumulator of a block (``block x hidden``) is at most one
    chunk's float32 logits (``chunk_tokens x valid``)."""
    return max(1, min(valid, chunk_tokens * valid // max(hidden_size, 1)))


class _FusedLinearLogprobEntropy(torch.autograd.Function):
    """``vocab_parallel_logprobs(hidden @ weight.T, ...)`` without the ``[tokens, V_local]``
    logits: each chunk of tokens computes its logits, reduces them and drops them; the backward
    computes them again, tile by tile."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_size, group, chunk_tokens, with_entropy):
        tp, rank = _group_size_rank(group)
        n = hidden.shape[0]
        local_vocab = weight.shape[0]
        start = rank * local_vocab
        valid = max(0, min(local_vocab, vocab_size - start))
        cdtype = torch.promote_types(hidden.dtype, torch.float32)
        local_t = targets - start
        owns = (local_t >= 0) & (local_t < valid)
        local_t = torch.where(owns, local_t, torch.zeros_like(local_t))
        # rows: log-prob, entropy, max, log-normaliser (kept apart as in the logits kernel)
        out = torch.empty(4, n, dtype=cdtype, device=hidden.device)
        w = weight[:valid]
        for lo in range(0, n, chunk_tokens):
            hi = min(n, lo + chunk_tokens)
            # The logits in the model's dtype, as the output layer would hand them over, then the
            # logits kernel's upcast: the same numbers as the unfused path.
            x = (hidden[lo:hi] @ w.t()).to(cdtype)
            if temperature != 1.0:
                x.div_(temperature)
            stats = _chunk_forward(x, local_t[lo:hi], owns[lo:hi], group, tp, with_entropy)
            del x
            for row, value in enumerate(stats):
                out[row, lo:hi] = value
        logprobs, entropy, maxes, log_zs = out
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, local_t, owns, maxes, log_zs, entropy)
        ctx.temperature = temperature
        ctx.valid = valid
        ctx.chunk_tokens = chunk_tokens
        ctx.with_entropy = with_entropy
        if not with_entropy:
            entropy = torch.zeros_like(entropy)
        return logprobs.clone(), entropy.clone()

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local_t, owns, maxes, log_zs, entropy = ctx.saved_tensors
        temperature, valid, chunk = ctx.temperature, ctx.valid, ctx.chunk_tokens
        want_h, want_w = ctx.needs_input_grad[:2]
        n, hidden_size = hidden.shape
        cdtype = maxes.dtype
        nones = (None,) * 6
        grad_w = torch.zeros_like(weight) if want_w else None  # padded rows stay zero
        if valid == 0 or (grad_logprobs is None and grad_entropy is None):
            return (torch.zeros_like(hidden) if want_h else None), grad_w, *nones
        g_lp = torch.zeros(n, dtype=cdtype, device=maxes.device) if grad_logprobs is None else grad_logprobs
        g_lp = g_lp.to(cdtype)
        g_h = None if grad_entropy is None or not ctx.with_entropy else grad_entropy.to(cdtype)
        # Both gradients are sums over tiles, accumulated in float32 (or wider) and rounded to the
        # parameters' dtype once, as one matmul over the whole logits gradient would.
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        grad_h = torch.zeros(n, hidden_size, dtype=acc_dtype, device=hidden.device) if want_h else None
        direct = grad_w is not None and grad_w.dtype == acc_dtype
        block = valid if direct or not want_w else _vocab_block(valid, hidden_size, chunk)
        for v0 in range(0, valid, block):
            v1 = min(valid, v0 + block)
            w_blk = weight[v0:v1]
            if want_w:
                acc = (
                    grad_w[v0:v1]
                    if direct
                    else torch.zeros(v1 - v0, hidden_size, dtype=acc_dtype, device=weight.device)
                )
            hit = owns & (local_t >= v0) & (local_t < v1)
            tgt = torch.where(hit, local_t - v0, torch.zeros_like(local_t))
            for lo in range(0, n, chunk):
                r = slice(lo, min(n, lo + chunk))
                x = (hidden[r] @ w_blk.t()).to(cdtype)
                if temperature != 1.0:
                    x.div_(temperature)
                gx = _logit_grad(
                    x, maxes[r], log_zs[r], entropy[r], g_lp[r],
                    None if g_h is None else g_h[r], tgt[r], hit[r], temperature,
                )  # fmt: skip
                gx = gx.to(hidden.dtype)  # the logits' gradient in their dtype, as unfused
                if want_h:
                    grad_h[r] += gx @ w_blk
                if want_w:
                    acc += gx.t() @ hidden[r]
                del gx
            if want_w and not direct:
                grad_w[v0:v1] = acc
        return (grad_h.to(hidden.dtype) if want_h else None), grad_w, *nones


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    tp_group=None,
    with_entropy: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vocab_parallel_logprobs` of the logits ``hidden @ weight.T`` (the output layer,
    megatron's vocab-parallel ``ColumnParallelLinear``), never holding them: the output layer
    and the log-prob run together on ``chunk_tokens`` tokens at a time, and the backward
    recomputes each chunk's logits (as fused linear cross-entropy kernels do). Only the
    forward talks to the other TP ranks.

    Args:
        hidden: ``[..., h]`` the final hidden states, the output layer's input as every TP rank
            sees it (sequence-parallel shards already gathered).
        weight: ``[V_local, h]`` this rank's rows of the output layer (the word embeddings when
            tied), in ``hidden``'s dtype.
        chunk_tokens: tokens per chunk; the working set is about ``chunk_tokens * V_local``
            float32 values.
        the rest: as :func:`vocab_parallel_logprobs`.

    Returns:
        ``(logprobs, entropy)`` of shape ``targets.shape``, differentiable with respect to
        ``hidden`` and ``weight``. ``hidden``'s gradient is this rank's share (its vocabulary
        slice's); the caller sums it over the TP ranks the way ColumnParallelLinear's input
        mapping does (``copy_to_tensor_model_parallel_region``, or the sequence-parallel gather).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden shape without the hidden dim "
            f"{tuple(hidden.shape[:-1])}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight {tuple(weight.shape)} {weight.dtype} must be [V_local, {hidden.shape[-1]}] in the "
            f"hidden states' dtype {hidden.dtype}"
        )
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    tp, _ = _group_size_rank(tp_group)
    vocab_size = _checked_vocab(targets, temperature, vocab_size, weight.shape[0], tp)
    shape = targets.shape
    lp, ent = _FusedLinearLogprobEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1).long(),
        float(temperature),
        vocab_size,
        tp_group if tp > 1 else None,
        int(chunk_tokens),
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
