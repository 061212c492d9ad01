"""Megatron-core DDP wrapping, optimizer, LR schedule and a guarded optimizer step.

Gradient normalisation (why DDP is configured to *sum*): the actor computes each micro-batch's
loss already divided by the global normaliser of the optimizer mini-batch (all response tokens,
or sequences, of every micro-batch on every DP rank). Megatron's defaults would then divide
twice more: the pipeline schedule divides a 2-value loss by the number of micro-batches
(``forward_step_calc_loss``), and DDP pre-scales gradients by ``1 / dp_size`` before its
all-reduce (``gradient_scaling_factor`` in ``DistributedDataParallel``), i.e. it averages over DP.
With ``calculate_per_token_loss=True`` in the TransformerConfig megatron does neither: the loss
function returns ``(loss, num_tokens, metrics)`` and is back-propagated as is, and DDP uses a
scaling factor of 1, so the all-reduce sums. Its remaining per-token step, dividing all grads by
the token count in ``finalize_model_grads``, is disabled by :func:`finalize_grads_without_token_scaling`
because our loss is already normalised (and seq-mean modes normalise by sequences, not tokens).
The resulting gradient is exactly that of the unsplit mini-batch loss.

``use_distributed_optimizer`` shards the fp32 main params and Adam state over DP, on GPU and on
CPU alike (compat patch 11 lets megatron's DistributedOptimizer run on gloo), so the CPU suite
trains and checkpoints the optimizer GPU runs use. bf16 params get fp32 main params in either
optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron_dapo.actor import compat, gpu_settings
from megatron_dapo.config.knobs import from_config, knob


def training_config_overrides() -> dict[str, Any]:
    """TransformerConfig fields the train step relies on (pass to ``build_gpt_model``)."""
    # variable_seq_lengths: dynamic micro-batches differ in shape, so pipeline p2p must send
    # shapes first. TransformerConfig rejects that combination with the default MoE dispatcher
    # ("allgather") even for dense models; alltoall is the one it accepts (unused without MoE).
    return {
        "calculate_per_token_loss": True,
        "variable_seq_lengths": True,
        "moe_token_dispatcher_type": "alltoall",
    }


def wrap_ddp(
    model_chunks: list[Any],
    *,
    use_distributed_optimizer: bool = False,
    overlap_grad_reduce: bool | None = None,
    overlap_param_gather: bool | None = None,
) -> list[Any]:
    """Wrap each chunk in megatron-core's DistributedDataParallel (fp32 grad buffers, summed).
    The overlap knobs resolve through :func:`gpu_settings.ddp_overlap` (None = its default)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = model_chunks[0].config
    if not config.calculate_per_token_loss:
        raise ValueError(
            "the model config needs calculate_per_token_loss=True so DDP sums gradients; build it with "
            "build_gpt_model(..., config_overrides=optimizer.training_config_overrides())"
        )
    distributed = use_distributed_optimizer
    overlap = gpu_settings.ddp_overlap(
        not compat.on_cpu(), distributed, overlap_grad_reduce, overlap_param_gather
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap.overlap_grad_reduce,
        overlap_param_gather=overlap.overlap_param_gather,
        use_distributed_optimizer=distributed,
        average_in_collective=False,
    )
    wrapped = []
    for i, chunk in enumerate(model_chunks):
        wrapped.append(
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config,
                module=chunk,
                # Only the first chunk's buckets may be skipped (megatron's training loop does the
                # same); bucketing is irrelevant without overlap.
                disable_bucketing=i > 0,
            )
        )
    return wrapped


def finalize_grads_without_token_scaling(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron's ``finalize_model_grads`` (DP all-reduce, tied-embedding and TP norm grads) with
    the per-token division switched off: the loss is already globally normalised."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW and LR-schedule settings: config.optim's keys, with the schema's defaults."""

    lr: float = knob("optim.lr")
    min_lr: float = knob("optim.min_lr")
    weight_decay: float = knob("optim.weight_decay")
    adam_beta1: float = knob("optim.adam_beta1")
    adam_beta2: float = knob("optim.adam_beta2")
    adam_eps: float = knob("optim.adam_eps")
    clip_grad: float = knob("optim.clip_grad")
    lr_warmup_steps: int = knob("optim.lr_warmup_steps")
    lr_scheduler: str = knob("optim.lr_scheduler")
    # Optimizer updates the cosine decays over (after warmup ends it reaches min_lr here).
    lr_decay_steps: int | None = None
    use_distributed_optimizer: bool = knob("parallel.use_distributed_optimizer")
    # How checkpoints write the distributed optimizer's state (megatron-core's
    # ``distrib_optim_sharding_type``). megatron-core 0.16.1's default, fully_sharded_model_space,
    # builds ShardedTensors with flattened ranges that its own dist-checkpointing refuses at save
    # ("ShardedTensor.flattened_range is not supported"), so it is not offered.
    # - dp_reshardable: every rank writes its own buckets, no gather and no extra memory; the
    #   state is bucket-shaped, so a resume may change the DP size but not TP/PP/CP/EP/VPP.
    # - fully_reshardable: each model-parallel shard's state is gathered on its DP rank 0 (host
    #   memory: 12 bytes per parameter of the shard) and written per parameter; any layout.
    checkpoint_format: str = knob("parallel.optimizer_checkpoint_format")
    # None: the machine's default (gpu_settings.ddp_overlap).
    overlap_grad_reduce: bool | None = knob("parallel.overlap_grad_reduce")
    overlap_param_gather: bool | None = knob("parallel.overlap_param_gather")

    @classmethod
    def from_config(cls, cfg: Any) -> OptimizerSettings:
        """Build from the run's config (a DictConfig or its plain dict), validated when it was loaded."""
        return from_config(cls, cfg)


def build_optimizer(model_chunks: list[Any], settings: OptimizerSettings) -> Any:
    """Megatron-core AdamW over the DDP-wrapped chunks (decoupled weight decay, none on biases and
    norms), with grad clipping; fp32 main params for bf16/fp16 models."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model_config = model_chunks[0].config
    config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=model_config.bf16,
        fp16=model_config.fp16,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        decoupled_weight_decay=True,
    )
    return get_megatron_optimizer(config, model_chunks)


def build_scheduler(optimizer: Any, settings: OptimizerSettings, total_updates: int) -> Any:
    """Megatron's OptimizerParamScheduler: linear warmup from 0 over ``lr_warmup_steps`` updates,
    then constant, or cosine to ``min_lr`` at ``lr_decay_steps`` (default ``total_updates``)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = settings.lr_decay_steps or max(total_updates, settings.lr_warmup_steps + 1)
    if decay_steps <= settings.lr_warmup_steps:
        raise ValueError(
            f"lr_decay_steps={decay_steps} must exceed lr_warmup_steps={settings.lr_warmup_steps}"
        )
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=settings.lr_scheduler,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
    )


@dataclass(frozen=True)
class StepOutcome:
    updated: bool
    grad_norm: float
    reason: str = ""


def guarded_step(optimizer: Any, scheduler: Any, loss: float) -> StepOutcome:
    """Step the optimizer and scheduler unless the loss or the gradient norm is not finite.

    The grad norm is computed first (megatron's own, over the model-parallel group; DP grads are
    already reduced), so every rank takes the same decision; a skipped step leaves parameters,
    optimizer state and schedule untouched. Gradients are zeroed either way.

    megatron's ``optimizer.step()`` is prepare_grads + clip + step_with_ready_grads; it is
    spelled out here because the decision needs the prepared grads first, and calling ``step()``
    after ``prepare_grads()`` would prepare them twice; with fp16 in megatron-core 0.16.1 the
    visible effect is the dynamic loss scaler updated twice per step (its growth and back-off
    counted double).
    """
    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    reason = ""
    if not math.isfinite(loss):
        reason = f"non-finite loss {loss}"
    elif found_inf or not math.isfinite(grad_norm):
        reason = f"non-finite gradient norm {grad_norm}"
    if reason:
        optimizer.zero_grad()
        return StepOutcome(False, grad_norm, reason)
    _clip_main_grads(optimizer, grad_norm)
    if not optimizer.step_with_ready_grads():
        optimizer.zero_grad()
        return StepOutcome(False, grad_norm, "the optimizer refused the step")
    scheduler.step(1)
    return StepOutcome(True, grad_norm)


def _clip_main_grads(optimizer: Any, grad_norm: float) -> None:
    """Scale the prepared main grads by clip_grad / grad_norm when the norm exceeds clip_grad,
    as ``step()`` does (per inner optimizer of a ChainedOptimizer, with the shared total norm)."""
    from megatron.core.optimizer import clip_grads

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(inner, "is_stub_optimizer", False) or inner.config.clip_grad <= 0.0:
            continue
        params = inner.get_parameters()
        if params:
            # Looked up at call time: on CPU compat wraps this function in the module.
            clip_grads.clip_grad_by_total_norm_fp32(
                params,
                max_norm=inner.config.clip_grad,
                total_norm=grad_norm,
                use_decoupled_grad=inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )


def current_lr(optimizer: Any) -> float:
    groups = optimizer.param_groups
    return float(groups[0]["lr"]) if groups else 0.0


def sync_params_after_update(model_chunks: list[Any]) -> bool:
    """With overlap_param_gather the distributed optimizer's step leaves the parameter
    all-gather to the next forward's pre-hooks: until then the model's parameters hold the
    previous step's values for everything that reads them directly (weight sync, checkpoint,
    export). Gather them now, synchronously (megatron's ``disable_forward_pre_hook`` does the
    same before evaluation and checkpoints); the next forward's hooks then find every bucket
    gathered. Returns whether anything was gathered."""
    synced = False
    for chunk in model_chunks:
        cfg = getattr(chunk, "ddp_config", None)
        if cfg is not None and cfg.use_distributed_optimizer and cfg.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
            synced = True
    return synced


def zero_grads(model_chunks: list[Any], optimizer: Any) -> None:
    """Clear DDP grad buffers and optimizer grads before a mini-batch's backward passes."""
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def set_schedule_hooks(model_chunks: list[Any], optimizer: Any) -> None:
    """Point megatron's pipeline schedule at this model's DDP sync and our grad finalisation."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model_chunks[0])
    config.no_sync_func = (
        [c.no_sync for c in model_chunks] if len(model_chunks) > 1 else model_chunks[0].no_sync
    )
    # With overlap_grad_reduce the schedule starts each chunk's grad reduction as soon as its
    # last micro-batch's backward is done (megatron's training loop sets the same hooks).
    overlapped = model_chunks[0].ddp_config.overlap_grad_reduce
    config.grad_sync_func = [c.start_grad_sync for c in model_chunks] if overlapped else None
    if overlapped and len(model_chunks) == 1:
        config.grad_sync_func = config.grad_sync_func[0]
    config.param_sync_func = None
    config.finalize_model_grads_func = finalize_grads_without_token_scaling
    config.grad_scale_func = optimizer.scale_loss
