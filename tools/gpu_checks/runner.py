"""Run the GPU acceptance checks in order, print PASS/FAIL/NOT RUN with a figure for each, stop
at the first failure (naming it), and write every figure to one JSON file.

A check is a function ``fn(ctx) -> Figure`` registered with :func:`check`; ``needs_cuda`` checks
are reported as NOT RUN in the CPU dry mode, the others run there on tiny shapes, so the same code
is exercised by the CPU test suite.

Every check has a time budget (``budget_s``, one H200); their sum, :data:`TOTAL_BUDGET_S`, fits
the script's 10 minutes with room for the interpreter and imports, so one hang cannot eat the
others' time. A check past its budget is interrupted (SIGALRM: Python code, and subprocess waits,
which kill their child) and FAILs naming the budget; one stuck in native code (a CUDA or NCCL
call that never returns to Python) is ended by a watchdog thread :data:`HARD_GRACE_S` later, which
writes the figures so far and exits the process. The dry mode on CPU arms the same timers with
the budgets times :data:`DRY_BUDGET_SCALE` (a loaded CPU is slower than an H200).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class CheckFailed(Exception):
    """A check's measured figure is outside its bound (the message says which and by how much)."""


class CheckTimeout(Exception):
    """A check ran past its budget."""


class MissingPiece(Exception):
    """Something the checks need is absent (a package, CUDA); the message names it and the fix."""


@dataclass
class Figure:
    summary: str  # one line printed after PASS
    values: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    name: str
    status: str  # PASS | FAIL | NOT RUN
    summary: str
    seconds: float
    values: dict[str, Any] = field(default_factory=dict)
    budget_s: float = 0.0


@dataclass(frozen=True)
class Check:
    name: str
    needs_cuda: bool
    fn: Callable[[Any], Figure]
    budget_s: float = 60.0


CHECKS: list[Check] = []
# gpu_check.sh gives the whole run 600 s; 60 s stay for the interpreter, imports and the JSON.
TOTAL_BUDGET_S = 540.0
HARD_GRACE_S = 20.0
DRY_BUDGET_SCALE = 20.0


def check(name: str, *, needs_cuda: bool, budget_s: float) -> Callable:
    def register(fn: Callable[[Any], Figure]) -> Callable[[Any], Figure]:
        CHECKS.append(Check(name, needs_cuda, fn, budget_s))
        return fn

    return register


_deadline: float | None = None  # perf_counter time the running check must end by


def time_left() -> float:
    """Seconds left of the running check's budget (for the timeouts of what it waits on: a
    subprocess, a server's start), at least 1."""
    return max(1.0, _deadline - time.perf_counter()) if _deadline is not None else 600.0


def _run_one(c: Check, ctx: Any, budget: float, on_hang: Callable[[str], None]) -> Figure:
    """``c.fn(ctx)`` within ``budget`` seconds (see the module docstring)."""
    global _deadline

    def interrupt(signum, frame):
        raise CheckTimeout(f"ran past its budget of {budget:g} s (interrupted)")

    hang_msg = f"hung past its budget of {budget:g} s + {HARD_GRACE_S:g} s in native code; the run stops here"
    done = threading.Event()
    watchdog = threading.Thread(
        target=lambda: done.wait(budget + HARD_GRACE_S) or on_hang(hang_msg),
        daemon=True,
        name="check-watchdog",
    )
    old = signal.signal(signal.SIGALRM, interrupt)
    _deadline = time.perf_counter() + budget
    signal.setitimer(signal.ITIMER_REAL, budget)
    watchdog.start()
    try:
        return c.fn(ctx)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        _deadline = None
        done.set()


def run_checks(
    ctx: Any, checks: list[Check], json_path: Path, dry: bool, print_fn=print, exit_fn=os._exit
) -> list[Result]:
    """Run ``checks`` in order; the first FAIL stops the rest (they are reported NOT RUN).
    ``exit_fn`` ends the process when a check hangs in native code (tests pass a stand-in)."""
    results: list[Result] = []
    failed = False
    scale = DRY_BUDGET_SCALE if dry else 1.0

    def write() -> None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(
            json.dumps({"dry": dry, "checks": [asdict(r) for r in results]}, indent=2) + "\n"
        )

    for c in checks:
        if failed or (dry and c.needs_cuda):
            why = "after an earlier failure" if failed else "needs CUDA (dry mode)"
            results.append(Result(c.name, "NOT RUN", why, 0.0, budget_s=c.budget_s))
        else:
            t0 = time.perf_counter()
            budget = c.budget_s * scale

            def on_hang(message: str, c: Check = c, t0: float = t0) -> None:
                results.append(Result(c.name, "FAIL", message, time.perf_counter() - t0, budget_s=c.budget_s))
                print_fn(f"{'FAIL':8s} {c.name:28s} {message}", flush=True)
                write()
                exit_fn(1)

            try:
                fig = _run_one(c, ctx, budget, on_hang)
                results.append(
                    Result(c.name, "PASS", fig.summary, time.perf_counter() - t0, fig.values, c.budget_s)
                )
            except (CheckFailed, MissingPiece, CheckTimeout) as e:
                failed = True
                results.append(Result(c.name, "FAIL", str(e), time.perf_counter() - t0, budget_s=c.budget_s))
            except Exception as e:  # noqa: BLE001 - a crash is a failure of this check, named
                failed = True
                tb = traceback.format_exc(limit=-3)
                results.append(
                    Result(
                        c.name,
                        "FAIL",
                        f"{type(e).__name__}: {e}\n{tb}",
                        time.perf_counter() - t0,
                        budget_s=c.budget_s,
                    )
                )
        r = results[-1]
        print_fn(f"{r.status:8s} {r.name:28s} {r.summary}  [{r.seconds:.1f} s]", flush=True)
    write()
    return results
