"""The harness of the end-to-end training tests: the demo config's overrides for a tiny run on the
warm-started assets (conftest's ``assets``), the `megatron-dapo train` command, and a way to stop
a run at a chosen step on any machine, however loaded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dapo.driver.test_hold import HOLD_ENV, RELEASE_ENV

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONUNBUFFERED="1")

# dynamic sampling (unbounded rounds: the batch always fills) and overlong shaping on, as in DAPO
DAPO_ON = {
    "algorithm.filter_groups.enable": "true",
    "algorithm.filter_groups.max_num_gen_batches": 0,
    "algorithm.overlong_buffer.enable": "true",
}


def train_overrides(assets, runs_dir, name, steps, **extra) -> list[str]:
    """Overrides of configs/demo.yaml for a `steps`-step run named `name` on `assets` (anything with
    hf_dir, train_file and val_file), 4 prompts x 4 samples per step; `extra` wins."""
    base = {
        "model.path": assets.hf_dir,
        "data.train_files": f"[{assets.train_file}]",
        "data.val_files": f"[{assets.val_file}]",
        "data.val_max_samples": 6,
        "trainer.runs_dir": runs_dir,
        "trainer.run_name": name,
        "trainer.total_steps": steps,
        "trainer.train_batch_size": 4,
        "rollout.gen_batch_size": 4,
        "rollout.n": 4,
        "rollout.groups_per_call": 4,
        "rollout.val.n": 2,
        "actor.ppo_mini_batch_size": 4,
        "algorithm.filter_groups.enable": "false",
        "algorithm.allow_partial_batch": "false",
        "trainer.test_freq": 2,
        "trainer.save_freq": 1,
        "logging.progress": "false",
        "logging.plots_at_end": "true",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "megatron_dapo.cli", "train", str(REPO / "configs/demo.yaml"), *args]


def train_to_end(args: list[str]) -> None:
    """Run `megatron-dapo train` with `args` in a subprocess; fail the test if it fails."""
    subprocess.run(train_cmd(args), check=True, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, timeout=600)


def start_and_wait_for_step(args, metrics: Path, step: int) -> subprocess.Popen:
    """Start a training run in its own process group; return once `step` is in its metrics.

    The driver is held after `step` (a test-only hook) until a stop signal or `release(run_dir)`,
    so the interruption always lands mid-run however fast or loaded the machine is."""
    hold = {HOLD_ENV: str(step), RELEASE_ENV: str(metrics.parent / "release_hold")}
    proc = subprocess.Popen(
        train_cmd(args),
        env=dict(ENV, **hold),
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        if metrics.is_file() and any(r["step"] >= step for r in read_metrics(metrics.parent)):
            return proc
        assert proc.poll() is None, "the run ended before it could be interrupted: " + proc.stderr.read()
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"the run did not reach step {step} in time")


def release(run: Path) -> None:
    """Let a run held by `start_and_wait_for_step` go on."""
    (run / "release_hold").touch()
