"""The console view of a run: one rich status line per phase, one summary row per step.

On a terminal a phase shows a spinner. When the output is not a terminal (CI, a log file,
``| tee``) a spinner prints nothing until it ends, so a long phase prints a plain line every
``HEARTBEAT_S`` seconds instead (``heartbeat``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console

HEARTBEAT_S = 5.0


@contextmanager
def heartbeat(console: Console, text: Callable[[float], str], every: float = HEARTBEAT_S) -> Iterator[None]:
    """Print ``text(elapsed_s)`` every ``every`` seconds while the block runs, when ``console``
    is not a terminal (a terminal has the live spinner or bar instead). Short blocks print nothing."""
    if console.is_terminal or every <= 0:
        yield
        return
    done = threading.Event()
    start = time.perf_counter()

    def beat() -> None:
        while not done.wait(every):
            try:
                console.print(text(time.perf_counter() - start), highlight=False)
            except Exception as e:  # a broken status callback must not kill the run
                console.print(f"(progress line failed: {e})")
                return

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=every + 1)


class StepProgress:
    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True) -> None:
        self.console = Console(stderr=True, highlight=False)
        self.total = total_steps
        self.start_step = start_step
        self.enabled = enabled
        self.heartbeat_s = HEARTBEAT_S
        self._t0 = time.perf_counter()

    @contextmanager
    def phase(self, step: int, name: str):
        if not self.enabled:
            yield
            return
        label = f"step {step}/{self.total} {name}"
        if not self.console.is_terminal:
            with heartbeat(self.console, lambda s: f"{label}... {s:.0f}s", self.heartbeat_s):
                yield
            return
        with self.console.status(f"[bold]{label}[/]...", spinner="dots"):
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
