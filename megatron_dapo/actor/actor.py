"""The DAPO actor: pi_old log-probs and the optimizer mini-batch updates of one rollout step.

Every rank of the actor world calls :meth:`Actor.compute_logprobs` / :meth:`Actor.update` with
the *same* whole rollout-step :class:`ActorBatch`. Each mini-batch is split over the DP ranks
deterministically (balanced by tokens) and each rank packs its share into micro-batches by the
token budget, so ranks agree on the plan without exchanging data. The loss normaliser (response
tokens, or sequences, of the whole optimizer mini-batch) is all-reduced over DP before the
backward passes; metric sums are all-reduced over the world from the last pipeline stage's first
TP rank, so every rank returns the same metrics.

Context parallelism (CP): every CP rank of a DP replica plans the same micro-batches (rows, or
each packed sample, padded to a multiple of ``2 * CP``) and runs its load-balanced share of each row (``train_step``); the
loss normaliser is the DP-wide token count of whole sequences, gradients are summed over DP x CP
by megatron's DDP (its ``dp_cp`` group), per-token outputs are gathered over CP, and metric sums
come from every CP rank. Sequence-level quantities (``seq-mean-token-mean``'s per-row token
count, the sequence/geometric rollout-correction weights, GSPO's sequence ratio) are summed over
the CP ranks per row inside the loss (``context_parallel.cp_row_sum``); micro-batches hold whole
rows, so nothing is carried between them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.actor import compat, moe_aux_loss, routing_replay
from megatron_dapo.actor.batch import ActorBatch, BatchError
from megatron_dapo.actor.context_parallel import cp_pad_multiple
from megatron_dapo.actor.micro_batches import (
    collate,
    collate_packed,
    pack_by_real_tokens,
    pack_by_token_budget,
    pack_fixed_shape,
    packed_length,
    padding_positions,
    positions_to_response,
    split_over_ranks,
    split_to_count,
)
from megatron_dapo.actor.model import build_gpt_model
from megatron_dapo.actor.optimizer import (
    OptimizerSettings,
    build_optimizer,
    build_scheduler,
    current_lr,
    guarded_step,
    set_schedule_hooks,
    sync_params_after_update,
    training_config_overrides,
    wrap_ddp,
    zero_grads,
)
from megatron_dapo.actor.parallel import ParallelLayout, current_layout
from megatron_dapo.actor.reference import ReferenceModel
from megatron_dapo.actor.routing_replay import check_supported as check_replay_supported
from megatron_dapo.actor.train_step import (
    N_STATS,
    STAT_NAMES,
    LossSettings,
    backward_micro_batches,
    combine_stats,
    empty_stats,
    finish_stats,
    score_micro_batches,
)
from megatron_dapo.algo import RolloutCorrection
from megatron_dapo.arch import arch_spec
from megatron_dapo.config.knobs import from_config, knob
from megatron_dapo.weights.dist_ckpt import load_model_checkpoint
from megatron_dapo.weights.load import load_hf_weights
from megatron_dapo.weights.model_io import unwrap

log = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """Too many consecutive optimizer steps were skipped for a non-finite loss or gradient."""


@dataclass
class ActorConfig:
    """Actor knobs, named as in verl (``ppo_mini_batch_size`` counts prompts, i.e. groups); each
    ``knob`` takes its default from the config schema and its range is checked by ``config/validate.py``."""

    ppo_mini_batch_size: int = knob("actor.ppo_mini_batch_size")
    ppo_epochs: int = knob("actor.ppo_epochs")
    micro_batch_max_tokens: int = knob("actor.micro_batch_max_tokens")
    # Micro-batches carry samples back to back (THD, the budget counts real tokens) instead of
    # one right-padded sample per row (actor/micro_batches.py).
    pack_sequences: bool = knob("actor.pack_sequences")
    shuffle: bool = knob("actor.shuffle")
    clip_ratio_low: float = knob("algorithm.clip_ratio_low")
    clip_ratio_high: float = knob("algorithm.clip_ratio_high")
    clip_ratio_c: float | None = knob("algorithm.clip_ratio_c")
    loss_agg_mode: str = knob("algorithm.loss_agg_mode")
    # The per-token policy loss (algo/loss_terms.py) and SAPO's gate temperatures.
    policy_loss: str = knob("algorithm.policy_loss")
    tau_pos: float = knob("algorithm.tau_pos")
    tau_neg: float = knob("algorithm.tau_neg")
    # Entropy bonus: entropy_coeff x the entropy aggregated like the policy loss is subtracted.
    entropy_coeff: float = knob("algorithm.entropy_coeff")
    # Divisor of seq-mean-token-sum-norm (Dr. GRPO): a constant, the generation budget unless
    # actor.loss_scale_factor sets another (norm_len).
    loss_scale_factor: int | None = knob("actor.loss_scale_factor")
    max_response_length: int = knob("data.max_response_length")
    # Truncated importance sampling cap (needs rollout log-probs); None disables TIS.
    tis_cap: float | None = None
    # algorithm.rollout_correction (algo/rollout_correction.py); None = no correction.
    rollout_correction: RolloutCorrection | None = None
    max_consecutive_skips: int = knob("actor.max_consecutive_skips")
    seed: int = knob("trainer.seed")
    temperature: float = knob("rollout.temperature")
    pad_token_id: int = 0
    # MoE: "rollout" replays the experts the rollout engine chose (actor/routing_replay.py).
    routing_replay: str = knob("actor.routing_replay")
    # MoE load-balancing loss coefficient (actor/moe_aux_loss.py); None: the HF config's
    # router_aux_loss_coef when its output_router_logits is true, else 0 (measured, not trained).
    moe_aux_loss_coeff: float | None = knob("actor.moe_aux_loss_coeff")
    # Tokens per chunk of the output layer fused with the log-prob (actor/fused_output.py).
    logprob_chunk_tokens: int = knob("actor.logprob_chunk_tokens")
    # KL to the reference policy (actor/reference.py): as a loss term (use_kl_loss: the loss
    # gains kl_loss_coef x the kl_loss_type estimate), and/or as a reward penalty applied by the
    # driver (use_kl_in_reward, estimator kl_penalty); either builds the reference model.
    use_kl_loss: bool = knob("actor.use_kl_loss")
    kl_loss_coef: float = knob("actor.kl_loss_coef")
    kl_loss_type: str = knob("actor.kl_loss_type")
    use_kl_in_reward: bool = knob("algorithm.use_kl_in_reward")
    kl_penalty: str = knob("algorithm.kl_penalty")

    @property
    def norm_len(self) -> int:
        """seq-mean-token-sum-norm's divisor: the same every step, whatever its longest response."""
        return self.loss_scale_factor or self.max_response_length

    @property
    def needs_reference(self) -> bool:
        return self.use_kl_loss or self.use_kl_in_reward

    @property
    def ref_kl_type(self) -> str:
        """The estimator reported as ref_kl: the loss's, else the reward penalty's."""
        return self.kl_loss_type if self.use_kl_loss else self.kl_penalty

    @classmethod
    def from_config(cls, cfg: Any) -> ActorConfig:
        """Build from the run's config (a DictConfig or its plain dict), validated when it was loaded."""
        alg = cfg["algorithm"]
        return from_config(
            cls,
            cfg,
            tis_cap=alg["tis"]["cap"] if alg["tis"]["enable"] else None,
            rollout_correction=RolloutCorrection(**alg["rollout_correction"]),
        )


@dataclass
class ActorState:
    """What the actor itself must checkpoint (the rest is model, optimizer, scheduler, RNG)."""

    steps_done: int = 0
    updates_done: int = 0
    consecutive_skips: int = 0
    skipped_total: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Actor:
    """Trainer half of DAPO over DDP-wrapped megatron model chunks.

    Args:
        model_chunks: this rank's DDP-wrapped chunks (:func:`build_actor` makes them), built with
            ``optimizer.training_config_overrides()``.
        optimizer / scheduler: megatron-core optimizer and OptimizerParamScheduler over them.
        layout: this rank's :class:`ParallelLayout`.
        cfg: :class:`ActorConfig`.
        optimizer_checkpoint_format: how checkpoints write the distributed optimizer's state
            (``optimizer.OPTIMIZER_CHECKPOINT_FORMATS``).
        reference: the frozen reference policy (:class:`ReferenceModel`), required when
            ``cfg.needs_reference``.
    """

    def __init__(
        self,
        model_chunks,
        optimizer,
        scheduler,
        layout: ParallelLayout,
        cfg: ActorConfig,
        optimizer_checkpoint_format: str = "dp_reshardable",
        reference: ReferenceModel | None = None,
    ):
        if cfg.needs_reference and reference is None:
            raise ValueError(
                "actor.use_kl_loss / algorithm.use_kl_in_reward need the reference model: build the actor "
                "with build_actor (it builds one) or pass reference="
            )

        config = model_chunks[0].config
        if not (config.calculate_per_token_loss and config.variable_seq_lengths):
            raise ValueError(
                "build the model with config_overrides=optimizer.training_config_overrides() "
                "(calculate_per_token_loss and variable_seq_lengths must be on)"
            )
        self.model = model_chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.layout = layout
        self.cfg = cfg
        self.optimizer_checkpoint_format = optimizer_checkpoint_format
        self.reference = reference
        self.state = ActorState()
        last = unwrap(model_chunks[-1])
        self.vocab_size = int(getattr(last, "hf_vocab_size", None) or last.vocab_size)
        self._aux_coeff = _moe_aux_loss_coeff(
            cfg.moe_aux_loss_coeff, config, getattr(last, "hf_config", None)
        )
        # Sequence parallelism splits the sequence over TP; FP8 GEMMs need 16-aligned shards
        # (32 for MXFP8); CP cuts rows into 2 * CP chunks, each with that alignment.
        self._pad_multiple = cp_pad_multiple(
            layout.cp_size,
            layout.tp_size,
            config.sequence_parallel,
            config.fp8,
            config.fp8_recipe or "delayed",
        )
        self._micro_multiple = layout.pp_size if len(model_chunks) > 1 else 1
        if cfg.pack_sequences:
            _check_packing_supported(model_chunks)
        # padding positions, computed positions of this rank's micro-batches since the step began
        self._positions = [0, 0]
        if len(model_chunks) > 1:
            # Every micro-batch of a call is padded to one shape (see _my_micro_batches), the
            # interleaved schedule's assumption, so shapes need not be communicated.
            for chunk in model_chunks + (reference.chunks if reference else []):
                chunk.config.variable_seq_lengths = False
        set_schedule_hooks(model_chunks, optimizer)

    # ------------------------------------------------------------------ weights
    def load_model_weights(self, ckpt_dir) -> None:
        """Load the model (only) from the dist checkpoint at ``ckpt_dir``, then refresh the
        optimizer's fp32 master copies from it: with bf16/fp16 params the optimizer steps its
        masters and copies them back into the model, so masters left at the old values would
        overwrite the loaded weights at the first step."""
        load_model_checkpoint(self.model, ckpt_dir)
        self.model_weights_changed()

    def load_reference_weights(self, ckpt_dir) -> None:
        """Load the reference model from the dist checkpoint at ``ckpt_dir`` (the run's initial
        weights, ``model.megatron_path``); never a resume's checkpoint."""
        with self.reference.on_device() as chunks:
            load_model_checkpoint(chunks, ckpt_dir)

    def model_weights_changed(self) -> None:
        """Call after anything writes the model's parameters outside the optimizer (a model-only
        load): megatron's mixed-precision optimizers copy them into their fp32 master params
        (a no-op for the fp32 optimizer)."""
        self.optimizer.reload_model_params()

    # ------------------------------------------------------------------ planning
    def _my_micro_batches(self, batch: ActorBatch, indices: list[int]) -> list:
        batch = self._replayed(batch)
        lengths = batch.seq_lens.tolist()
        mine = split_over_ranks(lengths, indices, self.layout.dp_size)[self.layout.dp_rank]
        if self.cfg.pack_sequences:
            micros = self._packed_micro_batches(batch, lengths, mine)
        else:
            micros = self._padded_micro_batches(batch, lengths, mine)
        self._count_positions(micros)
        return micros

    def _count_positions(self, micros: list) -> None:
        pad, total = padding_positions(micros)
        self._positions = [self._positions[0] + pad, self._positions[1] + total]

    def _packed_micro_batches(self, batch: ActorBatch, lengths: list[int], mine: list[int]) -> list:
        groups = pack_by_real_tokens(lengths, mine, self.cfg.micro_batch_max_tokens, self._micro_multiple)
        if self.layout.ep_size > 1:
            groups = split_to_count(groups, self._max_over_data_parallel(len(groups)))
        # CP cuts every sample into 2 * CP chunks; the row's length is what SP / FP8 need.
        seq_multiple = 2 * self.layout.cp_size if self.layout.cp_size > 1 else 1
        length = None
        if len(self.model) > 1:
            # The interleaved (virtual pipeline) schedule needs equal micro-batch shapes.
            length = max(
                packed_length([lengths[i] for i in g], seq_multiple, self._pad_multiple) for g in groups
            )
        return [
            collate_packed(batch, g, self.cfg.pad_token_id, seq_multiple, self._pad_multiple, length=length)
            for g in groups
        ]

    def _padded_micro_batches(self, batch: ActorBatch, lengths: list[int], mine: list[int]) -> list:
        budget = self.cfg.micro_batch_max_tokens
        if len(self.model) > 1:
            # The interleaved (virtual pipeline) schedule needs equal micro-batch shapes.
            groups, rows, length = pack_fixed_shape(
                lengths, mine, budget, self._micro_multiple, self._pad_multiple
            )
            if self.layout.ep_size > 1:
                # Each rank's count is a multiple of PP, so the largest is too.
                groups = split_to_count(groups, self._max_over_data_parallel(len(groups)))
            return [
                collate(batch, g, self.cfg.pad_token_id, self._pad_multiple, rows=rows, length=length)
                for g in groups
            ]
        groups = pack_by_token_budget(lengths, mine, budget, self._micro_multiple)
        if self.layout.ep_size > 1:
            groups = split_to_count(groups, self._max_over_data_parallel(len(groups)))
        return [collate(batch, g, self.cfg.pad_token_id, self._pad_multiple) for g in groups]

    def _replayed(self, batch: ActorBatch) -> ActorBatch:
        """The batch whose micro-batches carry the rollout's experts only when replay is on."""
        if self.cfg.routing_replay == "none":
            return batch if batch.routed_experts is None else replace(batch, routed_experts=None)
        if batch.routed_experts is None:
            raise ValueError(
                "actor.routing_replay: rollout but the batch has no routed_experts; the rollout engine "
                "must record them (HF engine: record_routing=True; SGLang: --enable-return-routed-experts)"
            )
        return batch

    def _max_over_data_parallel(self, value: int) -> int:
        """The largest ``value`` of the data-parallel ranks (EP groups lie within them)."""
        from megatron.core import parallel_state as ps

        t = torch.tensor([value], dtype=torch.int64, device=compat.device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group(with_context_parallel=True))
        return int(t.item())

    def _reports(self) -> bool:
        """The one rank per DP replica whose numbers enter world-wide sums."""
        return self.layout.is_last_stage and self.layout.tp_rank == 0

    def _world_sum(self, t: torch.Tensor, gathered_over_cp: bool = False) -> torch.Tensor:
        """Sum over the reporting ranks; ``gathered_over_cp``: every CP rank holds the same whole
        rows (cp_gather), so only CP rank 0 contributes."""
        t = t.to(compat.device())
        if not self._reports() or (gathered_over_cp and self.layout.cp_rank != 0):
            t.zero_()
        dist.all_reduce(t)
        return t.cpu()

    def _world_stats(self, t: torch.Tensor) -> torch.Tensor:
        """World-wide sums of the metric sums and maxima of the extremes (train_step's layout)."""
        ext = t[N_STATS:].to(compat.device())
        if not self._reports():
            ext.fill_(float("-inf"))
        dist.all_reduce(ext, op=dist.ReduceOp.MAX)
        return torch.cat([self._world_sum(t[:N_STATS].clone()), ext.cpu()])

    # ------------------------------------------------------------------ scoring
    def compute_logprobs(
        self, batch: ActorBatch, temperature: float | None = None, with_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-probs ``[B, R]`` (float32) of every response token under the current weights, on
        every rank (zero beyond each response); with ``with_entropy`` also the entropy."""
        temperature = self.cfg.temperature if temperature is None else temperature
        micros = self._my_micro_batches(batch, list(range(len(batch))))
        out = self._score(self.model, micros, batch, temperature, with_entropy)
        return (out[0], out[1]) if with_entropy else out[0]

    def compute_ref_logprobs(self, batch: ActorBatch, micros: list | None = None) -> torch.Tensor:
        """Log-probs ``[B, R]`` of every response token under the reference policy, at the
        rollout temperature, on every rank; ``micros``: the plan of a pass just run on ``batch``
        (the reference then runs the same micro-batches in the same schedule)."""
        if self.reference is None:
            raise ValueError(
                "this actor has no reference model; set actor.use_kl_loss or algorithm.use_kl_in_reward"
            )
        if micros is None:
            micros = self._my_micro_batches(batch, list(range(len(batch))))
        else:
            self._count_positions(micros)
        with self.reference.on_device() as chunks:
            return self._score(chunks, micros, batch, self.cfg.temperature)[0]

    def score_old_and_ref(self, batch: ActorBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """pi_old's and the reference's log-probs ``[B, R]`` of every response token, from one
        micro-batch plan (what a KL penalty in the reward needs before the advantages)."""
        micros = self._my_micro_batches(batch, list(range(len(batch))))
        old = self._score(self.model, micros, batch, self.cfg.temperature)[0]
        return old, self.compute_ref_logprobs(batch, micros)

    def _score(
        self, chunks: list, micros: list, batch: ActorBatch, temperature: float, with_entropy: bool = False
    ) -> torch.Tensor:
        """``[1 or 2, B, R]``: the log-probs (and entropy) of ``chunks`` over ``micros``, summed
        into the response layout on every rank."""
        scored = score_micro_batches(
            chunks,
            micros,
            temperature=temperature,
            vocab_size=self.vocab_size,
            with_entropy=with_entropy,
            chunk_tokens=self.cfg.logprob_chunk_tokens,
        )
        out = torch.zeros(2 if with_entropy else 1, len(batch), batch.max_response_len, dtype=torch.float32)
        for micro, (lp, ent) in zip(micros, scored):
            positions_to_response(lp, micro, batch, out[0])
            if with_entropy:
                positions_to_response(ent, micro, batch, out[1])
        return self._world_sum(out, gathered_over_cp=True)

    # ------------------------------------------------------------------ training
    def mini_batches(self, batch: ActorBatch, epoch: int) -> list[list[int]]:
        """Sample indices of each optimizer mini-batch of ``epoch``: whole groups, shuffled by
        (seed, step, epoch) when ``shuffle``, ``ppo_mini_batch_size`` groups each."""
        groups = list(dict.fromkeys(batch.group_index.tolist()))
        size = self.cfg.ppo_mini_batch_size
        if len(groups) % size:
            raise BatchError(
                f"the batch has {len(groups)} groups, not a multiple of ppo_mini_batch_size={size}; make "
                "train_batch_size a multiple of ppo_mini_batch_size"
            )
        if self.cfg.shuffle:
            gen = torch.Generator().manual_seed(
                (self.cfg.seed * 1_000_003 + self.state.steps_done * 1009 + epoch) % (2**63)
            )
            groups = [groups[i] for i in torch.randperm(len(groups), generator=gen).tolist()]
        members: dict[int, list[int]] = {}
        for i, g in enumerate(batch.group_index.tolist()):
            members.setdefault(g, []).append(i)
        return [
            sorted(i for g in groups[k : k + size] for i in members[g]) for k in range(0, len(groups), size)
        ]

    def _normalisers(self, batch: ActorBatch, indices: list[int]) -> tuple[float, float]:
        lengths = batch.seq_lens.tolist()
        mine = split_over_ranks(lengths, indices, self.layout.dp_size)[self.layout.dp_rank]
        counts = batch.response_mask[mine].sum(dim=1)
        local = torch.tensor([float(counts.sum()), float((counts > 0).sum())], dtype=torch.float64)
        local = local.to(compat.device())
        from megatron.core import parallel_state as ps

        dist.all_reduce(local, group=ps.get_data_parallel_group())
        return float(local[0]), float(local[1])

    def _update_mini_batch(self, batch: ActorBatch, indices: list[int], norm_len: float) -> tuple:
        num_tokens, num_seqs = self._normalisers(batch, indices)
        settings = LossSettings(
            clip_ratio_low=self.cfg.clip_ratio_low,
            clip_ratio_high=self.cfg.clip_ratio_high,
            clip_ratio_c=self.cfg.clip_ratio_c,
            loss_agg_mode=self.cfg.loss_agg_mode,
            policy_loss=self.cfg.policy_loss,
            tau_pos=self.cfg.tau_pos,
            tau_neg=self.cfg.tau_neg,
            entropy_coeff=self.cfg.entropy_coeff,
            tis_cap=self.cfg.tis_cap,
            rollout_correction=self.cfg.rollout_correction,
            temperature=self.cfg.temperature,
            vocab_size=self.vocab_size,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            norm_len=norm_len,
            moe_aux_loss_coeff=self._aux_coeff,
            logprob_chunk_tokens=self.cfg.logprob_chunk_tokens,
            kl_loss_coef=self.cfg.kl_loss_coef if self.cfg.use_kl_loss else None,
            kl_type=self.cfg.ref_kl_type,
        )
        micros = self._my_micro_batches(batch, indices)
        zero_grads(self.model, self.optimizer)
        moe_aux_loss.reset_total()
        sums = self._world_stats(backward_micro_batches(self.model, micros, settings))
        if self._aux_coeff is not None:
            # every rank holds its share (its layers, its tokens, its sequences): sum them all
            aux = moe_aux_loss.take_total().to(compat.device())
            dist.all_reduce(aux)
            self._last_aux = float(aux)
        if self.layout.cp_size > 1:
            # Every CP rank counted the rows it holds a loss token of; the normaliser counted
            # whole sequences once.
            sums[STAT_NAMES.index("seqs")] = num_seqs
        # the objective back-propagated: the policy loss minus the entropy bonus plus the KL loss
        loss = float(sums[STAT_NAMES.index("loss")]) - self.cfg.entropy_coeff * float(
            sums[STAT_NAMES.index("entropy_loss")]
        )
        if self.cfg.use_kl_loss:
            loss += self.cfg.kl_loss_coef * float(sums[STAT_NAMES.index("kl_loss")])
        if num_tokens == 0:
            self.optimizer.zero_grad()
            return sums, None, "no response token in the loss"
        outcome = guarded_step(self.optimizer, self.scheduler, loss)
        return sums, outcome, outcome.reason

    def update(self, batch: ActorBatch) -> dict[str, Any]:
        """Run ``ppo_epochs`` x (groups / ``ppo_mini_batch_size``) optimizer updates on ``batch``.

        pi_old is ``batch.old_logprobs`` when given; otherwise recomputed here (forward only)
        before the first update, except when the step is a single update, where the current
        policy (detached) is pi_old. Returns the step's metrics (same on every rank): ``loss``
        (mean over updates of the mini-batch loss), token-weighted ``clipfrac``,
        ``clipfrac_high``, ``clipfrac_low``, ``clipfrac_lower``, ``ppo_kl``, ``entropy``,
        ``kl_loss`` (with ``use_kl_loss``: the KL to the reference aggregated like the loss, mean
        over updates; ``kl_loss_coef`` times it is in the objective) and ``ref_kl`` (with a
        reference model: the token mean of the ``ref_kl_type`` estimate),
        ``grad_norm`` (mean; ``grad_norm_max``), ``lr``, ``tokens`` (loss tokens of the step),
        ``mismatch_abs`` / ``mismatch_k3`` (pi_old vs rollout log-probs, when present),
        ``tis_mean`` / ``tis_clipfrac`` (with TIS), ``entropy_loss`` (with an entropy bonus: the
        entropy aggregated like the loss, mean over updates; ``loss`` is the policy loss alone,
        the objective is ``loss - entropy_coeff * entropy_loss``), ``moe_aux_loss`` (MoE: the routers'
        load-balancing loss, mean over updates, apart from ``loss``; ``moe_aux_loss_coeff`` times
        it is in the objective), ``num_updates``, ``skipped_updates`` and ``updates`` (one dict
        per mini-batch).

        Raises TrainingDivergedError after ``max_consecutive_skips`` non-finite steps in a row.
        """
        cfg = self.cfg
        if len(self.model) > 1 and compat.on_cpu():
            # Seen with megatron-core 0.16 on gloo: the interleaved 1F1B schedule (forward and
            # backward) feeds stages activations of the wrong micro-batch (losses differ from PP
            # without VPP; variable shapes fail with gradient shape mismatches), while the
            # forward-only interleaved schedule (compute_logprobs) is right.
            raise ValueError(
                "training with virtual pipeline stages (vpp) is not supported on the CPU/gloo path; "
                "use vpp=None on CPU (pp alone works)"
            )
        routing_replay.reset_counts()
        self._positions = [0, 0]
        n_mini = len(self.mini_batches(batch, 0))
        need_old = batch.old_logprobs is None and (n_mini > 1 or cfg.ppo_epochs > 1)
        need_ref = self.reference is not None and batch.ref_logprobs is None
        if need_old or need_ref:
            # the reference scores the micro-batches pi_old does, in the same schedule
            micros = self._my_micro_batches(batch, list(range(len(batch))))
            if need_old:
                batch = batch.with_old_logprobs(self._score(self.model, micros, batch, cfg.temperature)[0])
            if need_ref:
                batch = batch.with_ref_logprobs(self.compute_ref_logprobs(batch, micros))
        norm_len = float(cfg.norm_len)
        step_sums = empty_stats()
        updates: list[dict[str, Any]] = []
        mismatch = [STAT_NAMES.index(k) for k in ("mismatch_tokens", "mismatch_abs", "mismatch_k3")]
        for epoch in range(cfg.ppo_epochs):
            for indices in self.mini_batches(batch, epoch):
                sums, outcome, reason = self._update_mini_batch(batch, indices, norm_len)
                if epoch > 0:
                    sums[mismatch] = 0.0  # each sample's mismatch counts once per step
                step_sums = combine_stats(step_sums, sums)
                record = finish_stats(sums)
                if self._aux_coeff is not None:
                    record["moe_aux_loss"] = self._last_aux
                record.update(
                    updated=bool(outcome and outcome.updated),
                    grad_norm=outcome.grad_norm if outcome else 0.0,
                    lr=current_lr(self.optimizer),
                )
                updates.append(record)
                self._account(outcome, reason)
        # With overlap_param_gather the last step's parameters are not gathered yet; the weight
        # sync and checkpoints read them next, without a forward.
        sync_params_after_update(self.model)
        self.state.steps_done += 1
        out = self._summary(step_sums, updates, epochs=cfg.ppo_epochs)
        out["padding_fraction"] = self._padding_fraction()
        if cfg.routing_replay == "rollout":
            out["routing_mismatch"] = self._routing_mismatch()
        return out

    def _padding_fraction(self) -> float:
        """Fraction of the token positions the step computed (pi_old and every update, all DP
        replicas) that were padding."""
        counts = self._world_sum(torch.tensor(self._positions, dtype=torch.float64), gathered_over_cp=True)
        return float(counts[0] / counts[1].clamp(min=1))

    def _routing_mismatch(self) -> float:
        """Fraction of (response token, MoE layer) routings of this step's forwards where the
        trainer's own top-k differs from the replayed rollout choice, over all ranks (each rank
        counts its tokens of its layers)."""
        counts = routing_replay.take_counts().to(compat.device())
        dist.all_reduce(counts)
        return float(counts[0] / counts[1].clamp(min=1))

    def _account(self, outcome, reason: str) -> None:
        if outcome is not None and outcome.updated:
            self.state.updates_done += 1
            self.state.consecutive_skips = 0
            return
        self.state.skipped_total += 1
        if outcome is None:  # nothing to learn from (all tokens masked): not a failure
            log.warning("skipped an optimizer update: %s", reason)
            return
        self.state.consecutive_skips += 1
        log.warning(
            "skipped optimizer update %d of rollout step %d: %s (%d in a row, limit %d)",
            self.state.updates_done + self.state.skipped_total,
            self.state.steps_done,
            reason,
            self.state.consecutive_skips,
            self.cfg.max_consecutive_skips,
        )
        if self.state.consecutive_skips >= self.cfg.max_consecutive_skips:
            raise TrainingDivergedError(
                f"{self.state.consecutive_skips} consecutive optimizer updates were skipped (last: {reason}); "
                "training has diverged. Lower the learning rate, check the data/rewards, or resume from an "
                "earlier checkpoint (max_consecutive_skips sets the limit)"
            )

    def _summary(self, step_sums: torch.Tensor, updates: list[dict[str, Any]], epochs: int) -> dict[str, Any]:
        out = finish_stats(step_sums)
        out["tokens"] = out["tokens"] / epochs
        out["seqs"] = out["seqs"] / epochs
        done = [u for u in updates if u["updated"]]
        out["loss"] = sum(u["loss"] for u in updates) / len(updates)
        for key in ("entropy_loss", "kl_loss"):  # like the loss: a mean over updates, not their sum
            if key in out:
                out[key] = sum(u.get(key, 0.0) for u in updates) / len(updates)
        if not self.cfg.use_kl_loss:
            out.pop("kl_loss", None)  # ref_kl alone: the reference serves the reward penalty
        if self._aux_coeff is not None:
            # reported apart from the policy loss; its coefficient times it is in the objective
            out["moe_aux_loss"] = sum(u["moe_aux_loss"] for u in updates) / len(updates)
        norms = [u["grad_norm"] for u in done]
        out["grad_norm"] = sum(norms) / len(norms) if norms else float("nan")
        out["grad_norm_max"] = max(norms) if norms else float("nan")
        out["lr"] = current_lr(self.optimizer)
        out["num_updates"] = len(done)
        out["skipped_updates"] = len(updates) - len(done)
        out["updates"] = updates
        return out


def _check_packing_supported(model_chunks: list) -> None:
    """Packed micro-batches need an attention that takes THD ``PackedSeqParams``: the SDPA one
    or Transformer Engine's; megatron's unfused ``DotProductAttention`` (kept for softmax
    offsets and sliding windows) refuses them."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for chunk in model_chunks:
        for module in chunk.modules():
            if type(module) is DotProductAttention:
                raise ValueError(
                    "actor.pack_sequences: megatron's unfused DotProductAttention (the local spec's "
                    "fallback for softmax offsets / sliding windows) cannot run packed sequences; set "
                    "actor.pack_sequences=false"
                )


def _moe_aux_loss_coeff(asked: float | None, config: Any, hf_config: Any) -> float | None:
    """The load-balancing loss coefficient the actor trains with: None for a dense model (nothing
    computed), ``asked`` or, when unset, the HF config's (``ArchSpec.router_aux_loss_coef``)."""
    if not getattr(config, "num_moe_experts", None):
        if asked:
            raise ValueError(
                f"actor.moe_aux_loss_coeff={asked} is for MoE models; this model has no router (set it to null)"
            )
        return None
    if asked is None:
        asked = arch_spec(hf_config).router_aux_loss_coef if hf_config is not None else 0.0
    if getattr(config, "recompute_granularity", None):
        # Activation recomputation reruns the routers in backward; the loss would then be taken
        # there, which the CPU tests cannot check (megatron's recompute needs CUDA RNG states).
        if asked:
            raise ValueError(
                f"actor.moe_aux_loss_coeff={asked} does not support activation recomputation "
                "(model.recompute); set model.recompute=false or actor.moe_aux_loss_coeff=0"
            )
        return None  # not measured either
    return float(asked)


def build_actor(
    hf_dir,
    cfg: ActorConfig,
    optim: OptimizerSettings,
    *,
    total_updates: int,
    params_dtype: torch.dtype = torch.float32,
    load_weights: bool = True,
    use_te: bool | None = None,
    model_kwargs: dict[str, Any] | None = None,
) -> Actor:
    """Build the model from the HF checkpoint at ``hf_dir`` (weights loaded unless
    ``load_weights`` is False, e.g. before a resume), wrap it in DDP, create the optimizer and the
    schedule over ``total_updates`` optimizer updates, and return the :class:`Actor`.

    Call :func:`megatron_dapo.actor.parallel.init_parallel` first; the layout is taken from it.
    """
    layout = current_layout()
    kwargs = dict(model_kwargs or {})
    overrides = {**kwargs.pop("config_overrides", {}), **training_config_overrides()}
    if cfg.routing_replay == "rollout":
        overrides["moe_enable_routing_replay"] = True

    # perform_initialization stays on even when HF weights overwrite it: megatron-core 0.16 sets
    # the tensor-parallel attributes of its linear weights (``tensor_model_parallel``) only inside
    # the init functions, and without them the grad norm counts TP shards of rank 0 only.
    def build() -> list:
        return build_gpt_model(
            hf_dir,
            params_dtype=params_dtype,
            use_te=use_te,
            perform_initialization=True,
            config_overrides=overrides,
            **kwargs,
        )

    chunks = build()
    reference = None
    if cfg.needs_reference:
        # the same model, layout and initial weights; model.megatron_path is loaded by the caller
        ref_chunks = build()
        if load_weights:
            load_hf_weights(ref_chunks, hf_dir)
        reference = ReferenceModel(ref_chunks)
    if cfg.routing_replay == "rollout":
        check_replay_supported(chunks[0].config)
        routing_replay.keep_only_instances_of(chunks + (reference.chunks if reference else []))
    if load_weights:
        load_hf_weights(chunks, hf_dir)
    chunks = wrap_ddp(
        chunks,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        overlap_grad_reduce=optim.overlap_grad_reduce,
        overlap_param_gather=optim.overlap_param_gather,
    )
    optimizer = build_optimizer(chunks, optim)
    scheduler = build_scheduler(optimizer, optim, total_updates)
    return Actor(chunks, optimizer, scheduler, layout, cfg, optim.checkpoint_format, reference=reference)
