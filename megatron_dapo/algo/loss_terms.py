"""Per-token policy-gradient terms, one per verl ``policy_loss.loss_mode`` name.

Each term turns a batch of log-probs into a (B, T) loss matrix and its metrics; it does not
aggregate. :func:`megatron_dapo.algo.policy_loss` multiplies the matrix by the rollout-correction
factor and reduces it with :func:`~megatron_dapo.algo.aggregation.agg_loss` and the caller's
global normalisers, so every loss is normalised across micro-batches and ranks the same way.

With ``r = pi / pi_old`` per token (log-ratio clamped to +-20 before ``exp``, as verl), ``A``
the advantage, ``eps_low/eps_high`` the clip ratios, ``sg`` stop-gradient:

- ``vanilla``: PPO-clip with DAPO's decoupled bounds, ``max(-A r, -A clip(r, 1-eps_low,
  1+eps_high))``; with ``clip_ratio_c`` the dual clip bounds it by ``-A c`` where ``A < 0``.
- ``gspo`` (Zheng et al. 2025, arXiv:2507.18071): the sequence ratio ``s_i = exp(mean_t log r_it)``
  (the geometric mean over the whole response), given every token as
  ``s_it = sg(s_i) * pi_it / sg(pi_it)`` so that its value is ``s_i`` and its gradient is
  ``s_i * grad log pi_it``; then the same clip as vanilla, no dual clip. ``log s_it`` is clamped
  above at 10 and the log-ratio is not clamped, as verl does.
- ``cispo`` (MiniMax-M1, arXiv:2506.13585): ``-sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi``.
  Every token keeps a gradient; the clipped weight only scales it.
- ``sapo`` (arXiv:2511.20347): ``-A * 4/tau * sigmoid(tau (r - 1))`` with ``tau = tau_pos`` where
  ``A > 0`` and ``tau_neg`` elsewhere: a soft gate instead of a hard clip; at ``r = 1`` its
  gradient is the vanilla one.
- ``gpg`` (arXiv:2504.02546): the plain policy gradient ``-A * log pi``, no ratio.

verl 0.9 aggregates ``gspo`` and ``sapo`` with ``seq-mean-token-mean`` whatever
``loss_agg_mode`` says; here the mode is honoured, so those two equal verl's numbers with
``loss_agg_mode='seq-mean-token-mean'``. verl's ``vanilla`` always dual-clips (``clip_ratio_c``
default 3); here ``clip_ratio_c=None`` turns the dual clip off.

GSPO's ``s_i`` needs the whole response. :class:`SequencePieces` holds the two per-row sums it
is made of (the log-ratio sum and the token count); pieces of one row add, so a caller whose
rows are cut (context parallelism, or a row split across micro-batches) sums them over the
pieces first and passes the total.

Pure torch: no torch.distributed, no Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

# verl clamps log(ratio) to +-20 before exp so a stale token cannot overflow the ratio.
LOG_RATIO_CLAMP = 20.0
# verl's GSPO clamps the token-level log sequence ratio above only, at 10.
_GSPO_LOG_RATIO_MAX = 10.0

POLICY_LOSS_TYPES = ("vanilla", "gspo", "cispo", "sapo", "gpg")

# Every term reports these (0 where a loss has no such clip), so a caller reads one set of keys.
METRIC_NAMES = ("clipfrac", "clipfrac_high", "clipfrac_low", "clipfrac_lower", "ppo_kl")


@dataclass(frozen=True)
class LossParams:
    """The knobs of the terms. ``clip_ratio_low/high``: vanilla, gspo, cispo (``clip_ratio_low=1``
    removes the lower bound, as CISPO's paper does); ``clip_ratio_c``: vanilla's dual clip (None:
    off); ``tau_pos/tau_neg``: sapo's gate temperatures (verl's defaults 1.0 and 1.05)."""

    # No defaults: the run's come from the config schema (algorithm.*), policy_loss's from its signature.
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None
    tau_pos: float
    tau_neg: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_ratio_low <= 1.0:
            raise ValueError(f"clip_ratio_low must be in [0, 1], got {self.clip_ratio_low} (DAPO: 0.2)")
        if self.clip_ratio_high < 0.0:
            raise ValueError(f"clip_ratio_high must be >= 0, got {self.clip_ratio_high} (DAPO: 0.28)")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(
                f"clip_ratio_c (dual-clip bound) must be > 1, got {self.clip_ratio_c}; use None to disable dual-clip"
            )
        for name in ("tau_pos", "tau_neg"):
            if not getattr(self, name) > 0.0:
                raise ValueError(
                    f"{name} must be > 0 (SAPO's gate temperature; verl: 1.0 / 1.05), got {getattr(self, name)}"
                )


@dataclass(frozen=True)
class SequencePieces:
    """Per-row sums a sequence-level ratio is made of: ``log_ratio_sum`` (B,) is
    ``sum_t (logprobs - old_logprobs)`` over the row's loss tokens, ``num_tokens`` (B,) their
    count. No gradient. Pieces of the same rows add (``a + b``); the whole rows' pieces give
    GSPO's ``log s_i = log_ratio_sum / num_tokens``."""

    log_ratio_sum: torch.Tensor
    num_tokens: torch.Tensor

    def __add__(self, other: SequencePieces) -> SequencePieces:
        return SequencePieces(self.log_ratio_sum + other.log_ratio_sum, self.num_tokens + other.num_tokens)

    def mean_log_ratio(self) -> torch.Tensor:
        """(B,) ``log s_i``; 0 for a row with no loss token."""
        return self.log_ratio_sum / self.num_tokens.clamp(min=1).to(self.log_ratio_sum.dtype)


def sequence_pieces(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> SequencePieces:
    """This call's :class:`SequencePieces` of (B, T) log-probs; masked positions may hold any
    value. Computed in float32, or float64 for float64 inputs (the dtype the loss uses)."""
    keep = mask.bool()
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    diff = logprobs.detach().to(dtype) - old_logprobs.detach().to(dtype)
    return SequencePieces(torch.where(keep, diff, zero).sum(dim=-1), keep.sum(dim=-1))


@dataclass
class TokenTerms:
    """A term's (B, T) loss matrix (meaningful at mask positions only) and its metrics: detached
    float32 0-dim means over this call's loss tokens, named :data:`METRIC_NAMES`."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


class TokenLoss(Protocol):
    """A per-token term. Inputs are (B, T) in one float dtype with masked positions zeroed:
    ``logprobs`` carries the graph, ``old_logprobs`` and ``advantages`` do not. ``seq``: the whole
    rows' :class:`SequencePieces` (terms that need no sequence quantity ignore it)."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        keep: torch.Tensor,
        params: LossParams,
        seq: SequencePieces,
    ) -> TokenTerms: ...


def vanilla(logprobs, old_logprobs, advantages, keep, params, seq) -> TokenTerms:
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    neg_adv = advantages < 0
    if params.clip_ratio_c is not None:
        loss3 = -advantages * params.clip_ratio_c
        per_token = torch.where(neg_adv, torch.minimum(clipped, loss3), clipped)
        dual_clipped = neg_adv & (clipped > loss3)
    else:
        per_token = clipped
        dual_clipped = None
    metrics = _metrics(
        keep,
        clipfrac=loss2 > loss1,
        clipfrac_high=(advantages > 0) & (ratio > 1.0 + params.clip_ratio_high),
        clipfrac_low=neg_adv & (ratio < 1.0 - params.clip_ratio_low),
        clipfrac_lower=dual_clipped,
        ppo_kl=-log_ratio,
    )
    return TokenTerms(per_token, metrics)


def gspo(logprobs, old_logprobs, advantages, keep, params, seq) -> TokenTerms:
    seq_log_ratio = seq.mean_log_ratio().to(logprobs.dtype).detach()
    # value log s_i, gradient d log pi_it: the stop-gradient trick of the paper's GSPO-token
    log_s = logprobs - logprobs.detach() + seq_log_ratio.unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=_GSPO_LOG_RATIO_MAX))
    loss1 = -advantages * s
    loss2 = -advantages * torch.clamp(s, 1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    metrics = _metrics(
        keep,
        clipfrac=loss2 > loss1,
        clipfrac_high=(advantages > 0) & (s > 1.0 + params.clip_ratio_high),
        clipfrac_low=(advantages < 0) & (s < 1.0 - params.clip_ratio_low),
        ppo_kl=old_logprobs - logprobs,
    )
    return TokenTerms(torch.maximum(loss1, loss2), metrics)


def cispo(logprobs, old_logprobs, advantages, keep, params, seq) -> TokenTerms:
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    high, low = 1.0 + params.clip_ratio_high, 1.0 - params.clip_ratio_low
    weight = torch.clamp(ratio, low, high).detach()
    # the weight is clipped whatever the advantage's sign: the fractions do not look at A
    metrics = _metrics(
        keep,
        clipfrac=(ratio > high) | (ratio < low),
        clipfrac_high=ratio > high,
        clipfrac_low=ratio < low,
        ppo_kl=-log_ratio,
    )
    return TokenTerms(-weight * advantages * logprobs, metrics)


def sapo(logprobs, old_logprobs, advantages, keep, params, seq) -> TokenTerms:
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(params.tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(params.tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return TokenTerms(-gate * advantages, _metrics(keep, ppo_kl=-log_ratio))


def gpg(logprobs, old_logprobs, advantages, keep, params, seq) -> TokenTerms:
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    return TokenTerms(-advantages * logprobs, _metrics(keep, ppo_kl=-log_ratio))


POLICY_LOSSES: dict[str, TokenLoss] = {
    "vanilla": vanilla,
    "gspo": gspo,
    "cispo": cispo,
    "sapo": sapo,
    "gpg": gpg,
}

# Terms that read SequencePieces: only they make policy_loss sum pieces over a cut row.
SEQUENCE_LEVEL = frozenset({"gspo"})


def check_loss_type(loss_type: str) -> None:
    if loss_type not in POLICY_LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {', '.join(POLICY_LOSS_TYPES)}")


def _metrics(keep: torch.Tensor, **values: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Float32 means over ``keep`` of each named value (a bool or float (B, T)); missing names
    and None are 0."""
    with torch.no_grad():
        n = keep.sum().clamp(min=1).to(torch.float32)
        zero = torch.zeros((), dtype=torch.float32, device=keep.device)
        out = {}
        for name in METRIC_NAMES:
            x = values.get(name)
            out[name] = zero.clone() if x is None else torch.where(keep, x.to(torch.float32), zero).sum() / n
        return out
