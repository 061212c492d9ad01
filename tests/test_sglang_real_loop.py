"""The DAPO loop with the real SGLang 0.5.23 server as the rollout engine (CPU, fp32).

Ray local, 2 Megatron ranks (TP=2, gloo), 2 SGLang servers started by the driver on this node
(`rollout.engine=sglang`), weights by SGLang's distributed update over gloo after every step.
The trainer scores the servers' samples as the servers did (log-prob mismatch < 1e-4) at step 1
(initial weights) and at step 2 (weights of the sync after step 1: a broken sync shows here).
Skips when the SGLang venv (`make setup-sglang`) or the CPU stand-ins are missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_dapo.driver.sglang_engines import CPU_STANDINS
from megatron_dapo.rollout.sglang_server import REPO_SGLANG_PYTHON

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not (REPO_SGLANG_PYTHON.exists() and (REPO_SGLANG_PYTHON.parents[1] / ".installed").exists())
    or not CPU_STANDINS.is_dir(),
    reason=f"the real SGLang server needs {REPO_SGLANG_PYTHON.parents[1]} (make setup-sglang) and {CPU_STANDINS}",
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from megatron_dapo.demo.assets import prepare_demo_assets

    return prepare_demo_assets(tmp_path_factory.mktemp("demo_assets"), sft_steps=5, eval_problems=4)


def test_two_dapo_steps_with_two_sglang_servers(assets, tmp_path):
    from megatron_dapo.driver.launch import load_for_cli, run_train

    overrides = {
        "model.path": assets.hf_dir,
        "data.train_files": f"[{assets.train_file}]",
        "data.val_files": f"[{assets.val_file}]",
        "trainer.runs_dir": tmp_path,
        "trainer.run_name": "sglang",
        "trainer.total_steps": 2,
        "trainer.train_batch_size": 4,
        "trainer.val_before_train": "false",
        "trainer.test_freq": 0,
        "trainer.save_freq": 0,
        "trainer.hf_export_at_end": "false",
        "rollout.engine": "sglang",
        "rollout.num_engines": 2,
        "rollout.gen_batch_size": 4,
        "rollout.n": 4,
        "rollout.groups_per_call": 1,
        "rollout.max_concurrency_per_engine": 8,
        "rollout.sglang.startup_timeout_s": 900,
        "actor.ppo_mini_batch_size": 4,
        "algorithm.filter_groups.enable": "false",
        "algorithm.allow_partial_batch": "false",
        "logging.progress": "false",
        "logging.plots_at_end": "false",
    }
    cfg = load_for_cli(str(REPO / "configs/demo.yaml"), [f"{k}={v}" for k, v in overrides.items()])
    summary = run_train(cfg)
    run = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/groups_in_batch"] == 4
        assert r["actor/rollout_logprob_abs_diff"] < 1e-4, r["step"]
        assert r["sync/buckets"] >= 1
    # both servers served (the manager spreads groups over engines), none went down
    assert all(r["rollout/engines_down"] == 0 for r in steps)
    logs = sorted((run / "sglang").glob("engine_*.log"))
    assert [p.name for p in logs] == ["engine_0.log", "engine_1.log"]
