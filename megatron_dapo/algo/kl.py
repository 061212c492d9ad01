"""Per-token estimates of KL(pi || pi_ref) from log-probs of the sampled tokens, by verl's names.

With ``d = logprobs - ref_logprobs`` (Schulman, "Approximating KL divergence", 2020):

- ``kl`` / ``k1``: ``d``, unbiased, high variance, can be negative.
- ``abs``: ``|d|``.
- ``mse`` / ``k2``: ``d^2 / 2``; its gradient is the unbiased gradient of the KL.
- ``low_var_kl`` / ``k3``: ``exp(-d) + d - 1`` (``-d`` clamped to +-20 first, the result to
  +-10, as verl), unbiased and non-negative.
- any of them with ``+`` (``k1+``, ``k3+``, ``low_var_kl+``, ...): that value, with k2's gradient
  (straight-through: ``k2 - sg(k2) + sg(value)``). ``k1`` and ``k3`` are unbiased values but
  their gradients are not the KL's gradient; ``+`` keeps the value and fixes the gradient.

Pure torch: no torch.distributed, no Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BASE_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTY_KINDS = _BASE_KINDS + tuple(f"{k}+" for k in _BASE_KINDS)

# verl's guards on k3: exp of at most e^20, and the estimate bounded to +-10.
_K3_LOG_CLAMP = 20.0
_K3_CLAMP = 10.0


def check_kl_kind(kind: str) -> None:
    if kind not in KL_PENALTY_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_PENALTY_KINDS)}")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """The per-token estimate ``kind`` (see the module docstring) of ``logprobs`` (any shape,
    may carry a graph) against ``ref_logprobs`` (same shape, treated as a constant when it has
    no graph). Elementwise: padding is the caller's to mask, before (to keep inf/NaN out of the
    gradient) or after."""
    check_kl_kind(kind)
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(ref_logprobs.shape)}"
        )
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    value = _estimate(logprobs, ref_logprobs, base)
    if not straight_through or base in ("mse", "k2"):
        return value
    k2 = _estimate(logprobs, ref_logprobs, "k2")
    return k2 - k2.detach() + value.detach()


def _estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, base: str) -> torch.Tensor:
    d = logprobs - ref_logprobs
    if base in ("kl", "k1"):
        return d
    if base == "abs":
        return d.abs()
    if base in ("mse", "k2"):
        return 0.5 * d.square()
    neg = torch.clamp(-d, min=-_K3_LOG_CLAMP, max=_K3_LOG_CLAMP)
    return torch.clamp(torch.exp(neg) - neg - 1.0, min=-_K3_CLAMP, max=_K3_CLAMP)


@dataclass
class KLRewardPenalty:
    """:func:`kl_reward_penalty`'s result: ``scores`` (B,) with the penalty subtracted and
    ``current_kl``, the batch mean of each response's mean estimate, the value a KL controller
    is updated with (verl's ``actor/reward_kl_penalty``)."""

    scores: torch.Tensor
    current_kl: float


def kl_reward_penalty(
    scores: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: str,
    coef: float,
) -> KLRewardPenalty:
    """verl's ``apply_kl_penalty`` for outcome scores: the token rewards become
    ``score placed on the last token - coef * kl_t``, and the outcome estimators sum a response's
    token rewards, so each response's score becomes ``score - coef * sum_t kl_t`` over its
    response tokens (``kl_t = kl_penalty(old_logprobs, ref_logprobs, kind)``).

    ``current_kl`` is the mean over the batch of each response's ``sum_t kl_t / n_tokens`` (a
    response with no token counts as 0). verl divides by ``n_tokens + 1e-8``; here by the exact
    count. Hand ``current_kl`` and the batch size to the controller's ``update``.
    """
    if scores.dim() != 1 or old_logprobs.dim() != 2 or scores.shape[0] != old_logprobs.shape[0]:
        raise ValueError(
            f"scores must be (B,) and old_logprobs (B, T); got {tuple(scores.shape)} and {tuple(old_logprobs.shape)}"
        )
    if mask.shape != old_logprobs.shape:
        raise ValueError(
            f"mask must have the shape of old_logprobs {tuple(old_logprobs.shape)}, got {tuple(mask.shape)}"
        )
    keep = mask.bool()
    dtype = torch.promote_types(scores.dtype, torch.promote_types(old_logprobs.dtype, torch.float32))
    zero = torch.zeros((), dtype=dtype, device=scores.device)
    kl = kl_penalty(
        torch.where(keep, old_logprobs.detach().to(dtype), zero),
        torch.where(keep, ref_logprobs.detach().to(dtype), zero),
        kind,
    )
    per_seq = torch.where(keep, kl, zero).sum(dim=-1)
    current = (per_seq / keep.sum(dim=-1).clamp(min=1).to(dtype)).mean()
    return KLRewardPenalty(scores.detach().to(dtype) - coef * per_seq, float(current))
