"""Where a step's rollout comes from: the generation modes (`trainer.mode`).

Both modes take the batches a checkpoint carried first (a resumed one_step_off/async run), each
without its groups beyond the staleness bound. Then:
- `OnPolicy` (sync): the step's rollout is generated when the step begins, with the weights the
  actor holds; every engine lost in it is restarted (up to twice a step) and the step drawn again
  from the same cursor.
- `Ahead` (one_step_off, async with K): while the actor trains, the engines generate the batches
  of the next steps with the weights they hold, up to K ahead (driver/pipeline.py); it owns that
  queue, the prefetch, rollout.partial's pause for the sync, and the redraw of batches whose
  engines were all lost.

The step (driver/step.py) calls the same five methods on either: `rollout`, `generate_ahead`,
`before_sync`, `after_sync`, and `abandon` on an error between update and sync.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from typing import Any

from megatron_dapo.driver.engine_sync import EngineSync
from megatron_dapo.driver.pipeline import Prefetch, batches_ahead
from megatron_dapo.driver.progress import StepProgress
from megatron_dapo.driver.run_state import Carried, RunState
from megatron_dapo.driver.stop import StopFlag
from megatron_dapo.driver.timing import PhaseTimer
from megatron_dapo.rollout.engine import launched_by_this_run
from megatron_dapo.rollout.manager import NoEngineAliveError, RolloutAbandoned
from megatron_dapo.rollout.manager_protocol import ManagerProtocol
from megatron_dapo.rollout.staleness import drop_stale_groups
from megatron_dapo.rollout.types import RolloutBatch

log = logging.getLogger(__name__)
# a step whose engines all fail again after being restarted twice has a cause a restart won't fix
_MAX_REVIVES_PER_STEP = 2


class OnPolicy:
    """trainer.mode=sync: the step's rollout is generated with the actor's current weights."""

    ahead = 0  # batches generated ahead of the actor (the staleness bound)

    def __init__(
        self,
        cfg: Any,
        manager: ManagerProtocol,
        dataset: Any,
        run_state: RunState,
        engines: EngineSync,
        stop: StopFlag,
    ):
        self.cfg = cfg
        self.manager = manager
        self.dataset = dataset
        self.run_state = run_state
        self.engines = engines
        self.stop = stop
        self.queue: deque[RolloutBatch] = deque()  # the finished rollouts of the next steps, oldest first
        self.starts: deque = deque()  # per queued rollout: pipeline.batch_start before it (or None)
        self.cancelled = False  # the loop failed while a rollout ran on another thread: end it too
        self.rollout_end = time.perf_counter()  # when the engines last finished a rollout

    # ---------------------------------------------------------------- carried batches
    def carried(self) -> list[Carried]:
        return list(zip(self.queue, self.starts))

    def load_carried(self, carried: list[Carried]) -> None:
        self.queue = deque(batch for batch, _ in carried)
        self.starts = deque(start for _, start in carried)

    # ---------------------------------------------------------------- the step's calls
    def rollout(self, step: int, timer: PhaseTimer, progress: StepProgress) -> RolloutBatch | None:
        """The step's rollout: the oldest one carried, without its groups beyond the staleness
        bound, else generated now with the current weights; None when a stop abandoned it (the
        last finished step is then checkpointed)."""
        state = self.run_state.state
        dropped = 0
        while self.queue:
            rollout = self.queue.popleft()
            self.starts.popleft()
            kept, n = drop_stale_groups(rollout.samples, state.weight_version, self.ahead)
            dropped += n
            if kept:
                rollout.samples = kept
                rollout.metrics["rollout/stale_dropped_samples"] = float(dropped)
                return rollout
        cursor = copy.deepcopy(self.dataset.state_dict())
        manager_state = copy.deepcopy(self.manager.state_dict())
        revives = 0
        while True:
            try:
                with timer.phase("gen"), progress.phase(step, "rollout"):
                    rollout = self.manager.collect(self.dataset, state.weight_version)
                if self.ahead:
                    rollout.metrics["rollout/stale_dropped_samples"] = float(dropped)
                break
            except RolloutAbandoned:
                with progress.phase(state.step, "checkpoint"):
                    self._abandon_step(cursor, manager_state)
                return None
            except NoEngineAliveError as e:
                # every engine died or hung in this rollout: restart the ones this run launched
                # and draw the step again from the same cursor (same prompts, seeds, batch)
                if revives >= _MAX_REVIVES_PER_STEP:
                    raise
                with timer.phase("engine_restart"), progress.phase(step, "engine restart"):
                    if not self.engines.revive(state.weight_version):
                        raise
                revives += 1
                log.warning("step %d: %s; restarted and synced: rollout %d of the step", step, e, revives + 1)
                self.dataset.load_state_dict(copy.deepcopy(cursor))
                if manager_state is not None:
                    self.manager.load_state_dict(copy.deepcopy(manager_state))
        self.rollout_end = time.perf_counter()
        return rollout

    def generate_ahead(self, step: int) -> None:
        """Start generating the next steps' batches while the actor trains (none on-policy)."""

    def before_sync(self, step: int, timer: PhaseTimer, progress: StepProgress) -> None:
        """The actor has trained: settle what is generating before the weights change."""

    def after_sync(self, step: int, timer: PhaseTimer, progress: StepProgress) -> None:
        """The engines hold the new weights."""

    def abandon(self) -> None:
        """The step failed between update and sync: leave nothing running behind the error."""

    def wait_metrics(self, timer: PhaseTimer) -> dict[str, float]:
        """Right after the sync: the engines' idle time from their last rollout until the new
        weights were in (validation aside), and the actor's wait for data."""
        return {
            "timing/engine_wait_weights_s": time.perf_counter() - self.rollout_end,
            "timing/actor_wait_data_s": timer.seconds.get("gen", 0.0) + timer.seconds.get("wait_data", 0.0),
        }

    def step_metrics(self) -> dict[str, float]:
        return {}

    def _abandon_step(self, cursor: dict, manager_state: dict | None) -> None:
        """A stop during rollout: forget the step in flight (its prompts go back to the data
        cursor) and checkpoint the last finished step, which the actor still holds unchanged."""
        self.dataset.load_state_dict(cursor)
        if manager_state is not None:
            self.manager.load_state_dict(manager_state)
        if self.run_state.unsaved():
            self.run_state.save(self.carried())


class Ahead(OnPolicy):
    """trainer.mode=one_step_off/async: the engines generate up to ``ahead`` batches ahead of the
    actor, on a thread, while it trains (driver/pipeline.py explains the schedule)."""

    def __init__(self, *args: Any, ahead: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ahead = ahead
        self.prefetch: Prefetch | None = None
        self.paused = False  # rollout.partial: the prefetch is paused for this step's sync
        self.redrawn = 0  # this step: prefetched batches rewound after every engine was lost

    def generate_ahead(self, step: int) -> None:
        # the engines (still on this step's weights) generate the batches up to step+ahead while
        # the actor trains; the sync waits for them
        total = self.cfg.trainer.total_steps
        count = min(self.ahead - len(self.queue), total - step - len(self.queue))
        if count > 0 and not self.stop.requested:
            self.prefetch = Prefetch(
                self.manager,
                self.dataset,
                self.run_state.state.weight_version,
                count,
                partial=bool(self.cfg.rollout.partial),
            )

    def before_sync(self, step: int, timer: PhaseTimer, progress: StepProgress) -> None:
        # rollout.partial: a rollout still running is paused for the sync and continues with the
        # new weights, its responses keeping their tokens (a sample then holds tokens of two
        # versions); without it the sync waits for the rollout to finish
        if self.prefetch is None:
            return
        self.paused = self._pause_for_sync(self.prefetch, timer, progress, step)
        if not self.paused:
            with timer.phase("wait_data"), progress.phase(step, "waiting for the next rollout"):
                self._queue_prefetched(self.prefetch)
            self.rollout_end = self.prefetch.finished_at
            self.prefetch = None

    def after_sync(self, step: int, timer: PhaseTimer, progress: StepProgress) -> None:
        if not self.paused:
            return
        self.manager.resume()
        with timer.phase("wait_data"), progress.phase(step, "waiting for the next rollout"):
            self._queue_prefetched(self.prefetch, synced=step)
        self.prefetch, self.paused = None, False

    def abandon(self) -> None:
        if self.prefetch is None:
            return
        self.cancelled = True
        if self.paused:  # the paused rollout ends with the run, never stays paused
            self.manager.resume()
        self.prefetch.join(self.cfg.trainer.stop_timeout_s)

    def step_metrics(self) -> dict[str, float]:
        redrawn, self.redrawn = self.redrawn, 0
        return {"rollout/prefetch_redrawn": float(redrawn)}

    def _pause_for_sync(
        self, prefetch: Prefetch, timer: PhaseTimer, progress: StepProgress, step: int
    ) -> bool:
        """rollout.partial: pause the prefetch still generating so the sync need not wait for it;
        True when paused. Not with engines down (their restart changes the manager's engine
        set), and not when the pause does not settle within ``rollout.request_timeout_s`` (the
        rollout is resumed and the sync waits for it, as without partial rollouts)."""
        if not self.cfg.rollout.partial or prefetch.done() or self.manager.pool.down:
            return False
        with timer.phase("pause_rollout"), progress.phase(step, "pausing the rollout for the sync"):
            if not self.manager.pause(float(self.cfg.rollout.request_timeout_s)):
                log.warning("rollout did not pause within rollout.request_timeout_s; the sync waits for it")
                self.manager.resume()
                return False
        self.rollout_end = time.perf_counter()  # the engines wait for the weights from here
        return True

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
            pool = self.manager.pool
            if not any(launched_by_this_run(en) for en in pool if pool.is_down(en.name)):
                raise
            ahead = prefetch.keep_finished()
            redrawn = prefetch.count - len(ahead)
            step = self.run_state.state.step
            first = step + 2 + len(self.queue) + len(ahead)  # the step it was for
            log.warning(
                "step %d: every engine was lost while generating the batch of step %d ahead (%s); "
                "kept the %d batch(es) finished before it; the down engines are restarted and synced, "
                "and the prompts of the %d batch(es) for steps %d-%d are drawn again",
                step + 1,
                first,
                e,
                len(ahead),
                redrawn,
                first,
                first + redrawn - 1,
            )
            self.redrawn += redrawn
            if synced is not None:
                self.engines.revive(synced)
        self.queue.extend(ahead)
        self.starts.extend(prefetch.starts[: len(ahead)])


def make_mode(cfg: Any, *args: Any, **kwargs: Any) -> OnPolicy:
    """The mode `trainer.mode` names: on-policy (sync), or ahead by 1 (one_step_off) or K (async)."""
    ahead = batches_ahead(cfg)
    if ahead:
        return Ahead(cfg, *args, ahead=ahead, **kwargs)
    return OnPolicy(cfg, *args, **kwargs)
