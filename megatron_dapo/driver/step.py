"""One DAPO step, top to bottom: rollout -> advantages -> actor update -> weight sync ->
checkpoint -> validation. The generation mode (driver/modes.py) decides where the rollout comes
from and what runs beside the update; the trainer (driver/trainer.py) runs the steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from omegaconf import DictConfig

from megatron_dapo.driver.batch_builder import build_actor_batch
from megatron_dapo.driver.colocation import MemoryHandOff
from megatron_dapo.driver.engine_sync import EngineSync
from megatron_dapo.driver.kl_reward import KLInReward
from megatron_dapo.driver.modes import OnPolicy
from megatron_dapo.driver.progress import StepProgress
from megatron_dapo.driver.run_dir import RunDir, jsonable_record
from megatron_dapo.driver.run_state import TrainerState
from megatron_dapo.driver.stop import StopFlag
from megatron_dapo.driver.timing import PhaseTimer
from megatron_dapo.rollout.staleness import staleness_metrics


class StepHost(Protocol):
    """What a step needs from the trainer that runs it (``driver/trainer.py``'s DAPOTrainer)."""

    cfg: DictConfig
    run: RunDir
    mode: OnPolicy  # or Ahead, its subclass
    memory: MemoryHandOff
    engines: EngineSync
    stop: StopFlag
    kl_in_reward: KLInReward | None
    dump_rollouts: Callable[..., Any] | None
    validate: Callable[[int], dict[str, Any]] | None  # None without a validation set

    @property
    def state(self) -> TrainerState: ...

    def call(self, method: str, *args, limit: str, **kwargs) -> list[Any]: ...

    def save(self) -> str: ...

    def save_due(self, step: int) -> bool: ...

    def validation_due(self, step: int) -> bool: ...


# actor metric -> verl-style metrics key
ACTOR_KEYS = {
    "loss": "actor/pg_loss",
    "clipfrac": "actor/pg_clipfrac",
    "clipfrac_high": "actor/pg_clipfrac_high",
    "clipfrac_low": "actor/pg_clipfrac_low",
    "clipfrac_lower": "actor/pg_clipfrac_lower",
    "ppo_kl": "actor/ppo_kl",
    "entropy": "actor/entropy",
    "entropy_loss": "actor/entropy_loss",
    "kl_loss": "actor/kl_loss",
    "ref_kl": "actor/ref_kl",
    "grad_norm": "actor/grad_norm",
    "grad_norm_max": "actor/grad_norm_max",
    "routing_mismatch": "actor/routing_mismatch",
    "moe_aux_loss": "actor/moe_aux_loss",
    "lr": "actor/lr",
    "tokens": "actor/tokens",
    "padding_fraction": "actor/padding_fraction",
    "mismatch_abs": "actor/rollout_logprob_abs_diff",
    "mismatch_k3": "actor/rollout_k3_kl",
    "tis_mean": "actor/tis_mean",
    "tis_clipfrac": "actor/tis_clipfrac",
    "rc_weight_mean": "actor/rollout_corr_weight_mean",
    "rc_fraction": "actor/rollout_corr_fraction",
    "rc_weight_max": "actor/rollout_corr_weight_max",
    "rc_weight_min": "actor/rollout_corr_weight_min",
    "num_updates": "actor/num_updates",
    "skipped_updates": "actor/skipped_updates",
}


def run_step(t: StepHost, step: int, progress: StepProgress) -> dict[str, Any] | None:
    """Step ``step``; its metrics line, or None when a stop abandoned its rollout (the last
    finished step is then saved)."""
    cfg, state, mode, timer = t.cfg, t.state, t.mode, PhaseTimer()
    rollout = mode.rollout(step, timer, progress)
    if rollout is None:
        return None
    staleness = staleness_metrics(rollout.samples, state.weight_version)
    with timer.phase("adv"):
        batch, batch_metrics = build_actor_batch(
            rollout.samples,
            adv_estimator=cfg.algorithm.adv_estimator,
            norm_adv_by_std=cfg.algorithm.norm_adv_by_std_in_grpo,
            overlong_filter=cfg.algorithm.overlong_filter,
            groups_multiple=cfg.actor.ppo_mini_batch_size,
        )
    mode.generate_ahead(step)  # one_step_off/async: the next batches, while the actor trains
    with timer.phase("memory_swap"):
        t.memory.to_training()
    try:
        if t.kl_in_reward is not None:  # needs the actor's log-probs: after the memory swap
            with timer.phase("kl_in_reward"), progress.phase(step, "reference log-probs"):
                scored = t.call("score_old_and_ref", batch, limit="train_step_s")[0]
                batch, kl_metrics = t.kl_in_reward.apply(batch, *scored)
            batch_metrics.update(kl_metrics)
        with timer.phase("update_actor"), progress.phase(step, "actor update"):
            actor_metrics = t.call("train_step", batch, limit="train_step_s")[0]
        mode.before_sync(step, timer, progress)
        with timer.phase("sync_weights"), progress.phase(step, "weight sync"):
            sync_metrics = t.engines.step(step)
    except BaseException:
        mode.abandon()  # no rollout left running, or paused, behind the error
        raise
    mode.after_sync(step, timer, progress)
    sync_metrics.update(mode.wait_metrics(timer))
    state.step = state.weight_version = step
    state.prompts_consumed += int(rollout.metrics.get("rollout/prompts_drawn", 0))
    if t.kl_in_reward is not None:
        # part of the finished step's state from here on, so every save path (the step's own,
        # a stop during the next rollout, the last step's at exit) writes this coefficient
        state.kl_ctrl = t.kl_in_reward.state_dict()

    metrics: dict[str, Any] = {**rollout.metrics, **staleness, **batch_metrics}
    metrics.update({ACTOR_KEYS[k]: v for k, v in actor_metrics.items() if k in ACTOR_KEYS})
    metrics.update({**sync_metrics, **mode.step_metrics()})
    if t.dump_rollouts is not None:
        t.dump_rollouts(rollout, t.run.rollouts / f"step_{step}.jsonl")
    metrics["train/step"] = step
    metrics["train/prompts_consumed"] = state.prompts_consumed
    # the checkpoint needs the parameters on the device: save before parking the actor
    if t.save_due(step):
        state.step_record = jsonable_record({**metrics, **timer.metrics()})
        with timer.phase("save_checkpoint"), progress.phase(step, "checkpoint"):
            t.save()
    with timer.phase("memory_swap"):
        t.memory.to_generation()
    # a stop must fit the scheduler's grace period: no validation then
    if t.validation_due(step) and not t.stop.requested:
        with timer.phase("val"), progress.phase(step, "validation"):
            metrics.update(t.validate(step))
    metrics.update(timer.metrics())
    return metrics
