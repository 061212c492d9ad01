"""What the trainer needs from a rollout manager (`RolloutManager` is the one the runs use)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from megatron_dapo.rollout.engine_pool import EnginePool
from megatron_dapo.rollout.partial import CarriedGroup
from megatron_dapo.rollout.types import RolloutBatch


class ManagerProtocol(Protocol):
    """A source of DAPO train batches over a pool of engines.

    Attributes:
        pool: the engines and their liveness; the trainer restarts and drops engines through it.
        should_stop: set by the trainer; True once the run must stop, and a rollout in flight is
            then given up (`RolloutAbandoned`).
    """

    pool: EnginePool
    should_stop: Callable[[], bool] | None

    def collect(self, dataset: Any, weight_version: int) -> RolloutBatch:
        """One rollout step: a full train batch drawn from ``dataset``."""
        ...

    def state_dict(self) -> dict[str, Any] | None:
        """What a resumed run needs to draw the same batches (None: nothing)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def partial_groups(self) -> list[CarriedGroup]:
        """rollout.partial: the groups the last rollout left past its cut ([] without it)."""
        ...

    def load_partial_groups(self, groups: list[CarriedGroup]) -> None: ...

    def pause(self, timeout_s: float) -> bool:
        """rollout.partial, from another thread: pause the rollout in flight for a weight sync;
        True once no engine call is in flight."""
        ...

    def resume(self) -> None:
        """Let the paused rollout continue."""
        ...
