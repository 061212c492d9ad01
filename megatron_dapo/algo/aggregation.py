"""Reduce a per-token loss matrix to a scalar (verl's ``agg_loss`` modes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Sums a per-row tensor over the pieces of each row that other ranks hold (context parallelism
# cuts every sequence across ranks); None when each row is whole here. Passed in so that algo/
# needs no torch.distributed.
RowSum = Callable[[torch.Tensor], torch.Tensor]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    *,
    norm_len: int | float | None = None,
    row_sum: RowSum | None = None,
    row_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` (B, T) over the tokens where ``mask`` is set.

    Modes (verl's ``agg_loss``):

    - ``token-mean``: sum of masked token losses / ``num_tokens`` (DAPO's token-level loss).
    - ``seq-mean-token-sum``: each sequence's token sum, averaged over ``num_seqs`` sequences.
    - ``seq-mean-token-mean``: each sequence's token mean, averaged over ``num_seqs`` sequences.
    - ``seq-mean-token-sum-norm``: each sequence's token sum divided by the constant
      ``norm_len`` (default ``mask.shape[-1]``), averaged over ``num_seqs`` sequences: Dr. GRPO's
      ``1/G * sum_i sum_t l_it / L`` (Liu et al. 2025, arXiv:2503.20783; ``L`` the generation
      budget), and verl's mode of that name since verl 0.7.1 (``loss_scale_factor`` is
      ``norm_len``). Before, verl (and this function) left out the ``1/num_seqs``.

    Sequences with no unmasked token are excluded from the ``seq-mean-*`` averages.

    ``num_tokens`` / ``num_seqs`` are the normalisers; leave them None to use the local mask's
    count. To make micro-batches add up to the mini-batch loss, pass the mini-batch's global
    count (all micro-batches and data-parallel ranks): then summing the per-micro-batch losses
    gives exactly the loss of the whole mini-batch. An empty local mask gives a zero loss (not
    NaN) that still carries the graph.

    Masked positions may hold any value (padding garbage, inf, NaN): they are zeroed by a
    select, not a multiply, so they cannot leak into the loss or its gradient.

    ``row_sum``: when a row is cut across ranks (context parallelism), sums a per-row count over
    them. The ``seq-mean-*`` modes then use each whole sequence's token count (for its mean and
    for "is it empty"), while the numerator stays this rank's part: the ranks' losses add up to
    the loss of the whole rows, and so do their gradients. ``row_tokens`` (B,): the whole rows'
    token counts, when the caller already has them (rows cut into chunks computed one after the
    other, where no collective can sum them); it replaces the local count and ``row_sum``.

    Differs from verl in one detail: ``seq-mean-token-mean`` divides a sequence's token sum by
    its exact token count, where verl divides by ``count + 1e-8``.
    """
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat and mask must both be (B, T); got {tuple(loss_mat.shape)} and {tuple(mask.shape)}"
        )
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
    keep = mask.bool()
    masked = torch.where(keep, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    token_counts = keep.sum(dim=-1)

    if mode == "token-mean":
        denom = token_counts.sum() if num_tokens is None else num_tokens
        return masked.sum() / _positive(denom, "num_tokens", loss_mat)

    seq_sums = masked.sum(dim=-1)
    if row_tokens is not None:
        token_counts = _row_tokens(row_tokens, mask)
    elif row_sum is not None:
        token_counts = row_sum(token_counts)
    nonempty = token_counts > 0
    if mode == "seq-mean-token-mean":
        seq_losses = seq_sums / token_counts.clamp(min=1).to(loss_mat.dtype)
    elif mode == "seq-mean-token-sum-norm":
        seq_losses = seq_sums / _norm_len(norm_len, mask)
    else:
        seq_losses = seq_sums
    denom = nonempty.sum() if num_seqs is None else num_seqs
    return torch.where(nonempty, seq_losses, torch.zeros_like(seq_losses)).sum() / _positive(
        denom, "num_seqs", loss_mat
    )


@dataclass(frozen=True)
class Aggregation:
    """How a per-token matrix becomes a loss: :func:`agg_loss`'s mode and normalisers, one object
    for the policy loss and every term added to it (the KL loss, the entropy bonus), so that all
    of them are aggregated alike. Calling it aggregates ``(loss_mat, mask)``."""

    mode: str = "token-mean"
    num_tokens: int | float | torch.Tensor | None = None
    num_seqs: int | float | torch.Tensor | None = None
    norm_len: int | float | None = None
    row_sum: RowSum | None = None
    row_tokens: torch.Tensor | None = None

    def __call__(self, loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return agg_loss(
            loss_mat,
            mask,
            self.mode,
            self.num_tokens,
            self.num_seqs,
            norm_len=self.norm_len,
            row_sum=self.row_sum,
            row_tokens=self.row_tokens,
        )


def sequence_weights(mask: torch.Tensor, agg: Aggregation) -> torch.Tensor:
    """Per-row weights ``w`` [B] such that ``sum(w * x)`` is what ``agg`` gives for a
    per-sequence quantity ``x`` [B] placed on every masked token of its row: the same mode and the
    same global normalisers as the policy loss (``agg.row_tokens`` is not used). For sequence-level terms added to the loss (the
    MoE load-balancing loss) so they are aggregated exactly like it.

    token-mean: tokens / num_tokens; seq-mean-token-mean: 1 / num_seqs for each non-empty row;
    seq-mean-token-sum: tokens / num_seqs; seq-mean-token-sum-norm: tokens / (num_seqs *
    norm_len). Token counts are whole rows' (``row_sum`` over context-parallel pieces).
    """
    mode, num_tokens, num_seqs, norm_len, row_sum = (
        agg.mode,
        agg.num_tokens,
        agg.num_seqs,
        agg.norm_len,
        agg.row_sum,
    )
    if mask.dim() != 2:
        raise ValueError(f"mask must be (B, T), got {tuple(mask.shape)}")
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
    counts = mask.bool().sum(dim=-1)
    if row_sum is not None:
        counts = row_sum(counts)
    counts = counts.to(torch.float64)
    if mode == "token-mean":
        return counts / _positive(counts.sum() if num_tokens is None else num_tokens, "num_tokens", counts)
    nonempty = counts > 0
    denom = _positive(nonempty.sum() if num_seqs is None else num_seqs, "num_seqs", counts)
    if mode == "seq-mean-token-mean":
        return nonempty.to(torch.float64) / denom
    if mode == "seq-mean-token-sum-norm":
        return counts / _norm_len(norm_len, mask) / denom
    return counts / denom


def _norm_len(norm_len: int | float | None, mask: torch.Tensor) -> int | float:
    divisor = mask.shape[-1] if norm_len is None else norm_len
    if divisor <= 0:
        raise ValueError(f"norm_len must be > 0, got {divisor}")
    return divisor


def _row_tokens(row_tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if row_tokens.shape != mask.shape[:1]:
        raise ValueError(
            f"row_tokens must hold one count per row, shape {tuple(mask.shape[:1])}, got {tuple(row_tokens.shape)}"
        )
    return row_tokens


def _positive(denom, name: str, like: torch.Tensor) -> torch.Tensor:
    """The normaliser as a tensor, at least 1: a zero count only occurs with a zero numerator.

    Tensor normalisers are not inspected on the host, so no device sync happens per micro-batch.
    """
    if not isinstance(denom, torch.Tensor) and denom < 0:
        raise ValueError(f"{name} must be >= 0, got {denom}")
    return torch.clamp(torch.as_tensor(denom, dtype=like.dtype, device=like.device), min=1)
