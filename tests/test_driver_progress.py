"""Progress when the output is not a terminal, and megatron-core's known CPU warnings said once."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading

from rich.console import Console

from megatron_dapo.driver import cpu_warnings
from megatron_dapo.driver.progress import StepProgress, heartbeat


class _Lines(io.StringIO):
    """A non-terminal stream that signals once ``want`` lines were written."""

    def __init__(self, want: int):
        super().__init__()
        self.want, self.enough = want, threading.Event()

    def write(self, s: str) -> int:
        n = super().write(s)
        if self.getvalue().count("\n") >= self.want:
            self.enough.set()
        return n


def test_heartbeat_prints_lines_while_a_phase_runs_when_not_a_terminal():
    out = _Lines(want=2)
    console = Console(file=out, force_terminal=False, width=200)
    with heartbeat(console, lambda s: f"warm start step 7/900, {s:.0f}s", every=0.05):
        assert out.enough.wait(timeout=60), "no progress lines while the phase ran"
    assert out.getvalue().splitlines()[0].startswith("warm start step 7/900, ")


def test_no_heartbeat_on_a_terminal_or_for_short_phases():
    tty = io.StringIO()
    with heartbeat(Console(file=tty, force_terminal=True), lambda s: "beat", every=0.01):
        threading.Event().wait(0.2)  # a terminal shows the spinner instead
    assert "beat" not in tty.getvalue()
    log = io.StringIO()
    with heartbeat(Console(file=log, force_terminal=False), lambda s: "beat", every=60):
        pass
    assert log.getvalue() == ""


def test_step_phase_heartbeats_in_a_log():
    progress = StepProgress(total_steps=80)
    out = _Lines(want=1)
    progress.console = Console(file=out, force_terminal=False, width=200)
    progress.heartbeat_s = 0.05
    with progress.phase(12, "validation"):
        assert out.enough.wait(timeout=60)
    assert out.getvalue().startswith("step 12/80 validation... ")


_IMPORTS = (
    "import warnings; import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs; "
    "warnings.warn('a real warning stays')"
)


def _stderr(env_extra: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(env_extra)
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORTS], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


def test_worker_environment_hides_exactly_the_known_cpu_warnings():
    plain = _stderr({})
    assert "Transformer Engine and Apex are not installed" in plain  # what megatron-core says on CPU
    quiet = _stderr(cpu_warnings.worker_env())
    for msg in cpu_warnings.KNOWN_CPU_WARNINGS:
        assert msg not in quiet
    assert "a real warning stays" in quiet
    assert cpu_warnings.pythonwarnings("error::DeprecationWarning").startswith(
        "error::DeprecationWarning,ignore:"
    )
