"""One-step-off pipelining: the next step's rollout runs on a thread while the actor trains.

`trainer.mode=one_step_off`: while the actor trains on batch k, the engines generate batch k+1
with the weights they hold (version k-1); the weight sync of step k waits for that rollout to
finish, so no engine changes weights mid-generation and every token is exactly one version
behind the actor that trains on it. The rollout itself is the manager's `collect`, unchanged
(dynamic sampling, retries, the determinism of its seeds), only started earlier.

A prefetched batch that is finished when a checkpoint is taken travels in the checkpoint
(`carried.safetensors`, driver/run_state.py), with the data cursor already past its prompts, so a
resume trains on exactly the batch the uninterrupted run would have. Each batch also keeps the
data cursor and manager state from before it was drawn (`Prefetch.starts`), so that
`trainer.drop_carried_on_resume=true` can put its prompts back instead of skipping them.

`trainer.mode=async` with `trainer.max_staleness=K` is the same pipeline K batches deep: batch j
is generated with the weights of version max(j-1-K, 0), so the sync to version v waits until
batches up to v+K are finished and the engines generate while the actor trains (they are idle
only during a sync). The schedule is fixed by the step numbers, not by timing, so a run and its
resume see the same batches. K=1 is one_step_off. A batch whose oldest token is more than K
versions behind the actor when its step comes (a checkpoint resumed with a smaller K) loses its
stale groups (`rollout/stale_dropped_samples`); a batch left empty is generated anew.

Every engine lost during a prefetch (NoEngineAliveError) does not end the run when the down
engines can be restarted (servers this run launched): the batches of the prefetch that finished
are kept, the failed one and any after it are rewound (data cursor, manager state, rollout.partial's
carried tail), the step's sync restarts the engines and gives them the new weights, and the rewound
prompts are drawn again, in order, by the next steps (`rollout/prefetch_redrawn`).
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

from megatron_dapo.rollout.manager import RolloutAbandoned
from megatron_dapo.rollout.manager_protocol import ManagerProtocol
from megatron_dapo.rollout.types import RolloutBatch

MODES = ("sync", "one_step_off", "async")

# Per-step idle times, not phases: they overlap the phases (the actor's wait is its gen or
# wait_data phase; the engines' wait spans the update), so a sum of phases must leave them out.
WAIT_METRICS = ("timing/actor_wait_data_s", "timing/engine_wait_weights_s")


def batches_ahead(cfg: Any) -> int:
    """How many batches the engines generate ahead of the actor: 0 (sync), 1 (one_step_off),
    `trainer.max_staleness` (async)."""
    mode = cfg.trainer.mode
    if mode == "one_step_off":
        return 1
    if mode == "async":
        return int(cfg.trainer.max_staleness)
    return 0


class Prefetch:
    """`manager.collect(dataset, version)` ``count`` times in a row on a daemon thread.

    The data cursor and the manager's state are snapshotted before each batch: a rollout given
    up for a stop is rewound (the prompts of every batch of this prefetch go back to the cursor),
    as the synchronous loop does; one that lost every engine keeps the batches that finished
    before and rewinds the rest (`keep_finished`), so the trainer can restart the engines at its
    sync and draw them again."""

    def __init__(
        self, manager: ManagerProtocol, dataset: Any, version: int, count: int = 1, partial: bool = False
    ):
        self.manager = manager
        self.partial = partial  # rollout.partial: each start records the carried tail's prompts
        self.dataset = dataset
        self.version = version
        self.count = count
        self._batches: list[RolloutBatch] = []
        # per batch: the data cursor and manager state before it was drawn (checkpointed with it)
        self.starts: list[dict[str, Any]] = []
        # per batch begun: where it started from, to rewind to (_rewind). The first is taken
        # here, before the thread runs.
        self._before: list[tuple[dict[str, Any], Any]] = [self._snapshot()]
        self._error: BaseException | None = None
        self.finished_at: float | None = None  # perf_counter when the engines went idle
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"prefetch-v{version}", daemon=True)
        self._thread.start()

    def _snapshot(self) -> tuple[dict[str, Any], Any]:
        """The data cursor and manager state (pipeline.batch_start) and rollout.partial's carried
        tail (the groups themselves, not a JSON copy: at real sizes the tail is hundreds of MB,
        and the manager replaces carried samples rather than changing them)."""
        return batch_start(self.dataset, self.manager, self.partial), self.manager.partial_groups()

    def _run(self) -> None:
        try:
            for i in range(self.count):
                if i:
                    self._before.append(self._snapshot())
                batch = self.manager.collect(self.dataset, self.version)
                self._batches.append(batch)
                self.starts.append(self._before[i][0])
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread in result()
            self._error = e
        finally:
            self.finished_at = time.perf_counter()
            self._done.set()

    def result(self) -> list[RolloutBatch] | None:
        """The batches, in order; None when the rollout was abandoned for a stop (the cursor goes
        back to before all of them). Any other failure of the rollout is raised here, on the
        trainer's thread (a NoEngineAliveError the trainer can recover from: `keep_finished`)."""
        self._done.wait()
        if isinstance(self._error, RolloutAbandoned):
            self._rewind(0)
            return None
        if self._error is not None:
            raise self._error
        return self._batches

    def keep_finished(self) -> list[RolloutBatch]:
        """After a failed rollout (every engine lost): the batches that finished before it, kept
        (whole, generated with this prefetch's weights: they train as planned); the one that failed
        and those not begun go back, so they are drawn again. Returns the kept ones, in order."""
        self._done.wait()
        self._rewind(len(self._batches))
        return list(self._batches)

    def _rewind(self, index: int) -> None:
        """Data cursor, manager state and rollout.partial's carried tail back to where they stood
        before batch ``index`` of this prefetch was drawn."""
        start, partial = self._before[index]
        self.dataset.load_state_dict(copy.deepcopy(start["data_cursor"]))
        if start["manager_state"] is not None:
            self.manager.load_state_dict(copy.deepcopy(start["manager_state"]))
        self.manager.load_partial_groups(partial)

    def done(self) -> bool:
        """The rollouts have finished (or failed)."""
        return self._done.is_set()

    def join(self, timeout: float) -> None:
        """For an error path: give the thread a bounded time to notice the stop and end."""
        self._done.wait(timeout)


def batch_start(dataset: Any, manager: ManagerProtocol, partial: bool = False) -> dict[str, Any]:
    """Where the data and the manager stood before a batch was drawn (small, JSON-able).

    With rollout.partial (``partial``), ``partial_tail`` lists the dataset positions (`position_of`) of the
    prompts the manager's carried tail held then: they were drawn before ``data_cursor``, so a
    rewind to it does not draw them again, and `trainer.drop_carried_on_resume` puts them back
    from here. Positions, not the prompts: a real tail is ~1000 groups of long prompts, and this
    record lives in state.json."""
    start = {
        "data_cursor": copy.deepcopy(dataset.state_dict()),
        "manager_state": copy.deepcopy(manager.state_dict()),
    }
    if partial:
        start["partial_tail"] = [dataset.position_of(g.prompt) for g in manager.partial_groups()]
    return start
