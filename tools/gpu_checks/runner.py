"""Run the GPU acceptance checks, each in its own process, and write every figure to one JSON file.

A check is a function ``fn(ctx) -> Figure`` registered with :func:`check`. The parent process
(:func:`run_checks`) starts ``python -m tools.gpu_checks --only NAME`` for every check in turn, so
a CUDA OOM, a port left in use or a hung collective in one check cannot poison the next: the
child is killed at its budget and the next one starts on a clean device. A failing check does not
stop the others. Every check ends as one of:

- PASS / FAIL, with its figure or the reason;
- NOT RUN: ``needs_cuda`` checks in the CPU dry mode (the others run there on tiny shapes, so the
  same code is exercised by the test suite);
- UNAVAILABLE: it needs Transformer Engine or SGLang and they do not import here (a bare CUDA
  machine with PyTorch; the project's image has both). Not a failure.

Budgets (``budget_s``) are per check, for one H200, and include the child's interpreter start and
imports; their sum for the checks a bare machine can run fits the script's 8 minutes. The dry mode
multiplies them by :data:`DRY_BUDGET_SCALE` (a loaded 2-core CPU is slower than an H200).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class CheckFailed(Exception):
    """A check's measured figure is outside its bound (the message says which and by how much)."""


class MissingPiece(Exception):
    """Something the checks need is absent (a package, CUDA); the message names it and the fix."""


@dataclass
class Figure:
    summary: str  # one line printed after PASS
    values: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    name: str
    status: str  # PASS | FAIL | NOT RUN | UNAVAILABLE
    summary: str
    seconds: float
    values: dict[str, Any] = field(default_factory=dict)
    budget_s: float = 0.0


# What each optional piece is called in an UNAVAILABLE line, and the module that proves it is there.
PIECES = {"te": ("Transformer Engine", "transformer_engine"), "sglang": ("SGLang", "sglang")}


@dataclass(frozen=True)
class Check:
    name: str
    needs_cuda: bool
    fn: Callable[[Any], Figure]
    budget_s: float = 60.0
    needs: tuple[str, ...] = ()  # keys of PIECES


CHECKS: list[Check] = []
# The whole run on a bare one-GPU machine (no TE, no SGLang): gpu_check.sh's limit.
TOTAL_BUDGET_S = 480.0
DRY_BUDGET_SCALE = 20.0
# The child's deadline (epoch seconds), for the timeouts of what a check waits on.
DEADLINE_ENV = "GPU_CHECK_DEADLINE"


def check(name: str, *, needs_cuda: bool, budget_s: float, needs: tuple[str, ...] = ()) -> Callable:
    def register(fn: Callable[[Any], Figure]) -> Callable[[Any], Figure]:
        CHECKS.append(Check(name, needs_cuda, fn, budget_s, needs))
        return fn

    return register


def time_left() -> float:
    """Seconds left of the running check's budget (for the timeouts of what it waits on: a
    subprocess, a server's start), at least 1."""
    deadline = os.environ.get(DEADLINE_ENV)
    return max(1.0, float(deadline) - time.time()) if deadline else 600.0


def missing_pieces(c: Check, importable: Callable[[str], bool] | None = None) -> list[str]:
    """The names of the optional pieces ``c`` needs that do not import here."""
    importable = importable or (lambda module: importlib.util.find_spec(module) is not None)
    return [PIECES[p][0] for p in c.needs if not importable(PIECES[p][1])]


def unavailable_line(missing: list[str]) -> str:
    return f"UNAVAILABLE (needs {' / '.join(missing)}: the project's image)"


def run_one_in_this_process(c: Check, ctx: Any) -> Result:
    """The child's side: run ``c`` and turn its outcome into a Result (a crash is a FAIL, named)."""
    t0 = time.perf_counter()
    try:
        fig = c.fn(ctx)
        return Result(c.name, "PASS", fig.summary, time.perf_counter() - t0, fig.values, c.budget_s)
    except (CheckFailed, MissingPiece) as e:
        return Result(c.name, "FAIL", str(e), time.perf_counter() - t0, budget_s=c.budget_s)
    except Exception as e:  # noqa: BLE001 - a crash is a failure of this check, named
        tb = traceback.format_exc(limit=-3)
        return Result(
            c.name, "FAIL", f"{type(e).__name__}: {e}\n{tb}", time.perf_counter() - t0, budget_s=c.budget_s
        )


def child_argv(c: Check, work: Path, out: Path, dry: bool) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "tools.gpu_checks",
        "--only",
        c.name,
        "--work",
        str(work),
        "--json",
        str(out),
    ]
    return argv + (["--dry"] if dry else [])


def _run_child(c: Check, work: Path, budget: float, dry: bool, cwd: Path) -> Result:
    out = work / "results" / f"{c.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    env = {**os.environ, DEADLINE_ENV: str(time.time() + budget), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            child_argv(c, work, out, dry), cwd=cwd, env=env, timeout=budget, capture_output=True, text=True
        )
    except subprocess.TimeoutExpired:  # subprocess.run kills the child before raising
        return Result(
            c.name,
            "FAIL",
            f"ran past its budget of {budget:g} s (killed)",
            time.perf_counter() - t0,
            budget_s=c.budget_s,
        )
    seconds = time.perf_counter() - t0
    if proc.stdout.strip():
        print(proc.stdout.rstrip(), flush=True)
    if out.is_file():
        result = Result(**json.loads(out.read_text()))
        result.seconds = seconds  # the whole process: interpreter start and imports included
        return result
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return Result(
        c.name, "FAIL", f"its process exited with {proc.returncode} and no result: " + " | ".join(tail),
        seconds, budget_s=c.budget_s,
    )  # fmt: skip


def run_checks(
    work: Path,
    checks: list[Check],
    json_path: Path,
    dry: bool,
    print_fn=print,
    runner: Callable[[Check, Path, float, bool, Path], Result] = _run_child,
    importable: Callable[[str], bool] | None = None,
) -> list[Result]:
    """Run every check in its own process, in order; write the JSON after each one.
    ``runner`` and ``importable`` are the child starter and the import probe (tests pass stand-ins)."""
    results: list[Result] = []
    scale = DRY_BUDGET_SCALE if dry else 1.0
    cwd = Path(__file__).resolve().parents[2]

    def write() -> None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(
            json.dumps({"dry": dry, "checks": [asdict(r) for r in results]}, indent=2) + "\n"
        )

    for c in checks:
        missing = missing_pieces(c, importable)
        if dry and c.needs_cuda:
            result = Result(c.name, "NOT RUN", "needs CUDA (dry mode)", 0.0, budget_s=c.budget_s)
        elif missing:
            result = Result(c.name, "UNAVAILABLE", unavailable_line(missing), 0.0, budget_s=c.budget_s)
        else:
            result = runner(c, work, c.budget_s * scale, dry, cwd)
        results.append(result)
        print_fn(
            f"{result.status:11s} {result.name:32s} {result.summary}  [{result.seconds:.1f} s]", flush=True
        )
        write()
    return results
