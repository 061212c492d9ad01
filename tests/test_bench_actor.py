"""tools/bench_actor.py --shape tiny on CPU: it runs the actor, the bare model and the matmul
probe in one process and prints every figure of its table, well-formed, with positive ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_tiny(tool: str) -> subprocess.CompletedProcess:
    """``tools/<tool> --shape tiny --repeats 1`` on the CPU; fails the test if it fails."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / tool), "--shape", "tiny", "--repeats", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_bench_actor_tiny_prints_the_table():
    out = _run_tiny("bench_actor.py")
    lines = out.stdout.splitlines()
    assert lines[-1].startswith("RESULT ")
    r = json.loads(lines[-1][len("RESULT ") :])
    assert r["device"] == "cpu" and r["shape"] == "tiny" and r["updates"] == 2
    assert "measured fp32 matmul" in r["peak_note"] and r["peak_flops"] > 0
    for name in ("update", "compute_logprobs", "bare"):
        f = r["figures"][name]
        assert f["tokens_per_s"] > 0 and 0 < f["mfu"] < 1 and f["peak_bytes"] > 0, (name, f)
        assert 0 <= f["padding_fraction"] < 1
    assert all(v > 0 for v in r["ratios"].values()), r["ratios"]
    text = out.stdout
    for needle in ("8N + 16*L*h*s", "2N + 4*L*h*s", "6N + 12*L*h*s", "actor.update", "update/bare"):
        assert needle in text


def test_bench_reference_tiny_prints_its_ratios():
    """tools/bench_reference.py on CPU: the reference's pass against pi_old's, the update with
    the KL loss against the plain one; nothing is offloaded on CPU, which the table says."""
    out = _run_tiny("bench_reference.py")
    r = json.loads(out.stdout.splitlines()[-1][len("RESULT ") :])
    assert r["device"] == "cpu" and not r["offloaded"] and r["resident_device_bytes"] == 0
    assert r["reference_param_bytes"] > 0 and r["transfer_gb_per_s"] is None
    assert all(v > 0 for v in r["ratios"].values()) and all(v > 0 for v in r["seconds"].values())
    assert "not offloaded (CPU)" in out.stdout and "x" in out.stdout
