"""tools/gpu_check.sh and its checks (tools/gpu_checks): the shell parses, the CPU dry mode runs
the checks that need no CUDA (bf16 vs fp32 update, defect 1) and reports the CUDA ones NOT RUN, a
failure stops the run naming the check, and the MFU FLOP count matches a hand computation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CUDA_ONLY = {
    "te_vs_local_logits",
    "fp8_step_odd_lengths",
    "offload_roundtrip",
    "mfu_bf16_1.5B",
    "sglang_colocated_ipc_sync",
    "dapo_2_steps_colocated",
    "sglang_routed_experts",
}


def test_gpu_check_sh_parses():
    subprocess.run(["bash", "-n", str(REPO / "tools" / "gpu_check.sh")], check=True)


def test_dry_mode_runs_the_cpu_checks(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        ["bash", "tools/gpu_check.sh", "--dry", "--json", str(out)],
        cwd=REPO, env={**os.environ, "PYTHON": sys.executable},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert {n for n, c in checks.items() if c["status"] == "NOT RUN"} == CUDA_ONLY
    assert {n for n, c in checks.items() if c["status"] == "PASS"} == set(checks) - CUDA_ONLY
    assert checks["load_then_step_keeps_weights"]["values"]["max_moved"] == 0.0
    assert checks["bf16_step_vs_fp32"]["values"]["relative_update_error"] < 0.1
    # the budget timers were armed around every check that ran (and recorded for every check)
    assert all(c["budget_s"] > 0 for c in checks.values())
    for name in checks:
        assert f"{name}" in proc.stdout


def test_first_failure_stops_and_is_named(tmp_path):
    from tools.gpu_checks.runner import Check, CheckFailed, Figure, run_checks

    def bad(ctx):
        raise CheckFailed("figure 3.0 > bound 1.0")

    ran = []
    checks = [
        Check("a", False, lambda ctx: Figure("ok", {"x": 1})),
        Check("b", False, bad),
        Check("c", False, lambda ctx: ran.append(1) or Figure("ok")),
        Check("d", True, lambda ctx: Figure("ok")),
    ]
    lines = []
    results = run_checks(
        None, checks, tmp_path / "f.json", dry=False, print_fn=lambda s, **k: lines.append(s)
    )
    assert [r.status for r in results] == ["PASS", "FAIL", "NOT RUN", "NOT RUN"] and not ran
    assert "figure 3.0 > bound 1.0" in lines[1] and lines[1].startswith("FAIL")
    saved = json.loads((tmp_path / "f.json").read_text())
    assert saved["checks"][0]["values"] == {"x": 1}


def test_budgets_fit_the_ten_minutes(tmp_path):
    """Every check has a budget, they sum to what the runner promises, and that leaves a minute
    of the script's 600 s for the interpreter and imports."""
    from tools.gpu_checks import checks  # noqa: F401 - registers the checks
    from tools.gpu_checks.runner import CHECKS, TOTAL_BUDGET_S

    assert sum(c.budget_s for c in CHECKS) <= TOTAL_BUDGET_S <= 600 - 60
    assert all(c.budget_s > 0 for c in CHECKS)
    assert "timeout --kill-after=10 600" in (REPO / "tools" / "gpu_check.sh").read_text()


def test_a_check_past_its_budget_fails_and_stops_the_run(tmp_path):
    import threading

    from tools.gpu_checks.runner import Check, Figure, run_checks, time_left

    seen = []

    def hangs(ctx):
        seen.append(time_left())
        threading.Event().wait()  # never set: only the budget's alarm ends it

    checks = [Check("hangs", False, hangs, budget_s=0.5), Check("next", False, lambda ctx: Figure("ok"), 5)]
    results = run_checks(None, checks, tmp_path / "f.json", dry=False, print_fn=lambda s, **k: None)
    assert [r.status for r in results] == ["FAIL", "NOT RUN"]
    assert "ran past its budget of 0.5 s" in results[0].summary
    assert 0 < seen[0] <= 1.0  # what the check may still wait: its budget, floored at 1 s


def test_a_check_stuck_in_native_code_ends_the_run_with_figures(tmp_path, monkeypatch):
    """A hang the alarm cannot interrupt (here: one that swallows it, as a native call would
    never return to Python): the watchdog writes the figures so far and exits."""
    import threading

    import tools.gpu_checks.runner as runner

    monkeypatch.setattr(runner, "HARD_GRACE_S", 0.2)
    released = threading.Event()
    exits = []

    def stuck(ctx):
        try:
            released.wait(120)
        except runner.CheckTimeout:
            released.wait(120)  # ignores the interrupt
        raise RuntimeError("released by the test's stand-in exit")

    def fake_exit(code):
        exits.append((code, json.loads((tmp_path / "f.json").read_text())))
        released.set()

    checks = [runner.Check("first", False, lambda ctx: runner.Figure("ok", {"x": 2}), 5),
              runner.Check("stuck", False, stuck, budget_s=0.3)]  # fmt: skip
    runner.run_checks(
        None, checks, tmp_path / "f.json", dry=False, print_fn=lambda s, **k: None, exit_fn=fake_exit
    )
    code, saved = exits[0]
    assert code == 1
    assert [(c["name"], c["status"]) for c in saved["checks"]] == [("first", "PASS"), ("stuck", "FAIL")]
    assert "native code" in saved["checks"][1]["summary"] and saved["checks"][0]["values"]["x"] == 2


@pytest.mark.parametrize("size", ["0.5B", "1.5B"])
def test_mfu_flops_by_hand(size):
    from tools.gpu_checks.shapes import QWEN25, train_step_flops

    s = QWEN25[size]
    h, i, L, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    # Qwen2 layer: q (h*h + h), k and v (h*kv + kv each), o (h*h), 3 MLP matrices, 2 norms.
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    n = v * h + L * layer + h  # tied embedding, final norm
    assert {"0.5B": 0.494e9, "1.5B": 1.544e9}[size] == pytest.approx(n, rel=2e-3)  # published sizes
    seq, tokens = 4096, 4 * 4096
    assert train_step_flops(n, L, h, seq, tokens) == (6 * n + 12 * L * h * seq) * tokens


def test_stack_figures_from_a_run_and_the_mismatch(tmp_path):
    """The 2-step run's verdict from its metrics.jsonl (hand-written here), and the mismatch
    figure of the colocated sync check."""
    from tools.gpu_checks.runner import CheckFailed
    from tools.gpu_checks.stack import MISMATCH_BOUND, dapo_figures, mismatch

    assert mismatch([-1.0, -2.0, -3.0], [-1.5, -2.0, -2.0]) == (0.5, 1.0)
    with pytest.raises(CheckFailed, match="lengths differ"):
        mismatch([-1.0], [])
    path = tmp_path / "metrics.jsonl"

    def write(*steps):
        path.write_text("".join(json.dumps(s) + "\n" for s in steps))

    ok = {"actor/rollout_logprob_abs_diff": 0.01, "rollout/engines_down": 0}
    write({"step": 0}, {"step": 1, **ok}, {"step": 2, **ok})
    assert dapo_figures(path) == {"steps": 2, "rollout_logprob_abs_diff": [0.01, 0.01]}
    write({"step": 1, **ok})
    with pytest.raises(CheckFailed, match=r"steps \[1\], not 1..2"):
        dapo_figures(path)
    write({"step": 1, **ok}, {"step": 2, **ok, "actor/rollout_logprob_abs_diff": 2 * MISMATCH_BOUND})
    with pytest.raises(CheckFailed, match="mismatch per step"):
        dapo_figures(path)
