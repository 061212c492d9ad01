"""Per-node launch of SGLang servers under Ray: one `SGLangNodeHost` actor on every node of the plan.

The driver cannot start processes on other nodes, so each node that the engine plan
(`sglang.placement.plan_engines`) uses gets a small Ray actor pinned there (hard node affinity,
no CPUs or GPUs of its own: the servers' GPUs belong to the plan, not to Ray). It starts that node's
servers as its children, waits for them to be healthy, and later stops or restarts one of them.
The driver talks to the servers over HTTP and reaches the actor only through
`RemoteServer` (the engine's `server` attribute), so the rest of the code does not know where a
server runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_dapo.ports import free_port
from megatron_dapo.sglang.server import SGLangServer

log = logging.getLogger(__name__)


class SGLangNodeHost:
    """Ray actor: launches and supervises one node's servers (`SGLangServer` children).

    Args:
        configs: one `SGLangServerConfig` per server on this node.
        commands: argv per server instead of `python -m sglang.launch_server` (tests: a stand-in).
    """

    def __init__(self, configs: Sequence[Any], commands: Sequence[list[str]] | None = None):
        # The plan counts GPUs by their index on the node (--base-gpu-id); a mask that Ray may have
        # set for this GPU-less actor would shift or hide them.
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)

        for c in configs:
            if not c.port:  # port 0: a free one on this node
                c.port = free_port()
        commands = list(commands) if commands is not None else [None] * len(configs)
        self.servers = [SGLangServer(c, command=cmd) for c, cmd in zip(configs, commands)]

    def where(self) -> tuple[str, str]:
        """(Ray node id, node address) of this actor, so of its servers."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def urls(self) -> list[str]:
        return [s.cfg.url for s in self.servers]

    def start(self) -> list[int]:
        """Start every server (weights load in parallel), wait until all are healthy; their pids."""
        for s in self.servers:
            Path(s.log_path).parent.mkdir(parents=True, exist_ok=True)
            s.start()
        try:
            for s in self.servers:
                s.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return [s.proc.pid for s in self.servers]

    def alive(self, i: int) -> bool:
        return self.servers[i].alive()

    def pid(self, i: int) -> int | None:
        proc = self.servers[i].proc
        return None if proc is None else proc.pid

    def restart(self, i: int) -> int:
        """Kill server i if it still runs (dead or hung: no grace), start it again, wait until
        healthy; its new pid."""
        return self.servers[i].restart()

    def stop_one(self, i: int) -> None:
        self.servers[i].stop()

    def stop(self) -> None:
        for s in self.servers:
            try:
                s.stop()
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                log.warning("stopping %s: %s", s.name, e)


class RemoteServer:
    """The driver's handle on one server that an `SGLangNodeHost` runs (what `engine.server` holds)."""

    def __init__(self, host: Any, index: int, name: str, timeout_s: float, url: str = ""):
        self.host = host
        self.index = index
        self.name = name
        self.timeout_s = timeout_s
        self.url = url

    def _get(self, ref, timeout_s: float | None = None):
        import ray

        return ray.get(ref, timeout=timeout_s or self.timeout_s)

    def alive(self) -> bool:
        try:
            return bool(self._get(self.host.alive.remote(self.index), 60))
        except Exception:  # noqa: BLE001 - a lost node host means a lost server
            return False

    def restart(self) -> int:
        return self._get(self.host.restart.remote(self.index))

    def stop(self) -> None:
        try:
            self._get(self.host.stop_one.remote(self.index), 120)
        except Exception as e:  # noqa: BLE001 - the node (and its servers) may already be gone
            log.warning("stopping %s: %s", self.name, e)


def launch_on_nodes(
    plans: Sequence[Any],
    configs: Sequence[Any],
    *,
    startup_timeout_s: float,
    commands: Sequence[list[str]] | None = None,
) -> tuple[list[Any], list[RemoteServer]]:
    """Start plan i's server (config i) on plan i's node; (node hosts, one RemoteServer per plan).

    Every node's servers start together; if one fails, every host is stopped and the error names
    the server and carries its log tail.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    by_node: dict[str, list[int]] = {}
    for i, p in enumerate(plans):
        by_node.setdefault(p.node_id, []).append(i)
    host_cls = ray.remote(SGLangNodeHost)
    hosts, servers = [], [None] * len(plans)
    try:
        for node, idx in by_node.items():
            host = host_cls.options(
                num_cpus=0,
                max_concurrency=4,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            ).remote([configs[i] for i in idx], None if commands is None else [commands[i] for i in idx])
            hosts.append(host)
            urls = ray.get(host.urls.remote(), timeout=startup_timeout_s)
            for k, i in enumerate(idx):
                where = urls[k].split("://", 1)[-1]
                servers[i] = RemoteServer(host, k, f"sglang-{i}@{where}", startup_timeout_s, urls[k])
        ray.get([h.start.remote() for h in hosts], timeout=startup_timeout_s + 60)
    except BaseException:
        stop_node_hosts(hosts)
        raise
    return hosts, servers


def stop_node_hosts(hosts: Sequence[Any]) -> None:
    """Stop every host's servers, then the hosts (best effort)."""
    import ray

    for h in hosts:
        try:
            ray.get(h.stop.remote(), timeout=120)
        except Exception as e:  # noqa: BLE001 - keep stopping the others
            log.warning("stopping an SGLang node host: %s", e)
        ray.kill(h, no_restart=True)
