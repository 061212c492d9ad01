"""Slurm's preemption of a torchrun job that launched its own SGLang server (real CPU server):
SIGTERM to the whole process group. The server runs in its own session, so the signal reaches only
torchrun and the ranks; rank 0 finishes or abandons the step, writes its checkpoint, and only then
stops the server (issue 16: servers must not die with the group before the checkpoint). On a CPU,
rank 0 launches a CPU server on a free port; the weight-update group runs over gloo.
Skips without `make setup-sglang`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sglang_fixtures import launched_servers, require_sglang

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.fixture(scope="module")
def assets(small_demo_assets):
    require_sglang()
    return small_demo_assets(sft_steps=5, eval_problems=4)


def _server_pid(root: int, deadline_s: float = 600) -> int:
    """The `sglang.launch_server` process among the descendants of ``root`` (rank 0 starts it)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        servers = launched_servers(root)
        if servers:
            (server,) = servers
            return server.pid
        time.sleep(0.2)
    raise AssertionError("rank 0 started no SGLang server")


def _rank0_lines(out: str) -> str:
    """Rank 0's lines (it drives the run and says what failed), else the tail."""
    lines = [x for x in out.splitlines() if x.startswith(("[rank0]", "[rank 0]")) and "httpx:" not in x]
    return "\n".join(lines[-60:]) + "\n" + out[-3000:]


def test_group_sigterm_checkpoints_before_the_server_stops(assets, tmp_path):
    import psutil

    from megatron_dapo.ports import free_port

    overrides = {
        "model.path": assets.hf_dir,
        "data.train_files": f"[{assets.train_file}]",
        "data.val_files": "[]",
        "trainer.runs_dir": tmp_path,
        "trainer.run_name": "tr",
        "trainer.total_steps": 50,
        "trainer.train_batch_size": 2,
        "trainer.save_freq": 0,  # only at the stop
        "trainer.val_before_train": "false",
        "trainer.test_freq": 0,
        "trainer.hf_export_at_end": "false",
        "rollout.engine": "sglang",
        "rollout.num_engines": 1,
        "rollout.gen_batch_size": 2,
        "rollout.n": 4,
        "rollout.groups_per_call": 2,
        "rollout.sglang.startup_timeout_s": 900,
        "actor.ppo_mini_batch_size": 2,
        "algorithm.filter_groups.enable": "false",
        "algorithm.allow_partial_batch": "false",
        "logging.progress": "false",
        "logging.plots_at_end": "false",
    }
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "megatron_dapo.train",
           str(REPO / "configs/demo.yaml"), *[f"{k}={v}" for k, v in overrides.items()]]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = tmp_path / "tr"
    died_ns: list[int] = []
    try:
        server = psutil.Process(_server_pid(proc.pid))
        assert os.getsid(server.pid) != os.getsid(proc.pid)  # out of the job's process group

        def watch():
            server.wait()
            died_ns.append(time.time_ns())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        deadline = time.monotonic() + 900
        metrics = run / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None, f"run ended early:\n{_rank0_lines(proc.stdout.read())}"
            assert time.monotonic() < deadline, "no step finished in time"
            time.sleep(0.2)
        assert server.is_running()
        os.killpg(proc.pid, signal.SIGTERM)  # as Slurm does: torchrun and every rank
        out, _ = proc.communicate(timeout=600)
        watcher.join(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # torchrun itself exits 1 after a signal (it re-raises its SignalException once the ranks are
    # done); what counts is that rank 0 stopped cleanly
    assert "[rank0]: Traceback" not in out, _rank0_lines(out)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM"
    latest = run / "checkpoints" / "latest"
    assert latest.read_text().strip() == f"step_{summary['step']:08d}"
    assert died_ns, "the server outlived the run"
    assert died_ns[0] > latest.stat().st_mtime_ns, "the server stopped before the checkpoint was written"
