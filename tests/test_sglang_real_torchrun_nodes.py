"""Two torchrun "nodes" on localhost (issue 10): each node's LOCAL_RANK 0 starts the SGLang server
the plan puts on that node, rank 0 reaches the other node's server by the URL gathered over the
trainer's world, and a 2-step DAPO run trains through both (real CPU servers, weights over gloo).

Two agents `torchrun --nnodes 2 --node-rank i --nproc-per-node 1` share a static c10d rendezvous
on a free port; each node has one trainer rank and one real CPU server (two servers and two ranks
fit the 2-core machine with the demo's tiny model). Skips without `make setup-sglang`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from sglang_fixtures import require_sglang

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def test_each_node_starts_its_own_server_and_both_train(small_demo_assets, tmp_path):
    require_sglang()
    import psutil

    from megatron_dapo.actor.spawn import free_port

    assets = small_demo_assets(sft_steps=5, eval_problems=4)
    overrides = {
        "model.path": assets.hf_dir,
        "data.train_files": f"[{assets.train_file}]",
        "data.val_files": "[]",
        "trainer.runs_dir": tmp_path / "runs",
        "trainer.run_name": "nodes",
        "trainer.total_steps": 2,
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
    # both "nodes" are this host: loopback is their address, said explicitly (a guessed one is refused)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               MEGATRON_DAPO_NODE_IP="127.0.0.1")  # fmt: skip
    agents, launched = [], {}
    try:
        for node in (0, 1):
            cmd = [str(TORCHRUN), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                   "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "megatron_dapo.train",
                   str(REPO / "configs/demo.yaml"), *[f"{k}={v}" for k, v in overrides.items()]]  # fmt: skip
            agents.append(
                subprocess.Popen(
                    cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        # which agent each server descends from, seen while the run lives
        import threading

        done = threading.Event()

        def watch():
            while not done.is_set():
                for node, a in enumerate(agents):
                    try:
                        for p in psutil.Process(a.pid).children(recursive=True):
                            cmd = " ".join(p.cmdline())
                            if "sglang.launch_server" in cmd:
                                launched[re.search(r"--port (\d+)", cmd).group(1)] = node
                    except psutil.NoSuchProcess:
                        continue
                done.wait(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        outs = [a.communicate(timeout=900)[0] for a in agents]
    finally:
        done.set()
        for a in agents:
            if a.poll() is None:
                a.kill()
    for node, (a, out) in enumerate(zip(agents, outs)):
        assert a.returncode == 0, f"node {node} failed:\n{out[-4000:]}"
    run = tmp_path / "runs" / "nodes"
    # engine i on node i (i mod 2), started by that node's agent, on its own port
    logs = {i: (run / "sglang" / f"engine_{i}.log").read_text() for i in (0, 1)}
    assert sorted(launched.values()) == [0, 1], launched  # one server under each node's agent
    assert "node 0 starts SGLang engines [0]" in outs[0] and "node 1 starts SGLang engines [1]" in outs[1]
    for i in (0, 1):
        # both served generations after taking the update from the trainer (rank 0, on node 0)
        upd = logs[i].find('POST /update_weights_from_distributed HTTP/1.1" 200')
        assert upd >= 0, f"engine {i} got no weight update:\n{logs[i][-3000:]}"
        assert 'POST /generate HTTP/1.1" 200' in logs[i][upd:], f"engine {i} served nothing after the sync"
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["actor/rollout_logprob_abs_diff"] < 1e-4, m["step"]
    # step 2's samples were generated by servers reporting weight version 1, the actor's
    assert metrics[1]["rollout/unversioned_samples"] == 0
    assert metrics[1]["rollout/staleness_token_max"] == 0
