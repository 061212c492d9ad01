"""Per-phase wall-clock timing of a step, reported as `timing/<phase>` metrics (seconds)."""

from __future__ import annotations

import time
from contextlib import contextmanager


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        out = {f"timing/{k}": v for k, v in self.seconds.items()}
        out["timing/step"] = sum(self.seconds.values())
        return out
