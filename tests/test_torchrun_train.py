"""`torchrun --nproc-per-node 2 -m megatron_dapo.train` on CPU: two Megatron ranks (TP=2) as SPMD
processes, rank 0 driving the HF engine in its own process: steps with ~0 trainer/engine log-prob
mismatch, a SIGTERM to both ranks that ends in a saved checkpoint and exit 0, and a resume that
continues the same metrics file with the engine brought to the trained weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_dapo.demo.assets import prepare_demo_assets

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    # a weak model is fine: this is about plumbing, with dynamic sampling off
    return prepare_demo_assets(tmp_path_factory.mktemp("torchrun_assets"), sft_steps=5, eval_problems=8)


def _cmd(assets, runs_dir, name, steps, **extra) -> list[str]:
    args = {
        "model.path": assets.hf_dir,
        "data.train_files": f"[{assets.train_file}]",
        "data.val_files": "[]",
        "trainer.runs_dir": runs_dir,
        "trainer.run_name": name,
        "trainer.total_steps": steps,
        "trainer.train_batch_size": 2,
        "rollout.gen_batch_size": 2,
        "rollout.n": 4,
        "rollout.groups_per_call": 2,
        "actor.ppo_mini_batch_size": 2,
        "algorithm.filter_groups.enable": "false",
        "algorithm.allow_partial_batch": "false",
        "trainer.save_freq": 0,  # only at the end (or at a stop)
        "trainer.resume": "auto",
        "trainer.val_before_train": "false",
        "trainer.test_freq": 0,
        "logging.progress": "false",
        "logging.plots_at_end": "false",
        **extra,
    }
    return [
        str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(_port()),
        "-m", "megatron_dapo.train", str(REPO / "configs/demo.yaml"), *[f"{k}={v}" for k, v in args.items()],
    ]  # fmt: skip


def _port() -> int:
    from megatron_dapo.actor.spawn import free_port

    return free_port()


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def _run(cmd, timeout=240) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _run_until_first_step_then_sigterm(cmd, run: Path) -> str:
    """Start `cmd`; once a step is logged, SIGTERM every rank (as a scheduler does); its output."""
    import psutil

    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 180
        metrics = run / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None, f"run ended early:\n{proc.stdout.read()[-4000:]}"
            assert time.monotonic() < deadline, "no step finished in time"
            time.sleep(0.1)
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2
        for w in workers:
            w.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    return out


def test_steps_sigterm_and_resume_under_torchrun(assets, tmp_path):
    run = tmp_path / "tr"
    # 1. a 50-step run stopped by SIGTERM to both ranks once step 1 is logged: rank 0 finishes the
    #    step in flight, saves, and every rank exits 0 (the others ignored the signal for the save)
    _run_until_first_step_then_sigterm(_cmd(assets, tmp_path, "tr", 50), run)
    summary = json.loads((run / "summary.json").read_text())
    stopped = summary["step"]
    assert summary["stopped_by"] == "SIGTERM" and 1 <= stopped < 50
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    records = _metrics(run)
    assert [r["step"] for r in records] == list(range(1, stopped + 1))
    first = records[0]
    # rank 0's HF engine sampled with the weights both Megatron ranks hold: the trainer agrees
    assert first["actor/rollout_logprob_abs_diff"] < 1e-4
    assert first["actor/ppo_kl"] == 0.0 and first["actor/grad_norm"] > 0
    assert first["sync/buckets"] >= 1 and first["actor/tokens"] > 0
    assert (run / "hf" / f"step_{stopped}" / "config.json").is_file()
    assert "actor_world_size: 2" in (run / "config.yaml").read_text()

    # 2. resume for one more step: the engine restarts from the initial HF weights and receives the
    #    trained ones by the resume sync (without it this mismatch is ~1e-2 after one update)
    _run(_cmd(assets, tmp_path, "tr", stopped + 1))
    records = _metrics(run)
    assert [r["step"] for r in records] == list(range(1, stopped + 2))
    assert records[0] == first
    assert records[-1]["actor/rollout_logprob_abs_diff"] < 1e-4
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == stopped and summary["step"] == stopped + 1
