"""The DAPO trainer: resume, run the steps (driver/step.py), stop cleanly.

The step itself is `step.run_step`. The pieces it runs on are built here from what the caller
hands in: the run state and its checkpoint (driver/run_state.py), the generation mode
(driver/modes.py: on-policy, or ahead by K), the weight sync with the engine pool's restart and
drop (driver/engine_sync.py) and, with engines colocated on the actor's GPUs, the device-memory
hand-over (driver/colocation.py). Placement (Ray actors or torchrun ranks, engine kind) is decided
by the caller; the loop is the same for all of them.
"""

from __future__ import annotations

import json
from typing import Any

from omegaconf import DictConfig

from megatron_dapo.driver.colocation import MemoryHandOff
from megatron_dapo.driver.engine_sync import EngineSync
from megatron_dapo.driver.kl_reward import KLInReward
from megatron_dapo.driver.modes import make_mode
from megatron_dapo.driver.progress import StepProgress
from megatron_dapo.driver.rank_group import RankCallError
from megatron_dapo.driver.run_dir import MetricsLogger, RunDir
from megatron_dapo.driver.run_state import RunState, TrainerState
from megatron_dapo.driver.step import run_step
from megatron_dapo.driver.stop import StopFlag
from megatron_dapo.driver.test_hold import hold_after_step
from megatron_dapo.rollout.manager_protocol import ManagerProtocol


class DAPOTrainer:
    def __init__(
        self,
        cfg: DictConfig,
        *,
        run: RunDir,
        ranks,
        manager: ManagerProtocol,
        dataset,
        transport_sync,
        validate=None,
        stop: StopFlag | None = None,
        dump_rollouts=None,
        colocated_engines=(),
    ):
        """
        ranks: a rank group (`call(method, ...)`) of `ActorWorker`s.
        manager: the rollout manager (`rollout.manager_protocol.ManagerProtocol`).
        transport_sync: callable(version) -> metrics; pushes the actor's weights to every engine.
        validate: callable(step) -> metrics, or None when there is no validation set.
        colocated_engines: engines that share the actor's GPUs: they give their memory back while
            the actor trains and take it again for the weight sync.
        """
        self.cfg = cfg
        self.run = run
        self.ranks = ranks
        self.validate = validate
        self.stop = stop or StopFlag()
        self.dump_rollouts = dump_rollouts
        self.run_state = RunState(cfg, run, manager, dataset, self.call)
        self.memory = MemoryHandOff(colocated_engines, self.call)
        self.engines = EngineSync(manager.pool, self.call, self.memory, transport_sync)
        self.mode = make_mode(cfg, manager, dataset, self.run_state, self.engines, self.stop)
        self.kl_in_reward = KLInReward(cfg.algorithm) if cfg.algorithm.use_kl_in_reward else None
        manager.should_stop = lambda: self.stop.requested or self.mode.cancelled

    @property
    def state(self) -> TrainerState:
        return self.run_state.state

    def save(self) -> str:
        return self.run_state.save(self.mode.carried())

    def last_checkpoint(self) -> str:
        """For messages: the checkpoint a resume would start from now."""
        return self.run_state.last_checkpoint()

    def save_due(self, step: int) -> bool:
        t = self.cfg.trainer
        return (t.save_freq > 0 and step % t.save_freq == 0) or step == t.total_steps or self.stop.requested

    def validation_due(self, step: int) -> bool:
        t = self.cfg.trainer
        return bool(self.validate) and t.test_freq > 0 and (step % t.test_freq == 0 or step == t.total_steps)

    def call(self, method: str, *args, limit: str, **kwargs):
        """A call to every rank, bounded by `trainer.call_timeout.<limit>`: a hung rank ends the run
        with one line naming the call, the ranks and the knob, never a silent wait."""
        timeout_s = float(self.cfg.trainer.call_timeout[limit])
        note = (
            f"(trainer.call_timeout.{limit}={timeout_s:g}): a rank is hung; its log is under "
            "/tmp/ray/session_latest/logs (Ray) or torchrun's output"
        )
        # under torchrun the group itself prints the line and exits, so it gets the context now
        context = (
            f"during step {self.state.step + 1}; trainer.resume=auto continues from {self.last_checkpoint()}"
        )
        try:
            return self.ranks.call(
                method, *args, timeout_s=timeout_s, timeout_note=note, context=context, **kwargs
            )
        except RankCallError as e:
            if not e.timed_out:
                raise
            raise RankCallError(f"{e} {note}", timed_out=True) from e

    def _restore_step_record(self, logger: MetricsLogger) -> None:
        """The killed run checkpointed its last step but died before writing that step's metrics
        line: write it from the checkpoint, with the validation the step was due (the engines
        hold the checkpoint's weights now), so the file has every step once, as uninterrupted."""
        step = self.state.step
        if step == 0 or logger.has_step(step) or self.state.step_record.get("train/step") != step:
            return
        record = dict(self.state.step_record)
        if self.validation_due(step):
            self.memory.to_generation()  # colocated: the engines need the device; a no-op otherwise
            record.update(self.validate(step))
        logger.log(step, record)

    # ---------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        total = cfg.trainer.total_steps
        carried = self.run_state.resume()
        resumed = carried is not None
        self.mode.load_carried(carried or [])
        if self.kl_in_reward is not None and self.state.kl_ctrl:
            self.kl_in_reward.load_state_dict(self.state.kl_ctrl)
        logger = MetricsLogger(
            self.run,
            resume_step=self.state.step if resumed else None,
            wandb_cfg={
                "enable": cfg.logging.wandb,
                "mode": cfg.logging.wandb_mode,
                "project": cfg.trainer.project,
                "name": cfg.trainer.run_name,
                "entity": cfg.logging.wandb_entity,
                "group": cfg.logging.wandb_group,
                "tags": list(cfg.logging.wandb_tags),
            },
            tensorboard=cfg.logging.tensorboard,
        )
        progress = StepProgress(total, self.state.step, enabled=cfg.logging.progress)
        summary: dict[str, Any] = {"resumed_from": self.state.step if resumed else None}
        if self.run_state.dropped_on_resume:
            summary["dropped_carried_batches"] = self.run_state.dropped_on_resume
        try:
            if resumed or cfg.model.megatron_path:
                # engines start from the HF weights of model.path; bring them to the actor's
                self.engines.sync(self.state.weight_version)
            if resumed:
                progress.log(f"resumed from step {self.state.step} ({self.run.checkpoints})")
            elif self.validate and cfg.trainer.val_before_train:
                with progress.phase(0, "validation"):
                    val = self.validate(0)
                logger.log(0, val)
                summary["val_before"] = val
                progress.log("step 0 " + "  ".join(f"{k} {v:.3f}" for k, v in val.items() if "avg@" in k))
            if self.state.step < total:
                self.memory.to_generation()
            if resumed:
                self._restore_step_record(logger)
            while self.state.step < total and not self.stop.requested:
                step = self.state.step + 1
                metrics = run_step(self, step, progress)
                if metrics is None:  # a stop during the rollout: the last step is saved
                    break
                logger.log(step, metrics)
                progress.step_done(step, metrics)
                summary["last"] = metrics
                hold_after_step(step, self.stop)
            if self.stop.requested:
                # a signal after this step's save decision (validation, logging) still gets its
                # checkpoint: otherwise the stop would lose the step it just finished
                if self.run_state.unsaved():
                    with progress.phase(self.state.step, "checkpoint"):
                        self.save()
                progress.log(
                    f"stopped by {self.stop.signal_name} after step {self.state.step}; "
                    f"resume continues from {self.last_checkpoint()}"
                )
                summary["stopped_by"] = self.stop.signal_name
        except Exception as e:
            # the CLI's one line names what failed; this says what is left of the run
            e.megatron_dapo_context = f"during step {self.state.step + 1}; trainer.resume=auto continues from {self.last_checkpoint()}"
            raise
        finally:
            logger.close()
        summary["step"] = self.state.step
        (self.run.root / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        return summary
