"""One pass of micro-batches through megatron's pipeline schedule: scoring or a training backward.

:func:`score_micro_batches` runs the forward-only schedule and returns per-position log-probs
(and entropy) on the last pipeline stage. :func:`backward_micro_batches` runs forward+backward
with the DAPO loss of :func:`megatron_dapo.algo.policy_loss`, each micro-batch's loss divided by
the *global* normaliser of the optimizer mini-batch (see ``actor/optimizer.py`` for how megatron's
own micro-batch and DP averaging is switched off), and returns the micro-batch metric sums.
Neither reduces anything across ranks; the caller (``actor/actor.py``) does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_dapo.actor import compat, fused_output, moe_aux_loss, routing_replay
from megatron_dapo.actor.context_parallel import cp_gather, cp_row_sum, cp_split_micro
from megatron_dapo.actor.logprobs import DEFAULT_CHUNK_TOKENS
from megatron_dapo.actor.micro_batches import MicroBatch, as_rows, row_view
from megatron_dapo.algo import (
    Aggregation,
    RolloutCorrection,
    entropy_loss,
    kl_loss,
    policy_loss,
    sequence_weights,
)

# Per-mini-batch metric sums; the token-weighted ones are divided by "tokens" after reduction.
STAT_NAMES = (
    "loss",
    "tokens",
    "seqs",
    "clipfrac",
    "clipfrac_high",
    "clipfrac_low",
    "clipfrac_lower",
    "ppo_kl",
    "entropy",
    "mismatch_tokens",
    "mismatch_abs",
    "mismatch_k3",
    "tis_mean",
    "tis_clipfrac",
    "rc_tokens",
    "rc_weight_mean",
    "rc_fraction",
    "entropy_loss",
    "kl_loss",
    "ref_tokens",
    "ref_kl",
)
# Combined by max (after STAT_NAMES in the stats vector); -inf when absent. The minimum travels
# negated so one max-reduction serves both.
EXTREME_NAMES = ("rc_weight_max", "rc_weight_neg_min")
N_STATS = len(STAT_NAMES)
_TOKEN_WEIGHTED = ("clipfrac", "clipfrac_high", "clipfrac_low", "clipfrac_lower", "ppo_kl", "entropy")


@dataclass(frozen=True)
class LossSettings:
    """What the loss of one mini-batch needs besides the data."""

    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None
    loss_agg_mode: str
    policy_loss: str  # algo/loss_terms.py's loss type (algorithm.policy_loss)
    tau_pos: float  # sapo's gate temperatures
    tau_neg: float
    entropy_coeff: float  # the entropy bonus's weight; 0: entropy not in the loss
    tis_cap: float | None
    temperature: float
    vocab_size: int
    num_tokens: float  # global normalisers of the optimizer mini-batch
    num_seqs: float
    norm_len: float
    rollout_correction: RolloutCorrection | None = None  # None / mode none: today's loss
    # MoE load-balancing loss (actor/moe_aux_loss.py): None off (dense); 0 measured, not trained
    moe_aux_loss_coeff: float | None = None
    # tokens per chunk of the fused output layer + log-prob (actor.logprob_chunk_tokens)
    logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # KL to the reference policy (micro-batches then carry ref_logprobs): kl_loss_coef x the
    # kl_type estimate aggregated like the policy loss is added when kl_loss_coef is not None
    # (actor.use_kl_loss); the estimate's token mean is reported as ref_kl either way.
    kl_loss_coef: float | None = None
    kl_type: str = "low_var_kl"

    def aggregation(self, row_sum=None) -> Aggregation:
        """The policy loss's aggregation, for the terms added to it."""
        return Aggregation(self.loss_agg_mode, self.num_tokens, self.num_seqs, self.norm_len, row_sum)


def _cp_group():
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group() if ps.get_context_parallel_world_size() > 1 else None


def _to_device(micro: MicroBatch) -> MicroBatch:
    """This rank's part of ``micro`` on the device: with context parallelism its load-balanced
    CP share (RoPE is cut the same way inside megatron, from the CP group)."""
    from megatron.core import parallel_state as ps

    micro = cp_split_micro(micro, ps.get_context_parallel_world_size(), ps.get_context_parallel_rank())
    dev = compat.device()
    fields = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in micro.__dict__.items()}
    return MicroBatch(**fields)


def _packed_seq_params(micro: MicroBatch):
    """THD ``PackedSeqParams`` of a packed micro-batch (None when padded): every sample attends
    causally to itself only, and megatron's RoPE restarts its positions at each sample. The
    boundaries are those of the whole row, also under context parallelism (megatron's THD RoPE
    and TE's attention divide them by CP themselves)."""
    if micro.cu_seqlens is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = micro.cu_seqlens.to(device=micro.tokens.device, dtype=torch.int32)
    longest = int(micro.cu_seqlens.diff().max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def _forward(model, micro: MicroBatch):
    return model(micro.tokens, micro.position_ids, None, packed_seq_params=_packed_seq_params(micro))


def _loss_view(micro: MicroBatch):
    """``(rows, micro)``: how the loss reads per-position values (``rows(x)``) and the
    micro-batch in the padded layout the loss takes; the identity when ``micro`` is padded."""
    if micro.cu_seqlens is None:
        return (lambda x: x), micro
    view = row_view(micro, _cp_size())
    return view.rows, as_rows(micro, view)


def _run_schedule(
    model_chunks: list[Any], micros: list[MicroBatch], forward_step, forward_only: bool
) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    multi = len(model_chunks) > 1
    iters = [iter(micros) for _ in model_chunks] if multi else iter(micros)
    first = micros[0]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iters,
        model=model_chunks if multi else model_chunks[0],
        num_microbatches=len(micros),
        # With variable_seq_lengths megatron sends each micro-batch's shape first; these only
        # seed the first exchange (a CP rank's share is 1/CP of the row).
        seq_length=first.tokens.shape[1] // _cp_size(),
        micro_batch_size=first.tokens.shape[0],
        forward_only=forward_only,
    )


def _cp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size()


def _tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None


def score_micro_batches(
    model_chunks: list[Any],
    micros: list[MicroBatch],
    *,
    temperature: float,
    vocab_size: int,
    with_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Forward-only log-probs and entropy ``[b, L]`` per micro-batch (CPU tensors, whole rows
    gathered over context parallelism), in order, on the last pipeline stage; an empty list
    elsewhere."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    tp_group = _tp_group()
    cp_group = _cp_group()

    def forward_step(data_iterator, model):
        micro = _to_device(next(data_iterator))
        routing_replay.apply(model, micro.routed_experts, micro.score_mask)
        with fused_output.hidden_states_out(model):
            output = _forward(model, micro)
        packed = None if micro.cu_seqlens is None else micro.cu_seqlens.tolist()

        def collect(hidden):
            lp, ent = fused_output.logprobs(
                model,
                hidden,
                micro.labels,
                vocab_size=vocab_size,
                temperature=temperature,
                tp_group=tp_group,
                with_entropy=with_entropy,
                chunk_tokens=chunk_tokens,
            )
            if cp_group is not None:
                lp = cp_gather(lp.float(), cp_group, dim=1, cu_seqlens=packed)
                ent = cp_gather(ent.float(), cp_group, dim=1, cu_seqlens=packed)
            out.append((lp.float().cpu(), ent.float().cpu()))
            zero = hidden.sum() * 0
            return zero, torch.zeros((), dtype=torch.int, device=zero.device), {}

        return output, collect

    for chunk in model_chunks:
        chunk.eval()
    with torch.no_grad():
        _run_schedule(model_chunks, micros, forward_step, forward_only=True)
    return out


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x.double(), torch.zeros((), dtype=torch.float64, device=x.device)).sum()


def micro_batch_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    micro: MicroBatch,
    settings: LossSettings,
    row_sum=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of one micro-batch (already divided by the global normaliser): the policy loss
    ``settings.policy_loss`` minus ``entropy_coeff`` times the entropy aggregated the same way,
    plus ``kl_loss_coef`` times the KL to the reference policy aggregated the same way;
    and its metric sums in :data:`STAT_NAMES` order followed by :data:`EXTREME_NAMES` (float64;
    ``loss`` is the policy loss alone, ``entropy_loss`` the aggregated entropy, ``kl_loss`` the
    aggregated KL, ``ref_kl`` the KL estimate summed over loss tokens). With no
    ``old_logprobs`` the current policy, detached, is pi_old (ratio exactly 1). ``row_sum``: with
    context parallelism, sums per-row quantities over the CP ranks
    (:func:`~megatron_dapo.actor.context_parallel.cp_row_sum`).

    GSPO's sequence ratio needs each response whole: a sample is never cut across micro-batches
    (``collate`` and ``collate_packed`` take whole samples; a packed micro-batch reaches the loss
    one sample per row, ``as_rows``), and the pieces of a row cut by context parallelism are
    summed by ``row_sum``, so no ``seq_pieces`` need to be carried between micro-batches."""
    mask = micro.loss_mask
    old = micro.old_logprobs if micro.old_logprobs is not None else logprobs.detach()
    use_tis = settings.tis_cap is not None and micro.rollout_logprobs is not None
    rc = settings.rollout_correction
    use_rc = rc is not None and rc.active and micro.rollout_logprobs is not None
    loss, m = policy_loss(
        logprobs,
        old,
        micro.advantages,
        mask,
        clip_ratio_low=settings.clip_ratio_low,
        clip_ratio_high=settings.clip_ratio_high,
        clip_ratio_c=settings.clip_ratio_c,
        loss_type=settings.policy_loss,
        tau_pos=settings.tau_pos,
        tau_neg=settings.tau_neg,
        loss_agg_mode=settings.loss_agg_mode,
        num_tokens=settings.num_tokens,
        num_seqs=settings.num_seqs,
        norm_len=settings.norm_len,
        rollout_logprobs=micro.rollout_logprobs if use_tis or use_rc else None,
        tis_cap=settings.tis_cap if use_tis else None,
        rollout_correction=rc if use_rc else None,
        row_sum=row_sum,
    )
    n = m["num_tokens"].double()
    stats = dict.fromkeys(STAT_NAMES, torch.zeros((), dtype=torch.float64, device=mask.device))
    stats["loss"] = loss.detach().double()
    # the regularisers are aggregated exactly as the policy loss (same mode and normalisers)
    agg = settings.aggregation(row_sum)
    if settings.entropy_coeff:
        ent_loss = entropy_loss(entropy, mask, agg=agg)
        stats["entropy_loss"] = ent_loss.detach().double()
        loss = loss - settings.entropy_coeff * ent_loss
    if micro.ref_logprobs is not None:
        ref_loss, ref_m = kl_loss(logprobs, micro.ref_logprobs, mask, kind=settings.kl_type, agg=agg)
        stats["ref_tokens"] = n
        stats["ref_kl"] = ref_m["ref_kl"].double() * n
        if settings.kl_loss_coef is not None:
            stats["kl_loss"] = ref_loss.detach().double()
            loss = loss + settings.kl_loss_coef * ref_loss
    stats["tokens"] = n
    stats["seqs"] = m["num_seqs"].double()
    for key in ("clipfrac", "clipfrac_high", "clipfrac_low", "clipfrac_lower", "ppo_kl"):
        stats[key] = m[key].double() * n
    stats["entropy"] = _masked_sum(entropy.detach(), mask)
    if use_tis:
        stats["tis_mean"] = m["tis_mean"].double() * n
        stats["tis_clipfrac"] = m["tis_clipfrac"].double() * n
    if use_rc:
        stats["rc_tokens"] = n
        stats["rc_weight_mean"] = m["rc_weight_mean"].double() * n
        stats["rc_fraction"] = m["rc_fraction"].double() * n
    if micro.rollout_logprobs is not None:
        # Train/inference mismatch on the loss tokens: samples come from the engine (q), so the
        # k3 estimator of KL(q || pi_old) is exp(d) - 1 - d with d = log pi_old - log q.
        d = old.detach().double() - micro.rollout_logprobs.double()
        stats["mismatch_tokens"] = n
        stats["mismatch_abs"] = _masked_sum(d.abs(), mask)
        stats["mismatch_k3"] = _masked_sum(torch.expm1(d) - d, mask)
    extremes = torch.full((len(EXTREME_NAMES),), float("-inf"), dtype=torch.float64, device=mask.device)
    if use_rc:
        extremes = torch.stack([m["rc_weight_max"].double(), -m["rc_weight_min"].double()])
    return loss, torch.cat([torch.stack([stats[k] for k in STAT_NAMES]), extremes])


def combine_stats(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """Add the sums, take the max of the extremes."""
    return torch.cat([total[:N_STATS] + part[:N_STATS], torch.maximum(total[N_STATS:], part[N_STATS:])])


def empty_stats() -> torch.Tensor:
    out = torch.zeros(N_STATS + len(EXTREME_NAMES), dtype=torch.float64)
    out[N_STATS:] = float("-inf")
    return out


def backward_micro_batches(
    model_chunks: list[Any], micros: list[MicroBatch], settings: LossSettings
) -> torch.Tensor:
    """Forward+backward of every micro-batch through the pipeline schedule; gradients land in the
    DDP buffers (DP-summed by megatron's finalize step). Returns this rank's metric sums (zeros
    off the last pipeline stage), float64 ``[len(STAT_NAMES) + len(EXTREME_NAMES)]`` on the CPU."""
    tp_group = _tp_group()
    cp_group = _cp_group()
    row_sum = cp_row_sum(cp_group) if cp_group is not None else None
    totals = empty_stats()

    def forward_step(data_iterator, model):
        micro = _to_device(next(data_iterator))
        routing_replay.apply(model, micro.routed_experts, micro.score_mask)
        rows, loss_micro = _loss_view(micro)
        if settings.moe_aux_loss_coeff is not None:
            weights = sequence_weights(loss_micro.loss_mask, settings.aggregation(row_sum))
            moe_aux_loss.prepare(model, micro.seq_ids, weights, settings.moe_aux_loss_coeff)
        with fused_output.hidden_states_out(model):
            output = _forward(model, micro)

        def loss_func(hidden):
            nonlocal totals
            lp, ent = fused_output.logprobs(
                model,
                hidden,
                micro.labels,
                vocab_size=settings.vocab_size,
                temperature=settings.temperature,
                tp_group=tp_group,
                chunk_tokens=settings.logprob_chunk_tokens,
            )
            loss, stats = micro_batch_loss(rows(lp), rows(ent), loss_micro, settings, row_sum)
            totals = combine_stats(totals, stats.cpu())
            # Three values with calculate_per_token_loss: megatron back-propagates `loss` as is.
            return loss, stats.new_tensor(int(stats[1]), dtype=torch.int), {}

        return output, loss_func

    for chunk in model_chunks:
        chunk.train()
    _run_schedule(model_chunks, micros, forward_step, forward_only=False)
    for chunk in model_chunks:
        moe_aux_loss.clear(chunk)
    return totals


def finish_stats(sums: torch.Tensor) -> dict[str, float]:
    """Turn reduced metric sums into means: token-weighted ones over the loss tokens, the
    mismatch over the tokens that had rollout log-probs."""
    s = dict(zip(STAT_NAMES, sums[:N_STATS].tolist()))
    tokens = max(s["tokens"], 1.0)
    out = {"loss": s["loss"], "tokens": s["tokens"], "seqs": s["seqs"]}
    for key in _TOKEN_WEIGHTED:
        out[key] = s[key] / tokens
    if s["tis_mean"]:
        out["tis_mean"] = s["tis_mean"] / tokens
        out["tis_clipfrac"] = s["tis_clipfrac"] / tokens
    if s["rc_tokens"]:
        out["rc_weight_mean"] = s["rc_weight_mean"] / s["rc_tokens"]
        out["rc_fraction"] = s["rc_fraction"] / s["rc_tokens"]
    ext = dict(zip(EXTREME_NAMES, sums[N_STATS:].tolist()))
    if ext["rc_weight_max"] > float("-inf"):
        out["rc_weight_max"] = ext["rc_weight_max"]
        out["rc_weight_min"] = -ext["rc_weight_neg_min"]
    if s["entropy_loss"]:
        out["entropy_loss"] = s["entropy_loss"]
    if s["ref_tokens"]:
        out["kl_loss"] = s["kl_loss"]
        out["ref_kl"] = s["ref_kl"] / s["ref_tokens"]
    if s["mismatch_tokens"]:
        out["mismatch_abs"] = s["mismatch_abs"] / s["mismatch_tokens"]
        out["mismatch_k3"] = s["mismatch_k3"] / s["mismatch_tokens"]
    return out
