"""The weight sync to the engines, with the engine pool's restart and drop around it.

Before a step's sync the pool restarts the down engines this run launched (and finds the ones
that died or hung while idle); down engines given by URL that did not come back are dropped
from the ranks' transport and the pool. The transport forgets per-server state of restarted
engines, the sync gives every engine the new weights, and only then do the revived ones return
to service (rollout/engine_pool.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_dapo.driver.colocation import MemoryHandOff
from megatron_dapo.rollout.engine_pool import EnginePool


class EngineSync:
    """pool: the manager's engines; call: the trainer's bounded call to every rank; memory: the
    colocated hand-over; sync: callable(version) -> metrics, pushing the actor's weights."""

    def __init__(
        self,
        pool: EnginePool,
        call: Callable[..., Any],
        memory: MemoryHandOff,
        sync: Callable[[int], dict[str, float]],
    ):
        self.pool = pool
        self._call = call
        self.memory = memory
        self.sync = sync

    def step(self, version: int) -> dict[str, float]:
        """The step's sync (the actor just trained): restart, drop, sync, return to service."""
        revived = self.pool.restart_down()
        lost = self.pool.unrestartable(revived)
        if lost:  # while others serve, the run goes on without them, for good
            self._call("drop_engines", lost, limit="other_s")
            self.pool.drop(lost)
        if revived:
            self._call("reset_transport", limit="other_s")
        self.memory.to_sync()
        metrics = self.sync(version)
        self.pool.return_to_service(revived)  # only now, with the new weights
        return metrics

    def revive(self, version: int) -> bool:
        """No engine is left in the middle of a rollout (the actor is idle): restart the down ones
        this run launched, give them weights ``version`` (on colocated GPUs through the same
        memory hand-over as a step), and return them to service. False when none came back
        (servers given by URL: the caller's error stands)."""
        revived = self.pool.restart_down()
        if not revived:
            return False
        self._call("reset_transport", limit="other_s")
        self.memory.to_training()
        self.memory.to_sync()
        self.sync(version)
        self.memory.to_generation()
        self.pool.return_to_service(revived)
        return True
