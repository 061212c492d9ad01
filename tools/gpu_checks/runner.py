"""Run the GPU acceptance checks in order, print PASS/FAIL/NOT RUN with a figure for each, stop
at the first failure (naming it), and write every figure to one JSON file.

A check is a function ``fn(ctx) -> Figure`` registered with :func:`check`; ``needs_cuda`` checks
are reported as NOT RUN in the CPU dry mode, the others run there on tiny shapes, so the same code
is exercised by the CPU test suite.
"""

from __future__ import annotations

import json
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
    status: str  # PASS | FAIL | NOT RUN
    summary: str
    seconds: float
    values: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    name: str
    needs_cuda: bool
    fn: Callable[[Any], Figure]


CHECKS: list[Check] = []


def check(name: str, *, needs_cuda: bool) -> Callable:
    def register(fn: Callable[[Any], Figure]) -> Callable[[Any], Figure]:
        CHECKS.append(Check(name, needs_cuda, fn))
        return fn

    return register


def run_checks(ctx: Any, checks: list[Check], json_path: Path, dry: bool, print_fn=print) -> list[Result]:
    """Run ``checks`` in order; the first FAIL stops the rest (they are reported NOT RUN)."""
    results: list[Result] = []
    failed = False
    for c in checks:
        if failed or (dry and c.needs_cuda):
            why = "after an earlier failure" if failed else "needs CUDA (dry mode)"
            results.append(Result(c.name, "NOT RUN", why, 0.0))
        else:
            t0 = time.perf_counter()
            try:
                fig = c.fn(ctx)
                results.append(Result(c.name, "PASS", fig.summary, time.perf_counter() - t0, fig.values))
            except (CheckFailed, MissingPiece) as e:
                failed = True
                results.append(Result(c.name, "FAIL", str(e), time.perf_counter() - t0))
            except Exception as e:  # noqa: BLE001 - a crash is a failure of this check, named
                failed = True
                tb = traceback.format_exc(limit=-3)
                results.append(
                    Result(c.name, "FAIL", f"{type(e).__name__}: {e}\n{tb}", time.perf_counter() - t0)
                )
        r = results[-1]
        print_fn(f"{r.status:8s} {r.name:28s} {r.summary}  [{r.seconds:.1f} s]", flush=True)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"dry": dry, "checks": [asdict(r) for r in results]}, indent=2) + "\n")
    return results
