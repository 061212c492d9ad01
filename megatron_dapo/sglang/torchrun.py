"""SGLang servers under torchrun: every node starts the engines the plan puts on it.

torchrun gives no driver that can start processes on other nodes, so each node's LOCAL_RANK 0
launches that node's servers (its GPUs, its ports, logs in RUN_DIR/sglang/engine_<i>.log) and
every rank learns every engine's URL through an all-gather over the trainer's world:

1. each rank contributes (node rank = torchrun's GROUP_RANK, node address, local rank, GPU count);
2. the plan is a pure function of those (`sglang.placement.plan_engines`; on CPUs engine i goes to
   node i mod nnodes, on a free port), so every rank computes the same plan;
3. LOCAL_RANK 0 of each node starts its plans, waits for them, and all ranks gather the URLs (or
   the launch error, so that a failed node stops every rank instead of leaving them in a collective).

Rank 0 connects to the other nodes' servers by URL; each node's launcher stops its own servers
when its rank ends (`NodeServers.stop`), after rank 0 has saved.

A server is the child of the process that started it (it dies with it, it runs on that node's
GPUs), so only that process can restart it. When one of another node's servers dies, rank 0's
engine holds a `PeerServer`: its `restart()` is a rank call (`ActorWorker.restart_node_server`)
that every rank runs and only the owning node's LOCAL_RANK 0 acts on (`NodeServers.restart`),
so the engine is restarted there and then resynced like one of rank 0's own node's servers
(rollout/engine_pool.py). The call is bounded like every rank call (the watchdog ends the job
with one line if the node does not answer).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from megatron_dapo.config import ConfigError
from megatron_dapo.ports import free_port
from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.sglang.engines import (
    connect_sglang_engines,
    launch_sglang_engines,
    routed_experts_shape,
    server_config,
    stop_sglang_engines,
)
from megatron_dapo.sglang.placement import EnginePlan, GpuSlot, plan_engines

log = logging.getLogger(__name__)


NODE_IP_ENV = "MEGATRON_DAPO_NODE_IP"


@dataclass(frozen=True)
class RankInfo:
    """What one torchrun rank tells the others about where it runs.

    `ip_from` says where `node_ip` came from (the env variable, or how it was guessed), so that a
    guessed loopback address on a multi-node run is refused naming its origin."""

    node_rank: int
    node_ip: str
    local_rank: int
    gpus: int
    ip_from: str = NODE_IP_ENV


def node_id(node_rank: int) -> str:
    return f"node{node_rank}"


def route_address(host: str) -> str | None:
    """This machine's address on the route to `host` (a UDP connect sends nothing); None if unknown."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:  # a host name given in the env variable: taken as it is
        return False


def node_address() -> tuple[str, str]:
    """(address the other nodes reach this node at, where it came from).

    MEGATRON_DAPO_NODE_IP if set; else the source address of the route to MASTER_ADDR (the node
    that every other node already reaches, so the interface they share); else the host name's
    address. On multi-NIC nodes the host name can resolve to the wrong interface or to 127.x."""
    explicit = os.environ.get(NODE_IP_ENV)
    if explicit:
        return explicit, NODE_IP_ENV
    master = os.environ.get("MASTER_ADDR")
    routed = route_address(master) if master else None
    if routed and not _loopback(routed):
        return routed, f"the route to MASTER_ADDR={master}"
    host = socket.gethostname()
    return socket.gethostbyname(host), f"the address of host name {host}"


def this_rank(gpus: int) -> RankInfo:
    """This process's node (torchrun's GROUP_RANK), address, local rank and GPU count."""
    ip, source = node_address()
    return RankInfo(
        int(os.environ.get("GROUP_RANK", "0")), ip, int(os.environ.get("LOCAL_RANK", "0")), gpus, source
    )


def check_node_addresses(ranks: list[RankInfo]) -> None:
    """Several nodes: a guessed loopback address would give the other nodes URLs that point at
    themselves. Pure, so every rank raises the same ConfigError."""
    if len({r.node_rank for r in ranks}) < 2:
        return
    for r in ranks:
        if r.ip_from != NODE_IP_ENV and _loopback(r.node_ip):
            raise ConfigError(
                f"node {r.node_rank}'s address is {r.node_ip} (from {r.ip_from}), a loopback address the "
                f"other nodes cannot reach its SGLang servers at; set {NODE_IP_ENV} on every node to the "
                "address of its interface that the other nodes reach (e.g. from `ip -4 addr`)"
            )


def torchrun_plans(cfg, ranks: list[RankInfo], cpu: bool) -> list[EnginePlan]:
    """The run's engines from every rank's `RankInfo` (rank r at position r); pure arithmetic."""
    check_node_addresses(ranks)
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

    def restart(self, index: int) -> tuple[bool, Any] | None:
        """Restart engine `index` if this process started it: (True, new pid) or (False, why);
        None when it is not ours. A failure is returned, not raised, so that rank 0 ends the run
        naming the node and the server instead of this rank dying inside the call."""
        engine = self.local.get(index)
        if engine is None:
            return None
        server = engine.server
        log.warning("restarting SGLang engine %d (%s), which this node started", index, server.cfg.url)
        try:
            return True, server.restart()
        except Exception as e:  # noqa: BLE001 - reported by rank 0
            return False, str(e)

    def stop(self) -> None:
        stop_sglang_engines(list(self.local.values()))
        self.local.clear()


def launch_node_servers(cfg) -> NodeServers:
    """Collective over torchrun's world: this node's servers started, every engine's URL known."""
    import torch
    import torch.distributed as dist

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
        raise EngineError("SGLang servers did not start: " + "; ".join(failures or ["missing URLs"]))
    return servers


class PeerServer:
    """Rank 0's handle on a server that another node's LOCAL_RANK 0 started (an engine's `server`)."""

    def __init__(self, ranks: Any, plan: EnginePlan, url: str, timeout_s: float):
        self.ranks = ranks
        self.plan = plan
        self.url = url
        self.timeout_s = timeout_s

    @property
    def where(self) -> str:
        return f"SGLang engine {self.plan.index} on {self.plan.node_id} ({self.url})"

    def alive(self) -> bool:
        """Its port accepts a connection (the process is on another node: a dead server's port
        refuses at once; a hung one still accepts, and fails the engine's `health()` instead)."""
        parsed = urlparse(self.url)
        try:
            with socket.create_connection((parsed.hostname, parsed.port), timeout=10):
                return True
        except ConnectionRefusedError:
            return False
        except OSError:  # a slow or unreachable network is not a dead server
            return True

    def restart(self) -> int:
        """The owning node restarts it and waits until it is healthy; its new pid there."""
        results = self.ranks.call(
            "restart_node_server",
            self.plan.index,
            timeout_s=self.timeout_s,
            timeout_note=f"(restarting {self.where}; rollout.sglang.startup_timeout_s bounds it)",
        )
        done = [r for r in results if r is not None]
        if not done:
            raise EngineError(
                f"{self.where} is down and no rank owns it to restart it "
                f"(its node's LOCAL_RANK 0 launched nothing?); resume from the last checkpoint"
            )
        ok, detail = done[0]
        if not ok:
            first = str(detail).splitlines()[0] if str(detail) else "unknown error"
            raise EngineError(
                f"{self.where} died and its node could not restart it: {first} "
                f"(see RUN_DIR/sglang/engine_{self.plan.index}.log on {self.plan.node_id}); "
                "fix that node and resume from the last checkpoint"
            )
        return int(detail)

    def stop(self) -> None:
        """Nothing: the node that started it stops it when its rank ends (`NodeServers.stop`)."""


def rank0_engines(cfg, servers: NodeServers, ranks: Any = None) -> list:
    """Rank 0's engines in plan order: its own node's launched ones, the others connected by URL
    (with a `PeerServer` through which their node restarts them, when `ranks` is given)."""
    shape = routed_experts_shape(cfg)
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
                    answer_timeout_s=float(s.health_timeout_s),
                    routed_experts_shape=shape,
                )
                engine.name = f"sglang-{p.index}@{url.split('//', 1)[-1]}"
                client = getattr(engine, "client", None)
                if client is not None:  # its errors name the engine by its plan index too
                    client.name = engine.name
                if ranks is not None:
                    engine.server = PeerServer(ranks, p, url, float(s.startup_timeout_s) + 120)
            engine.plan = p
            engines.append(engine)
    except BaseException:
        for e in engines:
            if e.plan.index not in servers.local:  # connected here; launched ones stop with the node
                e.close()
        raise
    # rank 0's engine list now owns its node's servers (`stop_sglang_engines` ends them); an engine
    # closed twice would wait forever on its stopped event loop
    servers.local = {}
    return engines
