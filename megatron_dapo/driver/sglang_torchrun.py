"""SGLang servers under torchrun: every node starts the engines the plan puts on it.

torchrun gives no driver that can start processes on other nodes, so each node's LOCAL_RANK 0
launches that node's servers (its GPUs, its ports, logs in RUN_DIR/sglang/engine_<i>.log) and
every rank learns every engine's URL through an all-gather over the trainer's world:

1. each rank contributes (node rank = torchrun's GROUP_RANK, node address, local rank, GPU count);
2. the plan is a pure function of those (`sglang_placement.plan_engines`; on CPUs engine i goes to
   node i mod nnodes, on a free port), so every rank computes the same plan;
3. LOCAL_RANK 0 of each node starts its plans, waits for them, and all ranks gather the URLs (or
   the launch error, so that a failed node stops every rank instead of leaving them in a collective).

Rank 0 connects to the other nodes' servers by URL; each node's launcher stops its own servers
when its rank ends (`NodeServers.stop`), after rank 0 has saved.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_dapo.driver.sglang_placement import EnginePlan, GpuSlot, plan_engines

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    """What one torchrun rank tells the others about where it runs."""

    node_rank: int
    node_ip: str
    local_rank: int
    gpus: int


def node_id(node_rank: int) -> str:
    return f"node{node_rank}"


def this_rank(gpus: int) -> RankInfo:
    """This process's node (torchrun's GROUP_RANK), address, local rank and GPU count."""
    ip = os.environ.get("MEGATRON_DAPO_NODE_IP") or socket.gethostbyname(socket.gethostname())
    return RankInfo(int(os.environ.get("GROUP_RANK", "0")), ip, int(os.environ.get("LOCAL_RANK", "0")), gpus)


def torchrun_plans(cfg, ranks: list[RankInfo], cpu: bool) -> list[EnginePlan]:
    """The run's engines from every rank's `RankInfo` (rank r at position r); pure arithmetic."""
    n = int(cfg.rollout.num_engines)
    ips = {node_id(r.node_rank): r.node_ip for r in ranks}
    if len(ips) == 1:  # one node: rollout.sglang.host, as before (127.0.0.1 unless set)
        ips = dict.fromkeys(ips, cfg.rollout.sglang.host)
    if cpu:
        nodes = sorted({r.node_rank for r in ranks})
        return [
            EnginePlan(i, node_id(nodes[i % len(nodes)]), ips[node_id(nodes[i % len(nodes)])], (), 0)
            for i in range(n)
        ]
    slots = [GpuSlot(node_id(r.node_rank), r.node_ip, r.local_rank) for r in ranks]
    node_gpus = {node_id(r.node_rank): r.gpus for r in ranks}
    return plan_engines(
        cfg.trainer.placement,
        slots,
        node_gpus,
        n,
        int(cfg.rollout.tensor_parallel_size),
        int(cfg.rollout.sglang.base_port),
        node_ips=ips,
    )


@dataclass
class NodeServers:
    """This node's launched servers (LOCAL_RANK 0 only) and the whole run's plans and URLs."""

    plans: list[EnginePlan]
    urls: list[str]
    local: dict[int, Any] = field(default_factory=dict)  # engine index -> SGLangEngine with .server

    def stop(self) -> None:
        from megatron_dapo.driver.sglang_engines import stop_sglang_engines

        stop_sglang_engines(list(self.local.values()))
        self.local.clear()


def launch_node_servers(cfg) -> NodeServers:
    """Collective over torchrun's world: this node's servers started, every engine's URL known."""
    import torch
    import torch.distributed as dist

    from megatron_dapo.actor.spawn import free_port
    from megatron_dapo.driver.sglang_engines import launch_sglang_engines, server_config

    cpu = torch.cuda.device_count() == 0
    # gloo carries Python objects whatever backend the trainer's world uses
    group = dist.new_group(backend="gloo")
    me = this_rank(torch.cuda.device_count())
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, me, group=group)
    error, local = None, {}
    plans = torchrun_plans(cfg, ranks, cpu)  # the same on every rank, so is any ConfigError
    mine = [p for p in plans if p.node_id == node_id(me.node_rank)]
    if me.local_rank == 0 and mine:
        log_dir = Path(cfg.trainer.runs_dir).resolve() / cfg.trainer.run_name / "sglang"
        configs = [
            server_config(cfg, p.index, p.gpus, log_dir, host=p.node_ip, port=p.port or free_port(), cpu=cpu)
            for p in mine
        ]
        log.warning(
            "node %d starts SGLang engines %s (logs in %s)", me.node_rank, [p.index for p in mine], log_dir
        )
        try:
            local = dict(zip((p.index for p in mine), launch_sglang_engines(cfg, configs)))
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = f"node {me.node_rank}: {e}"
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (error, {i: e.server.cfg.url for i, e in local.items()}), group=group)
    failures = [err for err, _ in reports if err]
    urls: dict[int, str] = {}
    for _, got in reports:
        urls.update(got)
    servers = NodeServers(plans, [urls.get(p.index, "") for p in plans], local)
    if failures or len(urls) != len(plans):
        servers.stop()
        from megatron_dapo.rollout.engine import EngineError

        raise EngineError("SGLang servers did not start: " + "; ".join(failures or ["missing URLs"]))
    return servers


def rank0_engines(cfg, servers: NodeServers) -> list:
    """Rank 0's engines in plan order: its own node's launched ones, the others connected by URL."""
    from megatron_dapo.driver.sglang_engines import connect_sglang_engines

    engines: list[Any] = []
    try:
        for p, url in zip(servers.plans, servers.urls):
            if p.index in servers.local:
                engine = servers.local[p.index]
            else:
                s = cfg.rollout.sglang
                (engine,) = connect_sglang_engines(
                    [url],
                    tp_size=len(p.gpus) or int(cfg.rollout.tensor_parallel_size),
                    api_key=s.api_key,
                    health_timeout_s=float(s.startup_timeout_s),
                    request_timeout_s=float(cfg.rollout.request_timeout_s),
                )
                engine.name = f"sglang-{p.index}@{url.split('//', 1)[-1]}"
            engine.plan = p
            engines.append(engine)
    except BaseException:
        for e in engines:
            if getattr(e, "server", None) is None:
                e.close()
        raise
    # rank 0's engine list now owns its node's servers (`stop_sglang_engines` ends them); an engine
    # closed twice would wait forever on its stopped event loop
    servers.local = {}
    return engines
