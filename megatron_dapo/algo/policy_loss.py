"""The policy-gradient loss: a per-token term chosen by name, the rollout correction, the aggregation."""

from __future__ import annotations

import torch

from megatron_dapo.algo.aggregation import Aggregation, RowSum
from megatron_dapo.algo.loss_terms import (
    POLICY_LOSSES,
    SEQUENCE_LEVEL,
    LossParams,
    SequencePieces,
    check_loss_type,
    sequence_pieces,
)
from megatron_dapo.algo.rollout_correction import RolloutCorrection, correction_terms


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "vanilla",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    loss_agg_mode: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    norm_len: int | float | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    rollout_correction: RolloutCorrection | None = None,
    row_sum: RowSum | None = None,
    seq_pieces: SequencePieces | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's ``compute_policy_loss_<loss_type>`` followed by ``agg_loss``.

    ``loss_type`` names the per-token term (verl's ``policy_loss.loss_mode``; formulas in
    :mod:`megatron_dapo.algo.loss_terms`): ``vanilla`` (default: DAPO's decoupled-clip PPO loss),
    ``gspo``, ``cispo``, ``sapo`` or ``gpg``. The vanilla term, with
    ``r = exp(clamp(logprobs - old_logprobs, -20, 20))`` and advantage ``A``::

        l1 = -A * r
        l2 = -A * clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)
        l  = max(l1, l2)
        if clip_ratio_c is not None and A < 0:      # dual-clip (Ye et al. 2019)
            l = min(l, -A * clip_ratio_c)

    then, with TIS, ``l *= w`` where ``w = min(exp(old_logprobs - rollout_logprobs), tis_cap)``
    (a constant: no gradient), and finally ``agg_loss(l, mask, loss_agg_mode, num_tokens,
    num_seqs, norm_len=norm_len)`` (see :func:`agg_loss` for the modes and normalisers). Every
    loss type goes through the same correction and aggregation.

    Args:
        logprobs: (B, T) current-policy log-probs of the response tokens (carries the graph).
        old_logprobs: (B, T) log-probs under pi_old (recomputed by the trainer).
        advantages: (B,) per sample or (B, T) per token.
        mask: (B, T) bool/0-1 response mask; masked positions may hold any values.
        loss_type: one of :data:`~megatron_dapo.algo.loss_terms.POLICY_LOSS_TYPES`.
        clip_ratio_low / clip_ratio_high: DAPO's decoupled eps_low / eps_high (vanilla, gspo,
            cispo).
        clip_ratio_c: dual-clip bound (> 1; the 32B recipe uses 10); None disables dual-clip.
            Vanilla only, as verl.
        tau_pos / tau_neg: SAPO's gate temperatures for positive / other advantages (sapo only).
        loss_agg_mode, num_tokens, num_seqs, norm_len: passed to :func:`agg_loss`.
        rollout_logprobs: (B, T) log-probs from the rollout engine (the behaviour policy); with
            ``tis_cap`` enables truncated importance sampling, with an active
            ``rollout_correction`` that correction. Give it with exactly one of them.
        tis_cap: truncation cap of the TIS weight (> 0, e.g. 2).
        rollout_correction: ``algorithm.rollout_correction`` (see
            :mod:`megatron_dapo.algo.rollout_correction`): each token's loss is multiplied
            by its factor (truncated weight or 1/0 mask) before the aggregation, whose
            normalisers do not change. None or mode ``none`` leaves the loss bit for bit as is.
        row_sum: with each row cut across ranks (context parallelism), sums a per-row tensor
            over the ranks holding its pieces, so that the whole-sequence quantities
            (``seq-mean-*`` token counts, sequence/geometric correction weights, GSPO's sequence
            ratio) are those of the whole row; see :func:`agg_loss`. None: rows are whole here.
        seq_pieces: the whole rows' :class:`~megatron_dapo.algo.loss_terms.SequencePieces`
            (:func:`~megatron_dapo.algo.loss_terms.sequence_pieces` of every piece of each row,
            summed) when the rows here are pieces and the caller has summed them beforehand
            (a row split across micro-batches computed one after the other). They give GSPO's
            sequence ratio and the ``seq-mean-*`` token counts, and ``row_sum`` is not applied
            to those; the sequence-level rollout corrections still need ``row_sum``.

    The loss is computed in float32, or float64 when the inputs are float64; bf16/fp16 inputs
    are upcast, and the loss has that dtype.

    Returns:
        ``(loss, metrics)``. ``metrics`` holds detached 0-dim tensors. The fractions and means
        are over this call's unmasked tokens, so a caller combining micro-batches/ranks weighs
        each by its ``num_tokens``: ``global = sum(m_i * num_tokens_i) / sum(num_tokens_i)``.

        - ``clipfrac`` (float32): fraction of tokens where ``l2 > l1``, i.e. the clipped term is
          taken (verl's ``pg_clipfrac``); for cispo where the weight is clipped; 0 for sapo and
          gpg, which do not clip.
        - ``clipfrac_high``: fraction of tokens with ``A > 0`` and ``r > 1 + clip_ratio_high``
          (clipped at the upper bound, DAPO's clip-higher; gspo: the sequence ratio; cispo: any
          ``A``).
        - ``clipfrac_low``: fraction of tokens with ``A < 0`` and ``r < 1 - clip_ratio_low``.
          ``clipfrac_high + clipfrac_low == clipfrac`` except for float rounding ties.
        - ``clipfrac_lower``: fraction of tokens with ``A < 0`` where dual-clip bounds the loss
          (``l > -A * clip_ratio_c``; verl's ``pg_clipfrac_lower``); 0 without dual-clip.
        - ``ppo_kl``: mean of ``old_logprobs - logprobs`` (after the +-20 clamp; gspo: unclamped,
          as verl).
        - ``tis_mean``, ``tis_clipfrac`` (only with TIS): mean TIS weight after truncation;
          fraction of tokens whose untruncated weight exceeds ``tis_cap``.
        - ``rc_weight_mean/max/min``, ``rc_fraction`` (only with an active rollout_correction):
          see :class:`~megatron_dapo.algo.rollout_correction.CorrectionTerms`.
        - ``num_tokens`` (int64): unmasked tokens in this call; ``num_seqs`` (int64): sequences
          with at least one unmasked token.
    """
    rc = rollout_correction if rollout_correction is not None and rollout_correction.active else None
    check_loss_type(loss_type)
    _check_args(logprobs, old_logprobs, advantages, mask, rollout_logprobs, tis_cap, rc, seq_pieces)
    params = LossParams(clip_ratio_low, clip_ratio_high, clip_ratio_c, tau_pos, tau_neg)

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    keep = mask.bool()
    n_tok = keep.sum()

    def clean(x: torch.Tensor) -> torch.Tensor:
        # Zero the masked positions up front: padding may hold inf/NaN, and a select keeps them
        # out of both the forward value and the backward pass.
        return torch.where(keep, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))

    lp = clean(logprobs)
    old = clean(old_logprobs.detach())
    adv = advantages.detach().to(dtype)
    adv = adv.unsqueeze(-1).expand_as(lp) if adv.dim() == 1 else clean(adv)

    row_tokens = None if seq_pieces is None else seq_pieces.num_tokens
    if seq_pieces is None and loss_type in SEQUENCE_LEVEL:
        seq_pieces = sequence_pieces(lp, old, keep)
        if row_sum is not None:
            seq_pieces = SequencePieces(row_sum(seq_pieces.log_ratio_sum), row_sum(seq_pieces.num_tokens))
            row_tokens = seq_pieces.num_tokens  # the counts are summed already: no second collective
    terms = POLICY_LOSSES[loss_type](lp, old, adv, keep, params, seq_pieces)
    per_token, metrics = terms.loss, terms.metrics

    if rc is not None:
        correction = correction_terms(old, clean(rollout_logprobs.detach()), keep, rc, row_sum)
        per_token = per_token * correction.factor
        metrics.update(correction.metrics)
    elif rollout_logprobs is not None:
        raw_w = torch.exp(old - clean(rollout_logprobs.detach()))
        weight = torch.clamp(raw_w, max=tis_cap)
        per_token = per_token * weight
        metrics["tis_mean"] = _masked_mean(weight, keep, n_tok)
        metrics["tis_clipfrac"] = _masked_mean(raw_w > tis_cap, keep, n_tok)

    loss = Aggregation(loss_agg_mode, num_tokens, num_seqs, norm_len, row_sum, row_tokens)(per_token, keep)
    metrics["num_tokens"] = n_tok.detach()
    metrics["num_seqs"] = (keep.sum(dim=-1) > 0).sum().detach()
    return loss, metrics


def _masked_mean(x: torch.Tensor, keep: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Float32 mean of ``x`` over ``keep``; 0 when nothing is kept."""
    x = torch.where(keep, x.to(torch.float32), torch.zeros((), dtype=torch.float32, device=x.device))
    return (x.sum() / n.clamp(min=1).to(torch.float32)).detach()


def _check_args(logprobs, old_logprobs, advantages, mask, rollout_logprobs, tis_cap, rc, seq_pieces) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask), ("rollout_logprobs", rollout_logprobs)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(t.shape)}")
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(
            f"advantages must be (B,) per sample or (B, T) per token with (B, T) = {tuple(shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    if seq_pieces is not None:
        for name in ("log_ratio_sum", "num_tokens"):
            got = getattr(seq_pieces, name).shape
            if got != shape[:1]:
                raise ValueError(f"seq_pieces.{name} must be (B,) = {tuple(shape[:1])}, got {tuple(got)}")
    if rc is not None:
        if tis_cap is not None:
            raise ValueError(
                "algorithm.tis and algorithm.rollout_correction are two corrections of the same gap; "
                "use rollout_correction.mode=tis instead of tis.enable"
            )
        if rollout_logprobs is None:
            raise ValueError(
                f"rollout_correction mode={rc.mode} needs the rollout log-probs (the behaviour policy); "
                "pass rollout_logprobs"
            )
    elif (rollout_logprobs is None) != (tis_cap is None):
        raise ValueError(
            "truncated importance sampling needs both rollout_logprobs and tis_cap; pass both to "
            "enable it or neither to disable it"
        )
    if tis_cap is not None and tis_cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
