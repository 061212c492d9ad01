"""The console view of a run: one rich status line per phase, one summary row per step."""

from __future__ import annotations

import time
from contextlib import contextmanager

from rich.console import Console


class StepProgress:
    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True) -> None:
        self.console = Console(stderr=True, highlight=False)
        self.total = total_steps
        self.start_step = start_step
        self.enabled = enabled
        self._t0 = time.perf_counter()

    @contextmanager
    def phase(self, step: int, name: str):
        if not self.enabled:
            yield
            return
        with self.console.status(f"[bold]step {step}/{self.total}[/] {name}...", spinner="dots"):
            yield

    def step_done(self, step: int, m: dict) -> None:
        if not self.enabled:
            return
        done = step - self.start_step
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / max(done, 1) * (self.total - step)
        tok_s = m.get("rollout/tokens_per_s", 0.0)
        self.console.print(
            f"[bold]step {step}/{self.total}[/]  reward {m.get('rollout/reward/mean', float('nan')):+.3f}"
            f"  acc {m.get('rollout/acc/mean', float('nan')):.3f}"
            f"  len {m.get('rollout/response_length/mean', float('nan')):.1f}"
            f"  keep {m.get('rollout/keep_rate', float('nan')):.2f}"
            f"  kl {m.get('actor/ppo_kl', float('nan')):+.1e}"
            f"  gen tok/s {tok_s:.0f}  step {m.get('timing/step', 0.0):.1f}s  ETA {eta / 60:.1f} min"
        )

    def log(self, msg: str) -> None:
        self.console.print(msg)
