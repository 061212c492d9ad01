"""The device-memory hand-over between the actor and engines that share its GPUs.

Colocated on GPUs, engines release their memory while the actor trains and take it again for
the weight sync; the actor parks its state in host memory while the engines generate. Without
colocated engines every hand-over is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


class MemoryHandOff:
    """engines: the engines on the actor's GPUs; call: the trainer's bounded call to every rank."""

    def __init__(self, engines: Iterable[Any], call: Callable[..., Any]):
        self.engines = list(engines)
        self._call = call

    def to_training(self) -> None:
        """Engines give their memory back, the actor takes its state again."""
        if not self.engines:
            return
        for engine in self.engines:
            engine.release_memory()
        self._call("onload", limit="other_s")

    def to_sync(self) -> None:
        """Only the parameters are needed to sync: the rest leaves before the engines return."""
        if not self.engines:
            return
        self._call("offload", False, limit="other_s")
        for engine in self.engines:
            engine.resume_memory()

    def to_generation(self) -> None:
        """After the sync the actor's state moves to host memory until the next update."""
        if self.engines:
            self._call("offload", limit="other_s")
