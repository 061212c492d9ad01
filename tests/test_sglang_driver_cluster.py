"""Multi-node behaviour on one machine: a Ray cluster of three raylets (`ray.cluster_utils.Cluster`).

- trainer ranks take bundles by node (then GPU), whatever order Ray numbered them in;
- engine servers start on every node of the plan, each as the child of a host actor on that node,
  and one can be restarted there.
Servers are stand-ins (a tiny HTTP server answering /health_generate) so the test needs no sglang.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import httpx
import pytest
import ray  # a hard dependency: a missing Ray fails the suite instead of skipping it
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

from megatron_dapo.config import load_config
from megatron_dapo.driver.rank_group import RayRankGroup, bundle_slots
from megatron_dapo.ports import free_port
from megatron_dapo.sglang.placement import GpuSlot, plan_engines, rank_order

NODES = 3

STANDIN = Path(__file__).with_name("standin_http_server.py")


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"fake_gpu": 4, "node0": 4}, "include_dashboard": False},
    )
    for n in range(1, NODES):  # a resource per node lets a test pin bundles to nodes
        c.add_node(num_cpus=1, resources={"fake_gpu": 4, f"node{n}": 4})
    c.wait_for_nodes()
    # workers import this module (the rank class below) by name
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    ray.init(address=c.address, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": path}})
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


class Where:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def test_ranks_are_grouped_by_node_not_by_bundle_index(cluster):
    # bundles numbered round-robin over the nodes: bundle b on node b % 3
    bundles = [{"CPU": 0.1, "fake_gpu": 1, f"node{b % NODES}": 1} for b in range(2 * NODES)]
    pg = placement_group(bundles, strategy="SPREAD")
    ray.get(pg.ready(), timeout=120)
    try:
        slots = bundle_slots(pg, 2 * NODES)
        assert len({s.node_id for s in slots}) == NODES
        assert [s.node_id for s in slots[:NODES]] == [s.node_id for s in slots[NODES:]]  # interleaved
        order = rank_order(slots)
        group = RayRankGroup(Where, 2 * NODES, placement_group=pg, bundles=order, num_cpus_per_rank=0.1)
        try:
            nodes = group.call("node", timeout_s=120)
        finally:
            group.shutdown()
        assert nodes == [slots[b].node_id for b in order]
        # each node's ranks are consecutive: 0-1 on one node, 2-3 on the next, 4-5 on the last
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3] != nodes[4] == nodes[5] and nodes[0] != nodes[4]
    finally:
        remove_placement_group(pg)


def test_engines_start_on_every_node_and_restart_there(cluster, tmp_path):
    from megatron_dapo.sglang.engines import launch_planned_engines, stop_sglang_engines

    nodes = [n for n in ray.nodes() if n["Alive"]]
    # two trainer ranks per node on GPUs 0-1; one colocated TP2 engine per node
    actor = [GpuSlot(n["NodeID"], n["NodeManagerAddress"], g) for n in nodes for g in (0, 1)]
    plans = plan_engines("colocated", actor, {n["NodeID"]: 4 for n in nodes}, NODES, 2, 0)
    ports = [free_port() for _ in plans]
    plans = [
        type(p)(p.index, p.node_id, p.node_ip, p.gpus, ports[i], p.ipc_ranks) for i, p in enumerate(plans)
    ]
    script = tmp_path / "standin.py"
    shutil.copy(STANDIN, script)
    cfg = load_config(None, ["model.path=/models/none", "rollout.sglang.startup_timeout_s=120"])
    commands = [[sys.executable, str(script), p.node_ip, str(p.port)] for p in plans]
    engines = launch_planned_engines(cfg, plans, tmp_path / "logs", commands=commands)
    try:
        assert sorted(e.plan.node_id for e in engines) == sorted(n["NodeID"] for n in nodes)  # one per node
        for e, p in zip(engines, plans):
            host = e.server.host
            node, _ = ray.get(host.where.remote())
            assert node == p.node_id  # the server's host actor runs on the engine's node
            info = httpx.get(p.url + "/get_server_info", timeout=30).json()
            assert info["ppid"] == ray.get(host.__ray_call__.remote(lambda self: os.getpid()))
            mine = tuple(r for r, s in enumerate(actor) if s.node_id == p.node_id and s.gpu in p.gpus)
            assert e.plan.ipc_ranks == mine and len(mine) == 2  # the trainer ranks on its own GPUs
        # a server killed on its node comes back there, on the same address
        victim = engines[1]
        old = httpx.get(victim.plan.url + "/get_server_info", timeout=30).json()["pid"]
        os.kill(old, 9)
        new = victim.server.restart()
        assert new != old and victim.server.alive()
        assert httpx.get(victim.plan.url + "/get_server_info", timeout=30).json()["pid"] == new
    finally:
        stop_sglang_engines(engines)
    assert not any(e.server.alive() for e in engines)


def test_reward_servers_start_on_their_planned_nodes_and_restart_there(cluster, tmp_path):
    """reward.model.placement=own on a 3-node cluster whose GPUs 0-1 hold the trainer ranks and a
    colocated TP2 engine: a TP2 judge server on GPUs 2-3 of every node, each the child of a host
    actor on its node; one killed there is restarted there by the supervision thread, which
    tells the client its URL."""
    import threading
    from dataclasses import replace

    from megatron_dapo.rewards.served import settings_from_config
    from megatron_dapo.sglang.placement import plan_reward_servers
    from megatron_dapo.sglang.reward_servers import RewardServers

    nodes = [n for n in ray.nodes() if n["Alive"]]
    gpus = {n["NodeID"]: 4 for n in nodes}
    actor = [GpuSlot(n["NodeID"], n["NodeManagerAddress"], g) for n in nodes for g in (0, 1)]
    engines = plan_engines("colocated", actor, gpus, NODES, 2, 0)
    plans = plan_reward_servers("own", actor, gpus, engines, NODES, 2)
    assert [(p.node_id, p.gpus) for p in plans] == [(e.node_id, (2, 3)) for e in engines]
    plans = [replace(p, port=free_port()) for p in plans]
    judge = tmp_path / "judge"
    judge.mkdir()
    cfg = load_config(
        None,
        [
            "model.path=/models/none",
            "rollout.sglang.startup_timeout_s=120",
            "reward.model.kind=judge",
            f"reward.model.path={judge}",
            f"reward.model.num_servers={NODES}",
            "reward.model.gpus_per_server=2",
        ],
    )
    script = tmp_path / "standin.py"
    shutil.copy(STANDIN, script)
    commands = [[sys.executable, str(script), p.node_ip, str(p.port)] for p in plans]
    servers = RewardServers.launch(cfg, settings_from_config(cfg.reward), tmp_path / "run", plans, commands)
    restarted, told = [], threading.Event()
    try:
        assert servers.urls == [p.url for p in plans]
        for srv, p in zip(servers.servers, plans):
            node, _ = ray.get(srv.process.host.where.remote())
            assert node == p.node_id

        class Events:
            def supervised(self):
                pass

            def server_down(self, url):
                pass

            def server_back(self, url):
                restarted.append(url)
                told.set()

            def server_lost(self, message):
                raise AssertionError(message)

        servers.watch(Events())
        victim = plans[2]
        old = httpx.get(victim.url + "/get_server_info", timeout=30).json()["pid"]
        os.kill(old, 9)
        assert told.wait(60), "the dead reward server was not restarted"
        assert restarted == [victim.url] and servers.restarts == 1
        assert httpx.get(victim.url + "/get_server_info", timeout=30).json()["pid"] != old
    finally:
        servers.stop()
    assert not any(srv.process.alive() for srv in servers.servers)
