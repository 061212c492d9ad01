"""The terms added to the policy loss: a KL to the reference policy and an entropy bonus.

As verl's actor does: ``loss = pg_loss + kl_loss_coef * kl_loss - entropy_coeff * entropy_loss``,
where both terms are per-token matrices aggregated with the policy loss's ``loss_agg_mode`` and
the same global normalisers, so they sum over micro-batches and ranks exactly as it does.

Pure torch: no torch.distributed, no Megatron.
"""

from __future__ import annotations

import torch

from megatron_dapo.algo.aggregation import Aggregation
from megatron_dapo.algo.kl import kl_penalty

TOKEN_MEAN = Aggregation()


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str = "low_var_kl",
    agg: Aggregation = TOKEN_MEAN,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The KL estimate ``kind`` (:func:`~megatron_dapo.algo.kl.kl_penalty`) of the current
    policy's (B, T) ``logprobs`` (with graph) against the reference's, aggregated by ``agg`` (the
    policy loss's :class:`~megatron_dapo.algo.aggregation.Aggregation`); not yet scaled by the
    coefficient.

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
    loss = agg(kl, keep)
    with torch.no_grad():
        n = keep.sum().clamp(min=1).to(torch.float32)
        ref_kl = torch.where(keep, kl.to(torch.float32), zero.to(torch.float32)).sum() / n
    return loss, {"ref_kl": ref_kl}


def entropy_loss(entropy: torch.Tensor, mask: torch.Tensor, *, agg: Aggregation = TOKEN_MEAN) -> torch.Tensor:
    """The (B, T) per-token ``entropy`` (with graph) aggregated by ``agg``, like the policy loss;
    the caller subtracts ``entropy_coeff`` times it (verl's ``entropy_loss``)."""
    if entropy.dim() != 2 or mask.shape != entropy.shape:
        raise ValueError(
            f"entropy and mask must both be (B, T); got {tuple(entropy.shape)} and {tuple(mask.shape)}"
        )
    keep = mask.bool()
    dtype = torch.promote_types(entropy.dtype, torch.float32)
    return agg(
        torch.where(keep, entropy.to(dtype), torch.zeros((), dtype=dtype, device=entropy.device)), keep
    )
