"""The terms added to the policy loss: a KL to the reference policy and an entropy bonus.

As verl's actor does: ``loss = pg_loss + kl_loss_coef * kl_loss - entropy_coeff * entropy_loss``,
where both terms are per-token matrices aggregated with the policy loss's ``loss_agg_mode`` and
the same global normalisers, so they sum over micro-batches and ranks exactly as it does.

Pure torch: no torch.distributed, no Megatron.
"""

from __future__ import annotations

import torch

from megatron_dapo.algo.aggregation import RowSum, agg_loss
from megatron_dapo.algo.kl import kl_penalty


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    norm_len: int | float | None = None,
    row_sum: RowSum | None = None,
    row_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The aggregated KL estimate ``kind`` (:func:`~megatron_dapo.algo.kl.kl_penalty`) of the
    current policy's (B, T) ``logprobs`` (with graph) against the reference's; not yet scaled by
    the coefficient. Aggregation arguments as :func:`~megatron_dapo.algo.aggregation.agg_loss`.

    Returns ``(loss, metrics)``; ``metrics["ref_kl"]`` is the float32 mean of the per-token
    estimate over this call's loss tokens (weigh by their count to combine micro-batches).
    """
    if logprobs.dim() != 2 or ref_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            "logprobs, ref_logprobs and mask must all be (B, T); got "
            f"{tuple(logprobs.shape)}, {tuple(ref_logprobs.shape)} and {tuple(mask.shape)}"
        )
    keep = mask.bool()
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    # select before the estimate: padding's inf/NaN must not reach exp or the gradient
    kl = kl_penalty(
        torch.where(keep, logprobs.to(dtype), zero),
        torch.where(keep, ref_logprobs.detach().to(dtype), zero),
        kind,
    )
    loss = agg_loss(
        kl,
        keep,
        loss_agg_mode,
        num_tokens,
        num_seqs,
        norm_len=norm_len,
        row_sum=row_sum,
        row_tokens=row_tokens,
    )
    with torch.no_grad():
        n = keep.sum().clamp(min=1).to(torch.float32)
        ref_kl = torch.where(keep, kl.to(torch.float32), zero.to(torch.float32)).sum() / n
    return loss, {"ref_kl": ref_kl}


def entropy_loss(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    norm_len: int | float | None = None,
    row_sum: RowSum | None = None,
    row_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The (B, T) per-token ``entropy`` (with graph) aggregated like the policy loss; the caller
    subtracts ``entropy_coeff`` times it (verl's ``entropy_loss``)."""
    if entropy.dim() != 2 or mask.shape != entropy.shape:
        raise ValueError(
            f"entropy and mask must both be (B, T); got {tuple(entropy.shape)} and {tuple(mask.shape)}"
        )
    keep = mask.bool()
    dtype = torch.promote_types(entropy.dtype, torch.float32)
    ent = torch.where(keep, entropy.to(dtype), torch.zeros((), dtype=dtype, device=entropy.device))
    return agg_loss(
        ent,
        keep,
        loss_agg_mode,
        num_tokens,
        num_seqs,
        norm_len=norm_len,
        row_sum=row_sum,
        row_tokens=row_tokens,
    )
