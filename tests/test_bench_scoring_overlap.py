"""tools/bench_scoring_overlap.py runs (small settings) and measures what it says: no response
scored before its call returned in the per-call mode, every one in the per-response mode."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_scoring_overlap.py"


def test_the_benchmark_compares_the_two_modes_in_one_run():
    args = ["--groups", "2", "--n", "4", "--longest-s", "0.3", "--latency-s", "0.05", "--repeats", "1"]
    out = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    early = dict(re.findall(r"^\s*(per call|per response): .*early_fraction ([0-9.]+)$", out.stdout, re.M))
    assert early == {"per call": "0.00", "per response": "1.00"}, out.stdout
    assert re.search(r"per call / per response: [0-9.]+x$", out.stdout, re.M), out.stdout
