"""Two torchrun "nodes" on localhost (issue 10): each node's LOCAL_RANK 0 starts the SGLang server
the plan puts on that node, rank 0 reaches the other node's server by the URL gathered over the
trainer's world, and a 3-step DAPO run trains through both (real CPU servers, weights over gloo).
The same run also kills node 1's server after step 1 (the driver held there): step 2 finishes on
node 0's engine with `engines_down`=1, node 1's trainer rank (which started it) starts a new one,
the trainer resyncs it, and step 3 generates on it with the trainer's weights (the log-prob
mismatch bound of the other real tests). After step 3 both agents get SIGTERM, as Slurm's
preemption sends it to each node's job step: the servers run in sessions of their own, so the
signal reaches only torchrun and the ranks; rank 0 finishes or abandons the step, the checkpoint
is written, and only then do the servers stop (issue 16: servers must not die with the group
before the checkpoint). One run for all three behaviours keeps the cost of the kill to one step
and one server start, and of the SIGTERM to one step.

Two agents `torchrun --nnodes 2 --node-rank i --nproc-per-node 1` share a static c10d rendezvous
on a free port; each node has one trainer rank and one real CPU server (two servers and two ranks
fit the 2-core machine with the demo's tiny model). Skips without `make setup-sglang`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from sglang_fixtures import launched_servers, require_sglang

from megatron_dapo.driver.test_hold import HOLD_ENV, RELEASE_ENV

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _wait_for(what: str, ready, agents, timeout_s: float = 900.0) -> None:
    """Poll `ready()` until true; fail naming `what` if the time runs out or an agent exits."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        exited = [a.returncode for a in agents if a.poll() is not None]
        assert not exited, f"an agent exited ({exited}) while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:g}s"
        time.sleep(0.5)


def test_each_node_starts_its_own_server_and_both_train_through_a_kill(small_demo_assets, tmp_path):
    require_sglang()
    import psutil

    from megatron_dapo.ports import free_port

    assets = small_demo_assets(sft_steps=5, eval_problems=4)
    overrides = {
        "model.path": assets.hf_dir,
        "data.train_files": f"[{assets.train_file}]",
        "data.val_files": "[]",
        "trainer.runs_dir": tmp_path / "runs",
        "trainer.run_name": "nodes",
        "trainer.total_steps": 50,  # SIGTERM ends it after step 3
        "trainer.train_batch_size": 2,
        "trainer.save_freq": 0,
        "trainer.val_before_train": "false",
        "trainer.test_freq": 0,
        "trainer.hf_export_at_end": "false",
        "trainer.weight_sync.transport": "nccl",  # the distributed update, over gloo on CPUs
        "rollout.engine": "sglang",
        "rollout.num_engines": 2,
        "rollout.gen_batch_size": 2,
        "rollout.n": 4,
        "rollout.groups_per_call": 1,
        "rollout.sglang.startup_timeout_s": 900,
        "actor.ppo_mini_batch_size": 2,
        "algorithm.filter_groups.enable": "false",
        "algorithm.allow_partial_batch": "false",
        "logging.progress": "false",
        "logging.plots_at_end": "false",
    }
    port = free_port()
    run = tmp_path / "runs" / "nodes"
    release = tmp_path / "release_hold"
    # both "nodes" are this host: loopback is their address, said explicitly (a guessed one is refused)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               MEGATRON_DAPO_NODE_IP="127.0.0.1", **{HOLD_ENV: "1", RELEASE_ENV: str(release)})  # fmt: skip
    agents, launched = [], {}  # server pid -> (node, its port, its parent pid)
    try:
        for node in (0, 1):
            cmd = [str(TORCHRUN), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                   "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "megatron_dapo.train",
                   str(REPO / "configs/demo.yaml"), *[f"{k}={v}" for k, v in overrides.items()]]  # fmt: skip
            agents.append(  # each agent its own process group, as a Slurm job step on a node
                subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env=env,
                    start_new_session=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        # which agent each server descends from, seen while the run lives
        done = threading.Event()

        def watch():
            while not done.is_set():
                for node, a in enumerate(agents):
                    try:
                        for p in launched_servers(a.pid):
                            if p.pid not in launched:
                                cmd = " ".join(p.cmdline())
                                launched[p.pid] = (node, re.search(r"--port (\d+)", cmd).group(1), p.ppid())
                    except psutil.NoSuchProcess:
                        continue
                done.wait(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        # step 1 is logged and the driver holds: SIGKILL node 1's server (its whole process group)
        metrics_file = run / "metrics.jsonl"
        _wait_for(
            "step 1 in metrics.jsonl",
            lambda: metrics_file.exists() and metrics_file.read_text().strip(),
            agents,
        )
        _wait_for("node 1's server", lambda: any(n == 1 for n, _, _ in launched.values()), agents, 60)
        (killed,) = [pid for pid, (n, _, _) in launched.items() if n == 1]
        os.killpg(killed, signal.SIGKILL)

        def gone():
            try:
                return psutil.Process(killed).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        _wait_for("the killed server to exit", gone, agents, 60)
        release.touch()
        # step 3 ran on the restarted server; then preemption: SIGTERM to both nodes' groups
        _wait_for("step 3 in metrics.jsonl", lambda: len(metrics_file.read_text().splitlines()) >= 3, agents)
        serving = {n: pid for pid, (n, _, _) in launched.items() if pid != killed}
        assert sorted(serving) == [0, 1], launched
        died: dict[int, int] = {}

        def watch_server(node: int, pid: int) -> None:
            psutil.Process(pid).wait()
            died[node] = time.time_ns()

        for node, pid in serving.items():
            assert os.getsid(pid) != os.getsid(agents[node].pid)  # out of the job step's group
            threading.Thread(target=watch_server, args=(node, pid), daemon=True).start()
        for a in agents:
            os.killpg(a.pid, signal.SIGTERM)
        outs = [a.communicate(timeout=900)[0] for a in agents]
        deadline = time.monotonic() + 300
        while len(died) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        done.set()
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    # torchrun itself exits 1 after a signal (it re-raises its SignalException once the ranks are
    # done); what counts is that no rank failed and rank 0 stopped cleanly
    for node, out in enumerate(outs):  # one trainer rank per node: global rank = node
        assert f"[rank{node}]: Traceback" not in out, f"node {node} failed:\n{out[-4000:]}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["step"] >= 3
    latest = run / "checkpoints" / "latest"
    assert latest.read_text().strip() == f"step_{summary['step']:08d}"
    assert sorted(died) == [0, 1], "a server outlived the run"
    for node in (0, 1):
        assert died[node] > latest.stat().st_mtime_ns, f"node {node}'s server stopped before the checkpoint"
    # engine i on node i (i mod 2), started by that node's agent, on its own port
    logs = {i: (run / "sglang" / f"engine_{i}.log").read_text() for i in (0, 1)}
    assert "node 0 starts SGLang engines [0]" in outs[0] and "node 1 starts SGLang engines [1]" in outs[1]
    by_node = {
        n: sorted((pid, port, ppid) for pid, (node, port, ppid) in launched.items() if node == n)
        for n in (0, 1)
    }
    assert len(by_node[0]) == 1, launched  # node 0's server lived through the run
    # node 1's server: the killed one, then a new process on the same port, started by the same
    # process (node 1's trainer rank, a child of node 1's agent), not by rank 0
    assert len(by_node[1]) == 2, launched
    (new,) = [s for s in by_node[1] if s[0] != killed]
    (old,) = [s for s in by_node[1] if s[0] == killed]
    assert new[1] == old[1] and new[2] == old[2], (old, new)
    ready = "The server is fired up and ready to roll!"
    assert logs[1].count(ready) == 2, "engine 1's log shows no second start"  # appended to, not replaced
    for i in (0, 1):
        # the server process that ran last on each node (for engine 1 the restarted one) served
        # generations after taking an update from the trainer (rank 0, on node 0)
        last = logs[i][logs[i].rfind(ready) :]
        upd = last.find('POST /update_weights_from_distributed HTTP/1.1" 200')
        assert upd >= 0, f"engine {i} got no weight update:\n{last[-3000:]}"
        assert 'POST /generate HTTP/1.1" 200' in last[upd:], f"engine {i} served nothing after the sync"
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in metrics] == list(range(1, summary["step"] + 1))
    assert [m["rollout/engines_down"] for m in metrics] == [0, 1] + [0] * (len(metrics) - 2)
    for m in metrics:  # step 3 ran on the restarted server too: it was resynced to the actor's weights
        assert m["actor/rollout_logprob_abs_diff"] < 1e-4, m["step"]
    # steps 2 and 3's samples were generated by servers reporting the actor's weight version
    for m in metrics[1:]:
        assert m["rollout/unversioned_samples"] == 0
        assert m["rollout/staleness_token_max"] == 0
