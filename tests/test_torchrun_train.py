"""`torchrun --nproc-per-node 2 -m megatron_dapo.train` on CPU: two Megatron ranks (TP=2) as SPMD
processes, rank 0 driving the HF engine in its own process: steps with ~0 trainer/engine log-prob
mismatch, a SIGTERM to the whole job that ends in a saved checkpoint with every rank exiting 0,
and a resume that continues the same metrics file with the engine brought to the trained weights,
itself stopped by a SIGINT to torchrun's agent alone (one run for the resume and the stop)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.fixture(scope="module")
def assets(small_demo_assets):
    # a weak model is fine: this is about plumbing, with dynamic sampling off (the session's one
    # few-step build, shared with the real-SGLang modules)
    return small_demo_assets(sft_steps=5, eval_problems=4)


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
    from megatron_dapo.ports import free_port

    return free_port()


def _env() -> dict[str, str]:
    # torchrun SIGKILLs its workers this long after forwarding a signal (30 s by default);
    # launch/torchrun_multinode.sh sets it above trainer.stop_timeout_s the same way
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        TORCH_ELASTIC_SHUTDOWN_TIMEOUT="300",
    )


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _run_until_first_step_then_sigterm(cmd, run: Path) -> str:
    """Start `cmd`; once a step is logged, SIGTERM every process of the job at once (Slurm's
    preemption: torchrun's agent then forwards it to the workers a second time); its output."""
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
        agent = psutil.Process(proc.pid)
        workers = agent.children()
        assert len(workers) == 2
        for p in [agent, *workers]:
            p.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    return out


def test_steps_sigterm_resume_and_sigint_under_torchrun(assets, tmp_path):
    run = tmp_path / "tr"
    # 1. a 50-step run stopped by SIGTERM to the job once step 1 is logged: rank 0 finishes the
    #    step in flight, saves, and every rank exits 0 (the others ignored the signal for the save;
    #    the agent's second delivery is not taken for a forced stop); torchrun itself then reports
    #    the signal it got, so only the ranks' exits are checked (no failure in its summary)
    out = _run_until_first_step_then_sigterm(_cmd(assets, tmp_path, "tr", 50), run)
    assert "second" not in out, out[-4000:]
    assert "failed" not in out, out[-4000:]
    assert _our_tracebacks(out) == 0, out[-6000:]
    summary = json.loads((run / "summary.json").read_text())
    stopped = summary["step"]
    assert summary["stopped_by"] == "SIGTERM" and 1 <= stopped < 50
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    records = _metrics(run)
    assert [r["step"] for r in records] == list(range(1, stopped + 1))
    first = records[0]
    # rank 0's HF engine sampled with the weights both Megatron ranks hold: the trainer agrees
    assert first["actor/rollout_logprob_abs_diff"] < 1e-4
    assert first["actor/ppo_kl"] == 0.0
    # the weak warm start often scores every response of a group alike (all advantages zero,
    # hence no gradient): the update must move the weights exactly when some group has spread
    spread = max(first["train/advantages/max"], -first["train/advantages/min"]) > 0
    assert (first["actor/grad_norm"] > 0) == spread
    assert first["sync/buckets"] >= 1 and first["actor/tokens"] > 0
    assert (run / "hf" / f"step_{stopped}" / "config.json").is_file()
    assert "actor_world_size: 2" in (run / "config.yaml").read_text()

    # 2. resume: the engine restarts from the initial HF weights and receives the trained ones by
    #    the resume sync (without it this mismatch is ~1e-2 after one update). Once a step more is
    #    logged, SIGINT to the agent alone (Ctrl-C: the workers run in sessions of their own): rank
    #    0 checkpoints its last finished step (save_freq=0: the stop's own save) and every rank
    #    exits 0; torchrun itself then reports the signal it got
    log = tmp_path / "resumed.log"
    proc = _start_until(
        _cmd(assets, tmp_path, "tr", 50), log, lambda: len(_metrics(run)) > stopped, f"step {stopped + 1}"
    )
    proc.send_signal(signal.SIGINT)
    out = _wait(proc, log, 180)
    assert "second" not in out, out[-4000:]
    assert "failed" not in out, out[-4000:]
    assert _our_tracebacks(out) == 0, out[-6000:]
    records = _metrics(run)
    last = records[-1]["step"]
    assert [r["step"] for r in records] == list(range(1, last + 1)) and stopped < last < 50
    assert records[0] == first
    assert records[stopped]["actor/rollout_logprob_abs_diff"] < 1e-4  # the first resumed step
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == stopped
    assert summary["stopped_by"] == "SIGINT" and summary["step"] == last
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{last:08d}"


def _start_until(cmd, log: Path, ready, what: str) -> subprocess.Popen:
    """Start torchrun in its own session, output to `log` (a pipe would hang on any process that
    outlives it); return once `ready()` holds (`what` names it) and every rank is up."""
    import psutil

    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 240
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"run ended early ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            _kill_job(proc)
            pytest.fail(f"no {what} in time")
        time.sleep(0.2)
    assert len(psutil.Process(proc.pid).children()) == 2
    return proc


def _kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and everything under it (its workers run in sessions of their own)."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait(timeout=60)


def _wait(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_job(proc)
        pytest.fail(f"torchrun still running {timeout:.0f}s later (a hang):\n{log.read_text()[-4000:]}")
    return log.read_text()


def _our_tracebacks(out: str) -> int:
    """Python tracebacks in the output that are not torchrun's own report of a failed or signalled job."""
    theirs = out.count("ChildFailedError:") + out.count("SignalException:")
    return out.count("Traceback (most recent call last)") - theirs


def test_a_rank_killed_under_torchrun_stops_the_run_with_one_line(assets, tmp_path):
    """A rank killed by pid mid-run (the OOM killer): rank 0 ends the run with one line naming the
    dead rank's pid and the checkpoint a resume uses, nothing of the killed rank is left behind,
    and nothing hangs (torchrun's agent prints its own failure summary besides)."""
    import psutil

    run, log = tmp_path / "k", tmp_path / "k.log"
    latest = run / "checkpoints" / "latest"
    cmd = _cmd(assets, tmp_path, "k", 50, **{"trainer.save_freq": 1})
    proc = _start_until(cmd, log, latest.is_file, "checkpoint")
    rank0, rank1 = psutil.Process(proc.pid).children()
    helpers = rank1.children(recursive=True)  # e.g. the checkpoint writer's manager process
    os.kill(rank1.pid, signal.SIGKILL)
    out = _wait(proc, log, 180)
    assert proc.returncode != 0
    lines = [x for x in out.splitlines() if x.startswith("failed:")]
    assert len(lines) == 1, out[-6000:]
    line = lines[0]
    assert f"training rank 1 (pid {rank1.pid}) died" in line, line
    assert "trainer.resume=auto continues from" in line and str(run / "checkpoints" / "step_0000000") in line
    assert _our_tracebacks(out) == 0, out[-6000:]
    assert "Traceback" in (run / "error.log").read_text()
    # an orphan would hold torchrun's stdout open: `torchrun ... | tee log` would never end
    _, alive = psutil.wait_procs([rank0, *helpers], timeout=60)
    assert not alive, [p.pid for p in alive]


def test_a_hung_rank_under_torchrun_ends_the_job_with_one_line(assets, tmp_path):
    """Rank 1 blocks (alive) in step 2's train_step: rank 0's wait is bounded by
    trainer.call_timeout.train_step_s, so the job exits non-zero well before the hook's 600 s with
    one `failed:` line naming the call, the rank that did not answer, the knob and step 1's
    checkpoint, no traceback of ours, and step 1's checkpoint still the resume point. Before, the
    control channel waited 24 h (here: the hook's 600 s, past this test's bound)."""
    from megatron_dapo.driver.test_hold import HANG_ENV

    run, log = tmp_path / "h", tmp_path / "h.log"
    extra = {"trainer.save_freq": 1, "trainer.call_timeout.train_step_s": 5}
    proc = subprocess.Popen(
        _cmd(assets, tmp_path, "h", 3, **extra),
        cwd=REPO,
        env={**_env(), HANG_ENV: "1:2"},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out = _wait(proc, log, 240)
    assert proc.returncode != 0, out[-4000:]
    lines = [x for x in out.splitlines() if x.startswith("failed:")]
    assert len(lines) == 1, out[-6000:]
    line = lines[0]
    # rank 0 waits inside the step's own tensor-parallel collectives, so it is late too
    assert re.match(r"failed: train_step: ranks \[(0, )?1\] did not finish within 5s", line), line
    assert "trainer.call_timeout.train_step_s=5" in line, line
    assert f"trainer.resume=auto continues from {run / 'checkpoints' / 'step_00000001'}" in line, line
    assert "[rank 1] stopped: rank 0 ended the run" in out, out[-4000:]
    assert _our_tracebacks(out) == 0, out[-6000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    assert [r["step"] for r in _metrics(run)] == [1]
