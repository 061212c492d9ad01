"""Under multi-node torchrun, a dead SGLang server of another node is restarted by the process
that started it (that node's LOCAL_RANK 0), through a rank call from rank 0 (issue 10).

Two ranks of a gloo world play two nodes: rank 1 ("node1", LOCAL_RANK 0) starts a stand-in server
(a tiny HTTP server reporting its pid and parent pid) under its `NodeServers`; rank 0 builds its
engines with `rank0_engines` (the connection itself is stubbed: the stand-in speaks no SGLang),
kills the server, and runs the engine pool's `restart_down`. The server must come back as a
child of rank 1. Then the server hangs (SIGSTOP: its port still accepts, nothing answers) with no
request on it: the check before the sync must find it down (its GET /health is not answered within
the engine's health timeout) and rank 1 must kill it and start a new one. Then the server is made
to fail at start: the restart must end with an EngineError naming the node, the URL and the log.
Before the fixes, rank 0's engine for another node's server had no server handle, and the dead
server stayed dead; a hung one passed the port check and was left to hang the sync.

Each rank runs this file as a script (`python THIS rank`), with torchrun's environment variables.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import unittest.mock as mock
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]

STANDIN = Path(__file__).with_name("standin_http_server.py")


def _get(url: str) -> dict | None:
    import httpx

    try:
        return httpx.get(url + "/health_generate", timeout=10).json()
    except Exception:  # noqa: BLE001 - a dead server
        return None


def _rank_main(tmp: Path) -> None:
    import torch.distributed as dist

    from megatron_dapo.driver.actor_worker import ActorWorker
    from megatron_dapo.driver.rank_group import SPMDRankGroup
    from megatron_dapo.ports import free_port
    from megatron_dapo.rollout.engine import EngineError
    from megatron_dapo.rollout.engine_pool import EnginePool
    from megatron_dapo.sglang import torchrun as sglang_torchrun
    from megatron_dapo.sglang.client import SGLangEngine
    from megatron_dapo.sglang.placement import EnginePlan
    from megatron_dapo.sglang.server import SGLangServer, SGLangServerConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    worker = ActorWorker({})
    script, fail_flag = tmp / "standin.py", tmp / "fail_at_start"
    local = {}
    if rank == 1:  # node1's LOCAL_RANK 0 launches the node's server, as launch_node_servers does
        port = free_port()
        scfg = SGLangServerConfig(
            model_path="unused", port=port, startup_timeout_s=60, log_file=str(tmp / "engine_1.log")
        )
        srv = SGLangServer(
            scfg, command=[sys.executable, str(script), "127.0.0.1", str(port), str(fail_flag)]
        )
        srv.poll_s = 0.2
        srv.start().wait_healthy()
        local = {1: SimpleNamespace(server=srv, name="sglang-1", close=lambda: None)}
    urls: list = [None, None]
    dist.all_gather_object(urls, local[1].server.cfg.url if local else None)
    url = urls[1]
    plan = EnginePlan(1, "node1", "127.0.0.1", (), int(url.rsplit(":", 1)[1]))
    servers = sglang_torchrun.NodeServers([plan], [url], local)
    if rank == 1:
        worker.node_servers = servers  # as megatron_dapo.train does after launch_node_servers
        try:
            SPMDRankGroup.follow(worker)
        finally:
            servers.stop()
        dist.destroy_process_group()  # as ActorWorker.shutdown does (a live gloo group can abort the exit)
        return

    ranks = SPMDRankGroup(worker)
    # the stand-in speaks no SGLang, but answers GET /health: the engine is a real SGLangEngine
    # (its real health check, a short health timeout) without the connect-time SGLang handshake
    stub = SGLangEngine(url, health_timeout_s=3)
    cfg = SimpleNamespace(
        actor=SimpleNamespace(routing_replay="none"),  # rank0_engines asks whether to request routed experts
        rollout=SimpleNamespace(
            sglang=SimpleNamespace(api_key=None, startup_timeout_s=60, health_timeout_s=3),
            tensor_parallel_size=1,
            request_timeout_s=30,
        ),
    )
    with mock.patch("megatron_dapo.sglang.torchrun.connect_sglang_engines", return_value=[stub]):
        (engine,) = sglang_torchrun.rank0_engines(cfg, servers, ranks)
    result: dict = {"rank1_pid": ranks.peers[1][1], "before": _get(url), "name": engine.name, "url": url}
    os.kill(result["before"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while _get(url) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    pool = EnginePool([engine])
    pool.mark_down(engine.name, "killed")
    result["revived"] = pool.restart_down()
    result["after"] = _get(url)

    result["error"] = result["hung"] = None
    if result["after"] is not None:
        # hung during the actor update: back in service (no request failed on it), then stopped
        pool.return_to_service([engine.name])
        stopped = result["after"]["pid"]
        os.killpg(stopped, signal.SIGSTOP)
        revived = pool.restart_down()
        why = pool.down.get(engine.name, "")
        result["hung"] = {"revived": revived, "why": why, "now": _get(url), "stopped_pid": stopped}
        result["hung"]["stopped_gone"] = not Path(f"/proc/{stopped}").exists()  # killed and reaped
    if result["hung"] is not None and result["hung"]["now"] is not None:
        # a server that cannot start again: one error naming the node, the URL and the log
        fail_flag.touch()
        os.kill(result["hung"]["now"]["pid"], signal.SIGKILL)
        try:
            pool.restart_down()
        except EngineError as e:
            result["error"] = str(e)
    ranks.shutdown()
    engine.close()
    (tmp / "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_another_nodes_dead_or_hung_server_is_restarted_by_its_node(tmp_path):
    from megatron_dapo.ports import free_port

    shutil.copy(STANDIN, tmp_path / "standin.py")
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE="2",
        LOCAL_RANK="0",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "rank", str(tmp_path)],
            env=dict(env, RANK=str(r), GROUP_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}:\n{out[-3000:]}"
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["before"]["ppid"] == res["rank1_pid"]
    assert res["revived"] == [res["name"]]
    # back, a new process, and a child of node1's rank (the one that started it), not of rank 0
    assert res["after"] is not None, "the dead server was not restarted"
    assert res["after"]["pid"] != res["before"]["pid"]
    assert res["after"]["ppid"] == res["rank1_pid"]
    # hung (SIGSTOP, port open) with no request on it: found by its health check, killed, restarted
    hung = res["hung"]
    assert hung is not None and hung["revived"] == [res["name"]], hung
    assert "GET /health" in hung["why"], hung
    assert hung["now"] is not None and hung["now"]["pid"] != hung["stopped_pid"], hung
    assert hung["now"]["ppid"] == res["rank1_pid"] and hung["stopped_gone"], hung
    err = res["error"]
    assert err is not None and "\n" not in err, err
    assert "node1" in err and res["url"] in err and "engine_1.log" in err, err


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    _rank_main(Path(sys.argv[2]))


def test_peer_server_alive_is_whether_its_port_accepts():
    import socket

    from megatron_dapo.sglang.placement import EnginePlan
    from megatron_dapo.sglang.torchrun import PeerServer

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        plan = EnginePlan(1, "node1", "127.0.0.1", (), port)
        server = PeerServer(None, plan, f"http://127.0.0.1:{port}", 60)
        assert server.alive()
    assert not server.alive()  # the port is closed now: a dead server refuses at once


def test_a_server_that_died_without_work_is_restarted_before_the_sync():
    # killed during the actor update: no request failed on it, so the manager did not mark it down
    # (before: the sync's first request to it failed and ended the run)
    from megatron_dapo.rollout.engine_pool import EnginePool

    class Server:
        def __init__(self, up):
            self.up, self.restarts = up, 0

        def alive(self):
            return self.up

        def restart(self):
            self.restarts += 1
            self.up = True

    def engine(name, server):  # /health answers while the server is up
        return SimpleNamespace(name=name, server=server, health=lambda check_process=True: server.up)

    dead = engine("sglang-1", Server(False))
    live = engine("sglang-0", Server(True))
    pool = EnginePool([live, dead])
    assert pool.restart_down() == ["sglang-1"]
    assert (dead.server.restarts, live.server.restarts) == (1, 0)
    assert pool.down == {"sglang-1": "its server is gone"}  # back in service only after the sync
