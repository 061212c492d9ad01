"""Rollout correction: the importance weight between pi_old and the policy that generated the data.

The loss is the decoupled (proximal) form: the clipped DAPO ratio is taken against pi_old, which
the actor recomputes, and the behaviour policy is the rollout engine (its per-token log-probs,
whatever weight version produced them). Per token, ``rho = exp(pi_old - rollout)`` corrects for
the gap (engine numerics, stale weights). Two ways to use it, as verl's ``rollout_correction``
(``rollout_is`` / ``rollout_rs``) and slime's TIS / MIS name them:

- ``tis``: truncated importance sampling, each token's loss times ``min(rho, threshold)``.
- ``mask``: rejection, tokens whose ``rho`` lies outside ``[threshold_lower, threshold]`` leave
  the loss (their term is zero; the token-mean normaliser still counts them, so the loss scale
  does not depend on how many were rejected).

``level`` says what ``rho`` is: ``token`` (each token's own), ``sequence`` (the product over the
sequence's loss tokens, every token of the sequence gets it) or ``geometric`` (the geometric mean
over the sequence's loss tokens, i.e. the product normalised by length).

Weights are constants (no gradient). Pure torch: no torch.distributed, no Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_dapo.algo.aggregation import RowSum

CORRECTION_MODES = ("none", "tis", "mask")
CORRECTION_LEVELS = ("token", "sequence", "geometric")

# Same guard as the PPO ratio: a very stale token or a long sequence's product cannot overflow.
_LOG_CLAMP = 20.0


@dataclass(frozen=True)
class RolloutCorrection:
    """``algorithm.rollout_correction``: ``mode`` none|tis|mask, ``level`` token|sequence|geometric,
    ``threshold`` (tis: the cap C; mask: the upper bound), ``threshold_lower`` (mask only; None
    means ``1 / threshold``)."""

    mode: str = "none"
    level: str = "token"
    threshold: float = 2.0
    threshold_lower: float | None = None

    def __post_init__(self) -> None:
        key = "algorithm.rollout_correction"
        if self.mode not in CORRECTION_MODES:
            raise ValueError(f"{key}.mode={self.mode!r} is not one of {', '.join(CORRECTION_MODES)}")
        if self.level not in CORRECTION_LEVELS:
            raise ValueError(f"{key}.level={self.level!r} is not one of {', '.join(CORRECTION_LEVELS)}")
        if not self.threshold > 0:
            raise ValueError(f"{key}.threshold={self.threshold} must be > 0 (e.g. 2.0)")
        lower = self.threshold_lower
        if lower is not None:
            if self.mode == "tis":
                raise ValueError(
                    f"{key}.threshold_lower only applies to mode=mask (TIS truncates from above); set it to null"
                )
            if not 0 <= lower < self.threshold:
                raise ValueError(
                    f"{key}.threshold_lower={lower} must be in [0, threshold={self.threshold}); "
                    "null means 1/threshold"
                )

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def lower(self) -> float:
        return 1.0 / self.threshold if self.threshold_lower is None else self.threshold_lower


@dataclass
class CorrectionTerms:
    """What the loss applies: ``factor`` (B, T) multiplies each token's loss (the truncated
    weight for tis, 1/0 for mask); ``metrics`` are detached float32 0-dim tensors over the loss
    tokens: ``rc_weight_mean/max/min`` (rho at the chosen level, before truncation) and
    ``rc_fraction`` (tokens truncated (tis) or rejected (mask))."""

    factor: torch.Tensor
    metrics: dict[str, torch.Tensor]


def importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    row_sum: RowSum | None = None,
) -> torch.Tensor:
    """rho per token (B, T): ``exp(old - rollout)`` at ``level``; 1 at masked positions.
    ``row_sum`` (see :func:`~megatron_dapo.algo.aggregation.agg_loss`): with rows cut across
    ranks, the sequence levels sum the log-ratio and the token count over the whole row."""
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"level={level!r} is not one of {', '.join(CORRECTION_LEVELS)}")
    keep = mask.bool()
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    log_rho = torch.where(keep, old_logprobs.detach() - rollout_logprobs.detach(), zero)
    if level != "token":
        seq = log_rho.sum(dim=-1, keepdim=True)
        count = keep.sum(dim=-1, keepdim=True)
        if row_sum is not None:
            seq, count = row_sum(seq), row_sum(count)
        if level == "geometric":
            seq = seq / count.clamp(min=1).to(seq.dtype)
        log_rho = torch.where(keep, seq.expand_as(log_rho), zero)
    return torch.exp(torch.clamp(log_rho, min=-_LOG_CLAMP, max=_LOG_CLAMP))


def correction_terms(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    rc: RolloutCorrection,
    row_sum: RowSum | None = None,
) -> CorrectionTerms:
    """The per-token loss factor of ``rc`` (an active correction) and its metrics."""
    if not rc.active:
        raise ValueError("correction_terms needs an active correction (mode tis or mask)")
    keep = mask.bool()
    rho = importance_weights(old_logprobs, rollout_logprobs, keep, rc.level, row_sum)
    if rc.mode == "tis":
        factor = torch.clamp(rho, max=rc.threshold)
        hit = rho > rc.threshold
    else:
        inside = (rho >= rc.lower) & (rho <= rc.threshold)
        factor = inside.to(rho.dtype)
        hit = ~inside
    return CorrectionTerms(factor=factor, metrics=_metrics(rho, hit, keep))


def _metrics(rho: torch.Tensor, hit: torch.Tensor, keep: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        n = keep.sum().clamp(min=1).to(torch.float32)
        r = rho.to(torch.float32)
        zero = torch.zeros((), dtype=torch.float32, device=rho.device)
        one = torch.ones((), dtype=torch.float32, device=rho.device)
        inf = torch.tensor(float("inf"), dtype=torch.float32, device=rho.device)
        # No host sync: masked max/min by select; with no loss token they report the neutral 1.
        any_kept = keep.any()
        big = torch.where(any_kept, torch.where(keep, r, -inf).max(), one)
        small = torch.where(any_kept, torch.where(keep, r, inf).min(), one)
        return {
            "rc_weight_mean": torch.where(keep, r, zero).sum() / n,
            "rc_weight_max": big,
            "rc_weight_min": small,
            "rc_fraction": torch.where(keep & hit, 1.0, 0.0).to(torch.float32).sum() / n,
        }
