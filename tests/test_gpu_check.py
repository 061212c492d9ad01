"""tools/gpu_check.sh and its checks (tools/gpu_checks): the shell parses, the CPU dry mode runs
the checks that need no CUDA (bf16 vs fp32 update, defect 1, the torchrun run through a
checkpoint, a resume and the HF export, the actor benchmark) and reports the CUDA ones NOT RUN;
each check runs in its own process, a failure does not stop the others, checks that need TE or
SGLang are UNAVAILABLE where those do not import, and the MFU FLOP count matches a hand computation."""

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
    # bf16 really ran: its update differs from fp32's (0.0095 here, 0.073 on an H200), and not by much
    assert 1e-3 < checks["bf16_step_vs_fp32"]["values"]["relative_update_error"] < 0.1
    torchrun = checks["dapo_torchrun_checkpoint_resume"]["values"]
    assert "step_00000002" in torchrun["checkpoints"] and torchrun["export"] == "step_3"
    assert torchrun["compared_keys"] > 20
    assert checks["bench_actor"]["values"]["ratios"]["update_over_bare_mfu"] > 0
    assert all(c["budget_s"] > 0 for c in checks.values())
    for name in checks:
        assert f"{name}" in proc.stdout


def _result(name, status, summary="", values=None):
    from tools.gpu_checks.runner import Result

    return Result(name, status, summary, 0.1, values or {})


def test_a_failure_does_not_stop_the_others_and_missing_pieces_are_unavailable(tmp_path):
    from tools.gpu_checks.runner import Check, Figure, run_checks

    started = []

    def runner(c, work, budget, dry, cwd):
        started.append((c.name, budget))
        return (
            _result(c.name, "FAIL", "figure 3.0 > bound 1.0")
            if c.name == "b"
            else _result(c.name, "PASS", "ok")
        )

    checks = [
        Check("a", False, lambda ctx: Figure("ok"), 5),
        Check("b", False, lambda ctx: Figure("ok"), 6),
        Check("c", False, lambda ctx: Figure("ok"), 7),
        Check("te", True, lambda ctx: Figure("ok"), 8, needs=("te",)),
        Check("sg", False, lambda ctx: Figure("ok"), 9, needs=("te", "sglang")),
        Check("cuda", True, lambda ctx: Figure("ok"), 10),
    ]
    lines = []
    results = run_checks(
        tmp_path, checks, tmp_path / "f.json", dry=False, print_fn=lambda s, **k: lines.append(s),
        runner=runner, importable=lambda module: module == "sglang",
    )  # fmt: skip
    assert [r.status for r in results] == ["PASS", "FAIL", "PASS", "UNAVAILABLE", "UNAVAILABLE", "PASS"]
    assert started == [("a", 5), ("b", 6), ("c", 7), ("cuda", 10)]
    assert results[3].summary == "UNAVAILABLE (needs Transformer Engine: the project's image)"
    assert results[4].summary == "UNAVAILABLE (needs Transformer Engine: the project's image)"
    assert "figure 3.0 > bound 1.0" in lines[1] and lines[1].startswith("FAIL")
    saved = json.loads((tmp_path / "f.json").read_text())
    assert [c["status"] for c in saved["checks"]] == [r.status for r in results]


def test_budgets_fit_eight_minutes_on_a_bare_machine(tmp_path):
    """Every check has a budget; those a bare GPU machine runs (no TE, no SGLang) sum to at most
    the 8 minutes the acceptance promises, under the script's 10-minute limit."""
    from tools.gpu_checks import checks  # noqa: F401 - registers the checks
    from tools.gpu_checks.runner import CHECKS, TOTAL_BUDGET_S

    assert sum(c.budget_s for c in CHECKS if not c.needs) <= TOTAL_BUDGET_S <= 8 * 60
    assert all(c.budget_s > 0 for c in CHECKS)
    assert "timeout --kill-after=10 600" in (REPO / "tools" / "gpu_check.sh").read_text()


def test_each_check_runs_in_its_own_process_killed_at_its_budget(tmp_path, monkeypatch):
    """The real child runner: a check that crashes its process, one that hangs (killed at the
    budget), then one that passes: each in a fresh process, the next one unaffected."""
    import tools.gpu_checks.runner as runner

    argv_of = {
        "crash": [sys.executable, "-c", "import os; os._exit(3)"],
        "hang": [sys.executable, "-c", "import time; time.sleep(60)"],
    }

    def fake_argv(c, work, out, dry):
        if c.name in argv_of:
            return argv_of[c.name]
        code = f"import json; json.dump(dict(name={c.name!r}, status='PASS', summary='ok', seconds=0.0, values={{'pid': __import__('os').getpid()}}), open({str(out)!r}, 'w'))"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(runner, "child_argv", fake_argv)
    checks = [runner.Check(n, False, None, b) for n, b in (("crash", 30), ("hang", 1.5), ("ok", 30))]
    results = runner.run_checks(
        tmp_path, checks, tmp_path / "f.json", dry=False, print_fn=lambda s, **k: None
    )
    assert [r.status for r in results] == ["FAIL", "FAIL", "PASS"]
    assert "exited with 3 and no result" in results[0].summary
    assert "ran past its budget of 1.5 s (killed)" in results[1].summary and results[1].seconds < 30
    assert results[2].values["pid"] != os.getpid()


def test_resume_differences_leave_out_timing_and_use_the_tolerance():
    from tools.gpu_checks.run import resume_differences

    full = {
        "step": 3,
        "actor/pg_loss": 0.5,
        "rollout/time_s": 1.0,
        "critic/score/mean": 0.25,
        "x": float("nan"),
    }
    same = {**full, "rollout/time_s": 9.0}
    assert resume_differences(full, same, 0.0) == []
    off = {**same, "actor/pg_loss": 0.5001}
    assert resume_differences(full, off, 0.0) == ["actor/pg_loss: 0.5 != 0.5001"]
    assert resume_differences(full, off, 1e-3) == []
    assert resume_differences(full, {**same, "critic/score/mean": 0.5}, 1e-3) == [
        "critic/score/mean: 0.25 != 0.5"
    ]


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
