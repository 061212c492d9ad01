"""tools/bench_actor.py --shape tiny on CPU: it runs the actor, the bare model and the matmul
probe in one process and prints every figure of its table, well-formed, with positive ratios; its
parameter count is the one written out here from the model config, and each MFU it prints is the
documented FLOPs formula applied to the tokens/s and the peak it prints (within the rounding of the
printed digits; exactly in its RESULT line)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

# the benchmark's seeded batch: the sequence lengths it timed
from bench_actor import SHAPES, _batch  # noqa: E402
from gpu_checks.shapes import QWEN25  # noqa: E402


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
    _check_mfu(r, text)


def _tiny_params(c: dict) -> int:
    """Qwen2's parameters, written out from the config ``c``: embedding and LM head (once when
    tied), q/k/v with biases (grouped KV), o without, two RMSNorms a layer, a SwiGLU MLP, the
    final norm."""
    h, ffn, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    attention = (h * h + h) + 2 * (h * kv + kv) + h * h
    layer = attention + 3 * h * ffn + 2 * h
    embeddings = vocab * h * (1 if c["tie_word_embeddings"] else 2)
    return embeddings + layers * layer + h


def _check_mfu(r: dict, text: str) -> None:
    """MFU = FLOPs / time / peak = tokens/s x FLOPs per token / peak, with FLOPs per token of a
    sequence of length s: 8N + 16*L*h*s for the update (a pi_old forward 2N + 4*L*h*s and a
    forward+backward 6N + 12*L*h*s: the tiny shape's two mini-batches make the actor recompute
    pi_old), 2N + 4*L*h*s for compute_logprobs, 6N + 12*L*h*s at s = the row length for the bare
    model."""
    config = QWEN25["tiny"]
    n, layers, h = _tiny_params(config), config["num_hidden_layers"], config["hidden_size"]
    assert (r["n_params"], r["layers"], r["hidden"]) == (n, layers, h)
    seq = [int(s) for s in _batch(SHAPES["tiny"], 0).seq_lens]
    tokens, row = sum(seq), r["micro_batch_tokens"]
    assert r["tokens"] == tokens and r["bare_rows"] == math.ceil(tokens / row)
    per_token = {  # FLOPs per timed token
        "update": sum(s * (8 * n + 16 * layers * h * s) for s in seq) / tokens,
        "compute_logprobs": sum(s * (2 * n + 4 * layers * h * s) for s in seq) / tokens,
        "bare": 6 * n + 12 * layers * h * row,
    }
    # the table as printed: tokens/s to 0.1, MFU to 0.01 %, the peak to 0.001 TFLOP/s
    peak = float(re.search(r"^  peak (\d+\.\d{3}) TFLOP/s", text, re.M).group(1)) * 1e12
    labels = {
        "update": "actor.update",
        "compute_logprobs": "actor.compute_logprobs",
        "bare": "bare GPTModel fwd+bwd",
    }
    for name, label in labels.items():
        row_text = re.search(rf"^  {re.escape(label)} +(\d+\.\d) +(\d+\.\d\d)%", text, re.M)
        assert row_text, f"no table row for {label}"
        tps, mfu = float(row_text.group(1)), float(row_text.group(2))
        lowest = (tps - 0.05) * per_token[name] / (peak + 0.5e9) * 100
        highest = (tps + 0.05) * per_token[name] / (peak - 0.5e9) * 100
        assert lowest - 0.005 <= mfu <= highest + 0.005, (
            f"{label}: printed MFU {mfu}% but {tps} tokens/s x {per_token[name]:.0f} FLOPs per token at a "
            f"{peak / 1e12:.3f} TFLOP/s peak is {lowest:.3f}-{highest:.3f}%"
        )
    # the RESULT line's unrounded figures: the formula to float precision
    for name, flops in per_token.items():
        f = r["figures"][name]
        assert f["mfu"] == pytest.approx(f["tokens_per_s"] * flops / r["peak_flops"], rel=1e-9), name


def test_bench_reference_tiny_prints_its_ratios():
    """tools/bench_reference.py on CPU: the reference's pass against pi_old's, the update with
    the KL loss against the plain one; nothing is offloaded on CPU, which the table says."""
    out = _run_tiny("bench_reference.py")
    r = json.loads(out.stdout.splitlines()[-1][len("RESULT ") :])
    assert r["device"] == "cpu" and not r["offloaded"] and r["resident_device_bytes"] == 0
    assert r["reference_param_bytes"] > 0 and r["transfer_gb_per_s"] is None
    assert all(v > 0 for v in r["ratios"].values()) and all(v > 0 for v in r["seconds"].values())
    assert "not offloaded (CPU)" in out.stdout and "x" in out.stdout
