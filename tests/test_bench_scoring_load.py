"""tools/bench_scoring_load.py runs (small settings) and compares both modes in one run, every
response scored in each."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_scoring_load.py"


def test_the_load_benchmark_compares_threads_and_coroutines_in_one_run():
    args = [
        "--responses",
        "64",
        "--in-flight",
        "16",
        "--threads",
        "8",
        "--repeats",
        "1",
        "--latency-s",
        "0.01",
    ]
    out = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"thread per response \(8 threads\): \d+ responses/s", out.stdout), out.stdout
    assert re.search(r"coroutine per response: \d+ responses/s", out.stdout), out.stdout
    assert re.search(r"^coroutines / threads: [0-9.]+x$", out.stdout, re.M), out.stdout
