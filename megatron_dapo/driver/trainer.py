"""The DAPO step loop.

`DAPOTrainer.fit` reads top to bottom as one step of the algorithm: draw prompts and roll out
(dynamic sampling inside the manager) -> advantages -> actor update (pi_old, mini-batches) ->
weight sync to every engine -> checkpoint every `save_freq` -> validation every `test_freq` ->
metrics. With engines colocated on the actor's GPUs the loop also hands device memory back and
forth: engines release it for the update, the actor parks its state in host memory for rollout.
Placement (Ray actors or torchrun ranks, engine kind) is decided by the caller, which hands in
the pieces; the loop is the same for all of them.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from megatron_dapo.driver.batch_builder import build_actor_batch
from megatron_dapo.driver.carried import CARRIED_FILE, read_carried, write_carried
from megatron_dapo.driver.pipeline import Prefetch, batches_ahead, queue_from_state
from megatron_dapo.driver.progress import StepProgress
from megatron_dapo.driver.rank_group import RankCallError
from megatron_dapo.driver.run_dir import MetricsLogger, RunDir, jsonable_record
from megatron_dapo.driver.stop import StopFlag
from megatron_dapo.driver.test_hold import hold_after_step
from megatron_dapo.driver.timing import PhaseTimer
from megatron_dapo.rollout.engine import launched_by_this_run
from megatron_dapo.rollout.manager import NoEngineAliveError, RolloutAbandoned
from megatron_dapo.rollout.partial import CarriedGroup, PartialSample, carry_from_items, carry_to_items
from megatron_dapo.rollout.staleness import drop_stale_groups, staleness_metrics
from megatron_dapo.rollout.types import RolloutBatch
from megatron_dapo.weights.hf_io import CheckpointError

log = logging.getLogger(__name__)
# a step whose engines all fail again after being restarted twice has a cause a restart won't fix
_MAX_REVIVES_PER_STEP = 2

# actor metric -> verl-style metrics key
ACTOR_KEYS = {
    "loss": "actor/pg_loss",
    "clipfrac": "actor/pg_clipfrac",
    "clipfrac_high": "actor/pg_clipfrac_high",
    "clipfrac_low": "actor/pg_clipfrac_low",
    "clipfrac_lower": "actor/pg_clipfrac_lower",
    "ppo_kl": "actor/ppo_kl",
    "entropy": "actor/entropy",
    "grad_norm": "actor/grad_norm",
    "grad_norm_max": "actor/grad_norm_max",
    "routing_mismatch": "actor/routing_mismatch",
    "moe_aux_loss": "actor/moe_aux_loss",
    "lr": "actor/lr",
    "tokens": "actor/tokens",
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


@dataclass
class TrainerState:
    """What a checkpoint must carry besides model/optimizer/RNG to resume exactly."""

    step: int = 0
    weight_version: int = 0
    data_cursor: dict = field(default_factory=dict)
    manager_state: dict = field(default_factory=dict)
    prompts_consumed: int = 0
    # The step's metrics line as it stood at its checkpoint: a SIGKILL between the save and the
    # line (validation, logging) must not lose the line; the resume writes it from here.
    step_record: dict = field(default_factory=dict)
    # trainer.mode=one_step_off/async: the next steps' rollouts, finished before this checkpoint
    # (generated with older weights; the data cursor is already past them), oldest first, are in
    # the checkpoint's carried.safetensors (driver/carried.py); this is its small index:
    # {"file", "items", "starts": per item the data cursor / manager state before it was drawn}.
    # ({} when nothing is carried. Checkpoints written before held them here as `prefetched`.)
    carried: dict = field(default_factory=dict)
    # rollout.partial: the groups the last rollout left past its cut (partly generated
    # responses with their tokens, log-probs and per-token versions), continued by the next one.
    # They are in carried.safetensors too, after the batches; this is their small index:
    # {"file", "groups", "samples": responses per group}. (Checkpoints written before held the
    # groups themselves here as {"groups": [...]}; they still load.)
    partial_rollouts: dict = field(default_factory=dict)


class DAPOTrainer:
    def __init__(
        self,
        cfg: DictConfig,
        *,
        run: RunDir,
        ranks,
        manager,
        dataset,
        transport_sync,
        validate=None,
        stop: StopFlag | None = None,
        dump_rollouts=None,
        colocated_engines=(),
    ):
        """
        ranks: a rank group (`call(method, ...)`) of `ActorWorker`s.
        manager: the rollout manager (`collect(dataset, weight_version) -> RolloutBatch`).
        transport_sync: callable(version) -> metrics; pushes the actor's weights to every engine.
        validate: callable(step) -> metrics, or None when there is no validation set.
        colocated_engines: engines that share the actor's GPUs: they give their memory back while
            the actor trains and take it again for the weight sync.
        """
        self.cfg = cfg
        self.run = run
        self.ranks = ranks
        self.manager = manager
        self.dataset = dataset
        self.sync = transport_sync
        self.validate = validate
        self.stop = stop or StopFlag()
        self._cancel_rollout = False  # the loop failed while a prefetch ran: end it too
        if hasattr(manager, "should_stop"):
            manager.should_stop = lambda: self.stop.requested or self._cancel_rollout
        self.dump_rollouts = dump_rollouts
        self.colocated_engines = list(colocated_engines)
        self.state = TrainerState()
        self._saved_step: int | None = None
        self.ahead = batches_ahead(cfg)  # batches generated ahead of the actor (the staleness bound)
        self._queue: deque = deque()  # the finished rollouts of the next steps, oldest first
        self._starts: deque = deque()  # per queued rollout: pipeline.batch_start before it (or None)
        self._dropped_on_resume = 0  # carried batches trainer.drop_carried_on_resume discarded
        self._prefetch_redrawn = 0  # this step: prefetched batches rewound after every engine was lost
        self._rollout_end = time.perf_counter()  # when the engines last finished a rollout

    # ---------------------------------------------------------------- resume
    def resume(self) -> bool:
        """Restore the checkpoint `trainer.resume` names; True when one was loaded.

        The choice is made here, once, before any rank loads anything: with "auto", checkpoints
        present but none usable stop the run (naming each and why) instead of starting over."""
        from megatron_dapo.actor.checkpoint import find_resume_checkpoint

        mode = self.cfg.trainer.resume
        if mode == "never":
            return False
        path = find_resume_checkpoint(self.run.checkpoints, mode, strict=True)
        if path is None:
            return False
        # the ranks re-check sizes; the checksums were just verified here
        loaded = dict(self._call("load_checkpoint", str(path), str(path), False, limit="checkpoint_s")[0])
        legacy = loaded.pop("prefetched", None) or {}  # a checkpoint written before carried.safetensors
        self.state = TrainerState(**loaded)
        self.dataset.load_state_dict(self.state.data_cursor)
        if self.state.manager_state and hasattr(self.manager, "load_state_dict"):
            self.manager.load_state_dict(self.state.manager_state)
        self._load_carried(Path(path), legacy)
        self._saved_step = self.state.step
        return True

    def _load_partial(self, groups) -> None:
        """rollout.partial's tail into the manager: read from the carried file (``groups``), or
        from the trainer-state JSON of an older checkpoint, or none (dropped / not carried)."""
        if groups is not None:
            if hasattr(self.manager, "load_partial_groups"):
                self.manager.load_partial_groups(groups)
        elif hasattr(self.manager, "load_partial_state_dict"):
            old = self.state.partial_rollouts
            self.manager.load_partial_state_dict({} if "file" in old else old)

    def _load_carried(self, path: Path, legacy: dict) -> None:
        """The checkpoint's carried batches into the queue, or, with
        `trainer.drop_carried_on_resume`, none of them: the data cursor and the manager go back to
        where they stood before the oldest was drawn, so its prompts are drawn again and generated
        with the resumed weights (the same for every resume of this checkpoint). With
        rollout.partial, the tail the manager carried at that point goes back too, as fresh groups
        (no tokens kept) ahead of the cursor's prompts: they were drawn before that cursor, so
        nothing else would draw them again."""
        index = self.state.carried
        count = int(index.get("items", 0)) if index else len(queue_from_state(legacy))
        starts = list(index.get("starts") or []) if index else []
        if count and self.cfg.trainer.drop_carried_on_resume:
            start = starts[0] if starts else None
            tail = None
            if start is not None:
                self.dataset.load_state_dict(start["data_cursor"])
                if start["manager_state"] is not None and hasattr(self.manager, "load_state_dict"):
                    self.manager.load_state_dict(start["manager_state"])
                tail = self._fresh_tail(start.get("partial_tail"), path)
            if start is None:
                fate = "this older checkpoint does not record where their prompts began, so they are skipped"
            elif tail is None and self.cfg.rollout.partial:
                fate = (
                    "their prompts are drawn again, but this older checkpoint does not record which prompts "
                    "rollout.partial's tail held when they began, so those are skipped"
                )
            elif tail:
                fate = f"their prompts are drawn again, after the {len(tail)} prompt(s) rollout.partial's tail then held"
            else:
                fate = "their prompts are drawn again"
            log.warning(
                "trainer.drop_carried_on_resume=true: dropped the %d batch(es) checkpoint %s carried; %s",
                count,
                path,
                fate,
            )
            self._dropped_on_resume = count
            self.state.carried = {}
            # the tail the checkpoint carried was drawn after the oldest carried batch began: its
            # prompts are drawn again (from the cursor, or from the start's tail), so continuing
            # it as well would train them twice
            self.state.partial_rollouts = {}
            self._load_partial(tail or None)
            return
        partial = self.state.partial_rollouts
        # one file holds both: the carried batches first, then the partial tail's items
        name = index.get("file") if index else partial.get("file")
        items = read_carried(path / name) if name else []
        batches = [b for b in items if isinstance(b, RolloutBatch)] if index else queue_from_state(legacy)
        groups = None
        if partial.get("file"):
            try:
                groups = carry_from_items(items[int(index.get("items", 0)) if index else 0 :], partial)
            except ValueError as e:
                raise CheckpointError(
                    f"carried batches file {path / name} does not match its index in state.json ({e}); the "
                    "checkpoint is corrupt: resume from an earlier one with trainer.resume=PATH"
                ) from e
        self._load_partial(groups)
        self._queue = deque(batches)
        self._starts = deque(starts + [None] * (len(batches) - len(starts)))

    def _fresh_tail(self, positions: list | None, path: Path) -> list[CarriedGroup] | None:
        """The prompts at ``positions`` (a start record's ``partial_tail``) as carried groups with
        nothing generated: the manager sends them whole, from the prompt, like the unstarted
        groups of its own tail (rollout/partial.py). None when the record has no such field."""
        if positions is None:
            return None
        n = int(self.cfg.rollout.n)
        groups = []
        for p in positions:
            try:
                if not isinstance(p, int) or p < 0:
                    raise IndexError(p)
                prompt = self.dataset[p]
            except IndexError:
                raise CheckpointError(
                    f"checkpoint {path}: state.json's carried.starts[0].partial_tail names prompt {p!r}, which "
                    "this dataset does not have; resume with the same data.train_files, or without "
                    "trainer.drop_carried_on_resume"
                ) from None
            groups.append(CarriedGroup(prompt, [PartialSample() for _ in range(n)]))
        return groups

    def save(self) -> str:
        self.state.data_cursor = self.dataset.state_dict()
        partial_items, partial_index = [], {}
        if hasattr(self.manager, "partial_groups"):
            partial_items, partial_index = carry_to_items(self.manager.partial_groups())
        elif hasattr(self.manager, "partial_state_dict"):
            self.state.partial_rollouts = self.manager.partial_state_dict()
        extra_files = None
        # absolute: rank 0 (maybe another process, another cwd) moves it into the checkpoint
        staged = (self.run.checkpoints / ".carried.staging").absolute()
        self.state.carried = (
            {"file": CARRIED_FILE, "items": len(self._queue), "starts": list(self._starts)}
            if self._queue
            else {}
        )
        if partial_index:
            self.state.partial_rollouts = {"file": CARRIED_FILE, **partial_index}
        elif hasattr(self.manager, "partial_groups"):
            self.state.partial_rollouts = {}
        if self._queue or partial_items:
            # its own file, not JSON in the trainer state: at real sizes the batches (and the
            # partial tail: ~1000 groups x 16 responses x thousands of tokens) are hundreds of MB;
            # rank 0 moves it into the checkpoint before the manifest (actor/checkpoint.py)
            write_carried(staged, list(self._queue) + partial_items)
            extra_files = {CARRIED_FILE: str(staged)}
        if hasattr(self.manager, "state_dict"):
            self.state.manager_state = self.manager.state_dict()
        try:
            path = self._call(
                "save_checkpoint",
                str(self.run.checkpoints),
                self.state.step,
                asdict(self.state),
                self.cfg.trainer.keep_last,
                limit="checkpoint_s",
                **({"extra_files": extra_files} if extra_files else {}),
            )[0]
        finally:
            staged.unlink(missing_ok=True)  # moved into the checkpoint, or left by a failed save
        self._saved_step = self.state.step
        return path

    def _call(self, method: str, *args, limit: str, **kwargs):
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

    def last_checkpoint(self) -> str:
        """For messages: the checkpoint a resume would start from now."""
        latest = self.run.checkpoints / "latest"
        if latest.is_file():
            return str(self.run.checkpoints / latest.read_text().strip())
        return f"none under {self.run.checkpoints}"

    def _queue_prefetched(self, prefetch: Prefetch, synced: int | None = None) -> None:
        """The prefetch's finished batches join the queue, each with where its prompts began.

        Every engine lost during the prefetch: the batches finished before are kept, the rest
        rewound (Prefetch.keep_finished) and drawn again, in data order, by the next steps: the
        first by the next step that finds the queue empty, with the weights of this step's sync,
        which restarts the down engines first, so staleness only drops. ``synced``: the version
        the sync already gave the engines (a rollout.partial prefetch paused for the sync and
        resumed after it); the down engines are then restarted and given it here, so the next
        prefetch finds them serving. When no down engine can be restarted (all given by URL) the
        rollout's error ends the run, as in sync mode."""
        try:
            ahead = prefetch.result() or []
        except NoEngineAliveError as e:
            pool = getattr(self.manager, "pool", None)
            down = [en for en in (pool or ()) if pool.is_down(en.name)]
            if not any(launched_by_this_run(en) for en in down):
                raise
            ahead = prefetch.keep_finished()
            redrawn = prefetch.count - len(ahead)
            first = self.state.step + 2 + len(self._queue) + len(ahead)  # the step it was for
            log.warning(
                "step %d: every engine was lost while generating the batch of step %d ahead (%s); "
                "kept the %d batch(es) finished before it; the down engines are restarted and synced, "
                "and the prompts of the %d batch(es) for steps %d-%d are drawn again",
                self.state.step + 1,
                first,
                e,
                len(ahead),
                redrawn,
                first,
                first + redrawn - 1,
            )
            self._prefetch_redrawn += redrawn
            if synced is not None:
                self._revive_engines(synced)
        self._queue.extend(ahead)
        self._starts.extend(prefetch.starts[: len(ahead)])

    def _abandon_step(self, cursor: dict, manager_state: dict | None) -> None:
        """A stop during rollout: forget the step in flight (its prompts go back to the data
        cursor) and checkpoint the last finished step, which the actor still holds unchanged."""
        self.dataset.load_state_dict(cursor)
        if manager_state is not None:
            self.manager.load_state_dict(manager_state)
        if self.state.step > 0 and self._saved_step != self.state.step:
            self.save()

    def _rollout_for(self, step: int, timer: PhaseTimer, progress: StepProgress):
        """The step's rollout: the oldest one prefetched (one_step_off, async) without its groups
        beyond the staleness bound, else generated now with the current weights; None when a
        stop abandoned it (the last finished step is then checkpointed)."""
        dropped = 0
        while self._queue:
            rollout = self._queue.popleft()
            self._starts.popleft()
            kept, n = drop_stale_groups(rollout.samples, self.state.weight_version, self.ahead)
            dropped += n
            if kept:
                rollout.samples = kept
                rollout.metrics["rollout/stale_dropped_samples"] = float(dropped)
                return rollout
        cursor = copy.deepcopy(self.dataset.state_dict())
        manager_state = (
            copy.deepcopy(self.manager.state_dict()) if hasattr(self.manager, "state_dict") else None
        )
        revives = 0
        while True:
            try:
                with timer.phase("gen"), progress.phase(step, "rollout"):
                    rollout = self.manager.collect(self.dataset, self.state.weight_version)
                if self.ahead:
                    rollout.metrics["rollout/stale_dropped_samples"] = float(dropped)
                break
            except RolloutAbandoned:
                with progress.phase(self.state.step, "checkpoint"):
                    self._abandon_step(cursor, manager_state)
                return None
            except NoEngineAliveError as e:
                # every engine died or hung in this rollout: restart the ones this run launched
                # and draw the step again from the same cursor (same prompts, seeds, batch)
                if revives >= _MAX_REVIVES_PER_STEP:
                    raise
                with timer.phase("engine_restart"), progress.phase(step, "engine restart"):
                    if not self._revive_engines():
                        raise
                revives += 1
                log.warning("step %d: %s; restarted and synced: rollout %d of the step", step, e, revives + 1)
                self.dataset.load_state_dict(copy.deepcopy(cursor))
                if manager_state is not None:
                    self.manager.load_state_dict(copy.deepcopy(manager_state))
        self._rollout_end = time.perf_counter()
        return rollout

    def _interrupt_for_sync(
        self, prefetch: Prefetch, timer: PhaseTimer, progress: StepProgress, step: int
    ) -> bool:
        """rollout.partial: pause the prefetch still generating so the sync need not wait for it;
        True when paused. Not with engines down (their restart changes the manager's engine
        set), and not when the pause does not settle within ``rollout.request_timeout_s`` (the
        rollout is resumed and the sync waits for it, as without partial rollouts)."""
        pool = getattr(self.manager, "pool", None)
        if not self.cfg.rollout.partial or prefetch.done() or (pool is not None and pool.down):
            return False
        with timer.phase("pause_rollout"), progress.phase(step, "pausing the rollout for the sync"):
            if not self.manager.pause(float(self.cfg.rollout.request_timeout_s)):
                log.warning("rollout did not pause within rollout.request_timeout_s; the sync waits for it")
                self.manager.resume()
                return False
        self._rollout_end = time.perf_counter()  # the engines wait for the weights from here
        return True

    def _revive_engines(self, version: int | None = None) -> bool:
        """No engine is left in the middle of a rollout (run in this thread, so the actor is
        idle): restart the down ones this run launched, give them the current weights (on
        colocated GPUs through the same memory hand-over as a step), and return them to service.
        False when none came back (servers given by URL: the caller's error stands).
        ``version``: the weights to give them, when not the state's (the step's sync is done)."""
        pool = getattr(self.manager, "pool", None)
        if pool is None:
            return False
        revived = pool.restart_down()
        if not revived:
            return False
        self._call("reset_transport", limit="other_s")
        self._to_training()
        self._to_sync()
        self.sync(self.state.weight_version if version is None else version)
        self._to_generation()
        pool.return_to_service(revived)
        return True

    def _drop_lost_engines(self, revived: list[str]) -> None:
        """Down engines this run cannot restart (servers given by URL) that did not come back:
        while others serve, the run goes on without them: out of the weight sync (the ranks'
        transport), the rollouts and validation (the manager's engine list), for good."""
        pool = getattr(self.manager, "pool", None)
        names = pool.unrestartable(revived) if pool is not None else []
        if names:
            self._call("drop_engines", names, limit="other_s")
            pool.drop(names)

    def _validation_due(self, step: int) -> bool:
        t = self.cfg.trainer
        return bool(self.validate) and t.test_freq > 0 and (step % t.test_freq == 0 or step == t.total_steps)

    def _restore_step_record(self, logger: MetricsLogger) -> None:
        """The killed run checkpointed its last step but died before writing that step's metrics
        line: write it from the checkpoint, with the validation the step was due (the engines
        hold the checkpoint's weights now), so the file has every step once, as uninterrupted."""
        step = self.state.step
        if step == 0 or logger.has_step(step) or self.state.step_record.get("train/step") != step:
            return
        record = dict(self.state.step_record)
        if self._validation_due(step):
            self._to_generation()  # colocated: the engines need the device; a no-op otherwise
            record.update(self.validate(step))
        logger.log(step, record)

    # ---------------------------------------------------------------- colocation
    def _to_training(self) -> None:
        """Colocated on GPUs: engines give their memory back, the actor takes its state again."""
        if not self.colocated_engines:
            return
        for engine in self.colocated_engines:
            engine.release_memory()
        self._call("onload", limit="other_s")

    def _to_sync(self) -> None:
        """Only the parameters are needed to sync: the rest leaves before the engines return."""
        if not self.colocated_engines:
            return
        self._call("offload", False, limit="other_s")
        for engine in self.colocated_engines:
            engine.resume_memory()

    def _to_generation(self) -> None:
        """After the sync the actor's state moves to host memory until the next update."""
        if self.colocated_engines:
            self._call("offload", limit="other_s")

    # ---------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        total = cfg.trainer.total_steps
        resumed = self.resume()
        logger = MetricsLogger(
            self.run,
            resume_step=self.state.step if resumed else None,
            wandb_cfg={
                "enable": cfg.logging.wandb,
                "mode": cfg.logging.wandb_mode,
                "project": cfg.trainer.project,
                "name": cfg.trainer.run_name,
            },
            tensorboard=cfg.logging.tensorboard,
        )
        progress = StepProgress(total, self.state.step, enabled=cfg.logging.progress)
        summary: dict[str, Any] = {"resumed_from": self.state.step if resumed else None}
        if self._dropped_on_resume:
            summary["dropped_carried_batches"] = self._dropped_on_resume
        try:
            if resumed or cfg.model.megatron_path:
                # engines start from the HF weights of model.path; bring them to the actor's
                self.sync(self.state.weight_version)
            if resumed:
                progress.log(f"resumed from step {self.state.step} ({self.run.checkpoints})")
            elif self.validate and cfg.trainer.val_before_train:
                with progress.phase(0, "validation"):
                    val = self.validate(0)
                logger.log(0, val)
                summary["val_before"] = val
                progress.log("step 0 " + "  ".join(f"{k} {v:.3f}" for k, v in val.items() if "avg@" in k))

            if self.state.step < total:
                self._to_generation()
            if resumed:
                self._restore_step_record(logger)
            while self.state.step < total and not self.stop.requested:
                step = self.state.step + 1
                timer = PhaseTimer()
                rollout = self._rollout_for(step, timer, progress)
                if rollout is None:  # a stop during the rollout: the last step is saved
                    break
                staleness = staleness_metrics(rollout.samples, self.state.weight_version)
                with timer.phase("adv"):
                    batch, batch_metrics = build_actor_batch(
                        rollout.samples,
                        norm_adv_by_std=cfg.algorithm.norm_adv_by_std_in_grpo,
                        overlong_filter=cfg.algorithm.overlong_filter,
                        groups_multiple=cfg.actor.ppo_mini_batch_size,
                    )
                # one_step_off/async: the engines (still on this step's weights) generate the
                # batches up to step+ahead while the actor trains; the sync below waits for them
                prefetch = None
                count = min(self.ahead - len(self._queue), total - step - len(self._queue))
                if count > 0 and not self.stop.requested:
                    prefetch = Prefetch(self.manager, self.dataset, self.state.weight_version, count)
                with timer.phase("memory_swap"):
                    self._to_training()
                try:
                    with timer.phase("update_actor"), progress.phase(step, "actor update"):
                        actor_metrics = self._call("train_step", batch, limit="train_step_s")[0]
                except BaseException:
                    if prefetch is not None:  # do not leave a rollout running behind the error
                        self._cancel_rollout = True
                        prefetch.join(self.cfg.trainer.stop_timeout_s)
                    raise
                # rollout.partial: a rollout still running is paused for the sync and continues
                # with the new weights, its responses keeping their tokens (a sample then holds
                # tokens of two versions); without it the sync waits for the rollout to finish
                interrupt = prefetch is not None and self._interrupt_for_sync(prefetch, timer, progress, step)
                if prefetch is not None and not interrupt:
                    with timer.phase("wait_data"), progress.phase(step, "waiting for the next rollout"):
                        self._queue_prefetched(prefetch)
                    self._rollout_end = prefetch.finished_at
                try:
                    with timer.phase("sync_weights"), progress.phase(step, "weight sync"):
                        pool = getattr(self.manager, "pool", None)
                        revived = pool.restart_down() if pool is not None else []
                        self._drop_lost_engines(revived)
                        if revived:
                            self._call("reset_transport", limit="other_s")
                        self._to_sync()
                        sync_metrics = self.sync(step)
                        if pool is not None:
                            pool.return_to_service(revived)  # only now, with the new weights
                except BaseException:
                    if interrupt:  # the paused rollout ends with the run, never stays paused
                        self._cancel_rollout = True
                        self.manager.resume()
                        prefetch.join(self.cfg.trainer.stop_timeout_s)
                    raise
                if interrupt:
                    self.manager.resume()
                    with timer.phase("wait_data"), progress.phase(step, "waiting for the next rollout"):
                        self._queue_prefetched(prefetch, synced=step)
                # engines idle from their last rollout until the new weights are in (validation aside)
                sync_metrics["timing/engine_wait_weights_s"] = time.perf_counter() - self._rollout_end
                sync_metrics["timing/actor_wait_data_s"] = timer.seconds.get("gen", 0.0) + timer.seconds.get(
                    "wait_data", 0.0
                )
                self.state.step = step
                self.state.weight_version = step
                self.state.prompts_consumed += int(rollout.metrics.get("rollout/prompts_drawn", 0))

                metrics: dict[str, Any] = {}
                metrics.update(rollout.metrics)
                metrics.update(staleness)
                metrics.update(batch_metrics)
                metrics.update({ACTOR_KEYS[k]: v for k, v in actor_metrics.items() if k in ACTOR_KEYS})
                metrics.update(sync_metrics)
                if self.ahead:
                    metrics["rollout/prefetch_redrawn"] = float(self._prefetch_redrawn)
                    self._prefetch_redrawn = 0
                if self.dump_rollouts is not None:
                    self.dump_rollouts(rollout, self.run.rollouts / f"step_{step}.jsonl")
                last = step == total or self.stop.requested
                # the checkpoint needs the parameters on the device: save before parking the actor
                metrics["train/step"] = step
                metrics["train/prompts_consumed"] = self.state.prompts_consumed
                if (cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0) or last:
                    self.state.step_record = jsonable_record({**metrics, **timer.metrics()})
                    with timer.phase("save_checkpoint"), progress.phase(step, "checkpoint"):
                        self.save()
                with timer.phase("memory_swap"):
                    self._to_generation()
                # a stop must fit the scheduler's grace period: no validation then
                if self._validation_due(step) and not self.stop.requested:
                    with timer.phase("val"), progress.phase(step, "validation"):
                        metrics.update(self.validate(step))
                metrics.update(timer.metrics())
                logger.log(step, metrics)
                progress.step_done(step, metrics)
                summary["last"] = metrics
                hold_after_step(step, self.stop)
            if self.stop.requested:
                # a signal after this step's save decision (validation, logging) still gets its
                # checkpoint: otherwise the stop would lose the step it just finished
                if self.state.step > 0 and self._saved_step != self.state.step:
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
