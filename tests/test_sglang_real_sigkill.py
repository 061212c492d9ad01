"""SIGKILL of a whole run with `rollout.engine=sglang` (real CPU server, Ray local, one actor rank,
fp32): the run blocks inside its step-2 engine call (`sglang_probe_run.py`), so the kill lands at
a known point, after checkpoint 1 and before any checkpoint 2. Checked: the latest checkpoint is
step 1's, and the killed run's SGLang server does not outlive it (it runs in its own session, out
of the killed group, and dies with the Ray process that started it), so a killed job leaves no
server holding its GPUs.

What a resume then does with SGLang is tested where it costs no second run: resuming is the
HF-engine runs' resume (bitwise in test_driver_e2e, test_agent_e2e) followed by the sync every
step does, and a fresh server given the actor's weights by that sync serves them
(test_sglang_real_restart: a restarted server's log-probs equal HF's on the actor's exported
weights within 1e-5; test_sglang_real_torchrun_nodes). Skips without `make setup-sglang`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sglang_fixtures import require_sglang

REPO = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).resolve().parent / "sglang_probe_run.py"
SEQUENCE = [5, 6, 7, 8, 40, 41, 42, 100, 3, 77]


@pytest.fixture(scope="module")
def assets(small_demo_assets):
    require_sglang()
    return small_demo_assets(sft_steps=5, eval_problems=4)


def _args(assets, runs: Path) -> list[str]:
    overrides = {
        "model.path": assets.hf_dir,
        "data.train_files": f"[{assets.train_file}]",
        "data.val_files": "[]",
        "trainer.runs_dir": runs,
        "trainer.run_name": "killed",
        "trainer.total_steps": 2,
        "trainer.train_batch_size": 4,
        "trainer.val_before_train": "false",
        "trainer.test_freq": 0,
        "trainer.save_freq": 1,
        "trainer.resume": "auto",
        "trainer.hf_export_at_end": "false",
        "parallel.tensor_model_parallel_size": 1,
        "parallel.actor_world_size": 1,
        "rollout.engine": "sglang",
        "rollout.num_engines": 1,
        "rollout.gen_batch_size": 4,
        "rollout.over_sample": "false",
        "rollout.n": 4,
        "rollout.groups_per_call": 4,  # one engine call per step: call k is step k's
        "rollout.sglang.startup_timeout_s": 900,
        "actor.ppo_mini_batch_size": 4,
        "algorithm.filter_groups.enable": "false",
        "algorithm.allow_partial_batch": "false",
        "logging.progress": "false",
        "logging.plots_at_end": "false",
    }
    return [str(REPO / "configs/demo.yaml"), *[f"{k}={v}" for k, v in overrides.items()]]


def _env(probe_dir: Path, block_at: int = 0) -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PROBE_DIR=str(probe_dir),
        PROBE_SEQUENCE=json.dumps(SEQUENCE),
        PROBE_BLOCK_AT=str(block_at),
    )


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _call(probe_dir: Path, k: int) -> dict:
    return json.loads((probe_dir / f"call_{k}.json").read_text())


def test_sigkill_leaves_checkpoint_1_and_no_server_behind(assets, tmp_path):
    runs, first = tmp_path / "runs", tmp_path / "probe_killed"
    run = runs / "killed"
    proc = subprocess.Popen(
        [sys.executable, str(PROBE), *_args(assets, runs)],
        env=_env(first, block_at=2),
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 900
        while not (first / "call_2.json").is_file():  # blocked inside step 2's engine call
            assert proc.poll() is None, "the run ended before step 2: " + proc.stderr.read()[-4000:]
            assert time.monotonic() < deadline, "the run did not reach step 2 in time"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and every process of its group
        proc.wait(timeout=60)
    killed_2 = _call(first, 2)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    # the server was in its own session, out of the killed group: it must die with its starter
    deadline = time.monotonic() + 300
    while not _gone(killed_2["server_pid"]):
        assert time.monotonic() < deadline, f"SGLang server {killed_2['server_pid']} outlived its run"
        time.sleep(0.2)
