"""tools/bench_agent_loop.py runs (tiny settings) through the real manager and episode runner, and
its last line is the rollout against an ideal that no schedule can beat."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_agent_loop.py"
LAST = re.compile(r"agent loop: rollout ([0-9.]+) s, ideal ([0-9.]+) s, ratio ([0-9.]+)")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_agent_loop", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_prints_rollout_ideal_and_ratio_last(capsys):
    args = ["--episodes", "8", "--n", "4", "--turns", "3", "--turn-tokens", "100", "--slots", "4"]
    _bench().main([*args, "--time-scale", "0.02"])
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    m = LAST.fullmatch(last)
    assert m, out
    rollout, ideal, ratio = map(float, m.groups())
    assert 0 < ideal <= rollout, last
    # each figure is printed to 0.01: the ratio agrees with the other two within their rounding
    assert abs(ratio - rollout / ideal) <= ratio * (0.005 / rollout + 0.005 / ideal) + 0.005, last
    # the draws it reports are the episodes that ran: 8 episodes x 2 tool calls
    assert re.search(r"^draws: \d+ tokens, 16 tool calls", out, re.M), out
