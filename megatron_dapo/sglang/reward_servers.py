"""The SGLang servers a run starts for a served reward model (``reward.model.path``), kept alive.

They run beside the rollout engines but apart from them: no weight sync ever reaches them (they
serve ``reward.model.path``, frozen), and the engine pool does not hold them. Where:

- under the Ray driver, on the cluster (``placement.plan_reward_servers``): each server on its
  plan's node through that node's ``SGLangNodeHost`` (``node_host.launch_on_nodes``, as the
  rollout engines), ``reward.model.placement=own`` on GPUs no trainer rank and no engine uses,
  node by node, ``colocated`` on the first GPUs of rollout engine i in
  ``reward.model.mem_fraction_static`` of each; on a CPU cluster, on the driver's node;
- under torchrun, on the driver's node (:func:`reward_gpu_groups`: the same two choices among
  that node's GPUs).

Either way the plan is counted by ``megatron-dapo plan``, and a cluster or node without room
refuses in one line (give ``reward.model.url`` to use a server placed elsewhere). On a CPU the
servers take the CPU flags of the rollout servers.

A classifier is served from a corrected copy of its checkpoint (``rewards.served.checkpoint``:
SGLang's Qwen2/Qwen3 classification head has a bias the checkpoint lacks) and checked at start-up
against transformers (``rewards.served.startup_check``), after every restart too.

Supervision: a thread polls each server's process (on another node, through its host); a dead
one is restarted there (``SGLangServer.restart``, health-waited) and probed again. While it is
down the client sends it nothing (``server_down``); once it answers and passes the probe the
client is told (``server_back``), so the samples scored while it was down come back unscored,
never 0, and the ones after score again. A server that fails its probe after a restart is
stopped (it must not serve a wrong score) and restarted at the next poll. Each server gets
``reward.model.max_restarts`` restarts; when it dies once more the client is told
(``server_lost``) and the run stops with one line naming the server, its log and its restarts
(``reward/server_restarts`` counts them step by step). A server that never comes back within
the cap stops the run at ``reward.model.down_grace_s`` at the latest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from megatron_dapo.config import ConfigError
from megatron_dapo.ports import free_port
from megatron_dapo.rewards.served import (
    ServedRewardSettings,
    check_classifier_server,
    prepare_served_checkpoint,
    probe_tolerance,
    server_specs,
)
from megatron_dapo.sglang.engines import CPU_MEM_FRACTION, CPU_SERVER_ARGS, cpu_server_env
from megatron_dapo.sglang.node_host import launch_on_nodes, stop_node_hosts
from megatron_dapo.sglang.placement import EnginePlan, engine_gpu_ids, local_actor_gpus
from megatron_dapo.sglang.server import SGLangServer, SGLangServerConfig

log = logging.getLogger(__name__)

_POLL_S = 2.0


class Supervised(Protocol):
    """A reward server's process as supervision sees it: ``SGLangServer`` on this node, or a node
    host's ``RemoteServer`` on another."""

    def alive(self) -> bool: ...

    def restart(self) -> int: ...  # kill if running, start again, wait until healthy

    def stop(self) -> None: ...


class ServerEvents(Protocol):
    """What supervision tells the reward model's client (``BlockingRewardModel``)."""

    def supervised(self) -> None: ...  # dead servers are restarted: wait for them, not fail

    def server_down(self, url: str) -> None: ...  # being restarted: send it nothing

    def server_back(self, url: str) -> None: ...  # restarted and probed: send it work again

    def server_lost(self, message: str) -> None: ...  # past reward.model.max_restarts: stop the run


@dataclass
class RewardServer:
    """One reward server: where the client reaches it, its log, its process, and how often it
    was restarted."""

    url: str
    log_file: str
    process: Supervised
    restarts: int = 0


class RewardServers:
    """The reward model's servers; :meth:`launch` starts them, :meth:`stop` ends them."""

    def __init__(
        self,
        settings: ServedRewardSettings,
        servers: list[RewardServer],
        probe_model: str | None,
        hosts: Sequence[Any] = (),
        dtype: str = "float32",
    ):
        self.settings = settings
        self.servers = servers
        self.probe_model = probe_model  # the original checkpoint the start-up check compares with
        self.hosts = list(hosts)  # the Ray node hosts that run them (launched on planned nodes)
        self.dtype = dtype  # their --dtype: the probe's tolerance follows it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.restarts = 0  # over every server, the run so far
        self._reference: list[list[float]] | None = None  # transformers' probe scores (check)
        self.poll_s = _POLL_S

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @classmethod
    def launch(
        cls,
        cfg: Any,
        settings: ServedRewardSettings,
        run_root: str | Path,
        plans: Sequence[EnginePlan] | None = None,
        commands: Sequence[list[str]] | None = None,
        *,
        alone: bool = False,
        max_total_tokens: int | None = None,
    ) -> RewardServers:
        """Start ``reward.model.num_servers`` servers for ``reward.model.path``, wait for them and
        probe each (a classifier against transformers): on this node (torchrun), or each on its
        plan's node and GPUs through a Ray node host (``plan_reward_servers``; on a CPU cluster,
        this node without GPUs). ``commands``: argv per planned server instead of SGLang's
        (tests: a stand-in).

        ``alone`` (``megatron-dapo eval``, once the policy's server has stopped): the machine's
        GPUs are the reward servers' own, server i on GPUs ``i*gpus_per_server...``, each taking
        most of their memory; ``max_total_tokens`` sizes a CPU server's KV pool by the longest
        request it gets rather than a share of the host's memory."""
        run_root = Path(run_root)
        probe = None
        served = settings.path
        if settings.kind == "classifier":
            copy = prepare_served_checkpoint(settings.path, run_root / "reward_model_served")
            served, probe = str(copy.path), str(settings.path)
        specs = server_specs(settings, served)
        (run_root / "sglang").mkdir(parents=True, exist_ok=True)
        if plans is not None:
            cpu = all(not p.gpus for p in plans)
            gpus = [list(p.gpus) for p in plans]
            hosts = [p.node_ip for p in plans]
            ports = [p.port for p in plans]
        else:
            cpu = torch.cuda.device_count() == 0
            if cpu:
                gpus = [[]] * len(specs)
            elif alone:
                tp = settings.gpus_per_server
                gpus = [list(range(i * tp, (i + 1) * tp)) for i in range(len(specs))]
            else:
                gpus = reward_gpu_groups(cfg, settings, torch.cuda.device_count())
            hosts = ["127.0.0.1"] * len(specs)
            ports = [free_port() for _ in specs]
        # a colocated server takes its own share of an engine's GPU; on GPUs of its own, an
        # engine's; alone on the machine, most of it
        share = (
            0.7
            if alone
            else settings.mem_fraction_static
            if settings.placement == "colocated"
            else float(cfg.rollout.sglang.mem_fraction_static)
        )
        dtype = "float32" if cpu else "auto"
        configs = [
            SGLangServerConfig(
                model_path=spec.model_path,
                tp_size=spec.tp_size,
                host=host,
                # a planned server's port 0 is a free one on its own node (its host picks it)
                port=port,
                # on a CPU without max_total_tokens the fraction sizes the KV pool: kept small
                mem_fraction_static=(CPU_MEM_FRACTION if max_total_tokens else 0.05) if cpu else share,
                dtype=dtype,
                base_gpu_id=group[0] if group else None,
                extra_args=(list(CPU_SERVER_ARGS) if cpu else []) + list(spec.extra_args),
                startup_timeout_s=float(cfg.rollout.sglang.startup_timeout_s),
                log_file=str(run_root / "sglang" / f"reward_{spec.index}.log"),
                env=cpu_server_env() if cpu else {},
                python=cfg.rollout.sglang.python,
                max_total_tokens=max_total_tokens if cpu else None,
            )
            for spec, group, host, port in zip(specs, gpus, hosts, ports)
        ]
        for c in configs:
            log.info("starting reward server on %s (%s, log %s)", c.host, settings.kind, c.log_file)
        if plans is not None:
            node_hosts, remote = launch_on_nodes(
                plans,
                configs,
                startup_timeout_s=float(cfg.rollout.sglang.startup_timeout_s),
                commands=commands,
            )
            servers = [RewardServer(r.url, c.log_file, r) for r, c in zip(remote, configs)]
            return cls._checked(settings, servers, probe, node_hosts, dtype)
        local: list[SGLangServer] = []
        try:
            for c in configs:
                local.append(SGLangServer(c).start())
            for srv in local:
                srv.wait_healthy()
        except BaseException:
            for srv in local:
                srv.stop()
            raise
        servers = [RewardServer(srv.cfg.url, srv.cfg.log_file, srv) for srv in local]
        return cls._checked(settings, servers, probe, (), dtype)

    @classmethod
    def _checked(cls, settings, servers, probe, node_hosts, dtype) -> RewardServers:
        out = cls(settings, servers, probe, node_hosts, dtype)
        try:
            for srv in servers:
                out.check(srv)
        except BaseException:
            out.stop()
            raise
        return out

    def check(self, server: RewardServer) -> None:
        """A classifier scores the probe texts as transformers does, within the tolerance of the
        server's precision (raises one line otherwise)."""
        if self.probe_model is not None:
            tolerance = probe_tolerance(self.probe_model, self.dtype, self.settings.probe_tolerance)
            # transformers' side once per run: a restart is probed without loading the model again
            check = check_classifier_server(
                server.url,
                self.probe_model,
                tolerance=tolerance,
                timeout_s=self.settings.timeout_s,
                reference=self._reference,
            )
            self._reference = check.reference_logits

    def watch(self, client: ServerEvents) -> None:
        """Restart any server that dies, from a daemon thread, telling ``client`` (see the module)."""
        client.supervised()
        self._thread = threading.Thread(
            target=self._watch, args=(client,), name="reward-servers", daemon=True
        )
        self._thread.start()

    def _watch(self, client: ServerEvents) -> None:
        while not self._stop.wait(self.poll_s):
            if not self.poll(client):
                return

    def poll(self, client: ServerEvents) -> bool:
        """One look at every server: restart the dead ones. False once one is past its cap (the
        client was told to stop the run; watching ends)."""
        for srv in self.servers:
            if self._stop.is_set():
                return True
            if srv.process.alive():
                continue
            if srv.restarts >= self.settings.max_restarts:
                message = (
                    f"reward server {srv.url} died again after {srv.restarts} restarts "
                    f"(reward.model.max_restarts={self.settings.max_restarts}; its log: {srv.log_file}); "
                    "the run stops rather than train on a reward that is mostly missing: read the log (a "
                    "server that dies under load is often out of memory: lower reward.model.max_in_flight), "
                    "or raise reward.model.max_restarts"
                )
                log.info(message)  # the run's failure line says it on the console
                client.server_lost(message)
                return False
            srv.restarts += 1
            self.restarts += 1
            client.server_down(srv.url)
            log.error(
                "reward server %s died (log %s); restarting it (restart %d of reward.model.max_restarts=%d)",
                srv.url,
                srv.log_file,
                srv.restarts,
                self.settings.max_restarts,
            )
            try:
                srv.process.restart()  # waits until it is healthy again
                self.check(srv)
            except Exception as e:  # noqa: BLE001 - it is stopped and counts as dead: the cap decides
                log.error(
                    "reward server %s did not come back (%s); it is stopped and restarted again", srv.url, e
                )
                srv.process.stop()  # a server that fails its probe must not serve wrong scores
                continue
            client.server_back(srv.url)
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for srv in self.servers:
            srv.process.stop()
        if self.hosts:
            stop_node_hosts(self.hosts)


def reward_gpu_groups(cfg: Any, settings: ServedRewardSettings, total: int) -> list[list[int]]:
    """Each reward server's GPUs on this node of ``total``: with ``placement=own``, GPUs that
    neither the actor nor the rollout engines use, in server-sized runs; with ``colocated``, the
    first ``gpus_per_server`` GPUs of rollout engine i for server i."""
    actor = local_actor_gpus(int(cfg.parallel.actor_world_size), total)
    engines = engine_gpu_ids(
        cfg.trainer.placement,
        actor,
        total,
        int(cfg.rollout.num_engines),
        int(cfg.rollout.tensor_parallel_size),
    )
    tp, n = settings.gpus_per_server, settings.num_servers
    if settings.placement == "colocated":  # the config checked n <= engines, tp <= engine TP
        return [list(group[:tp]) for group in engines[:n]]
    used = set(actor) | {g for group in engines for g in group}
    free = [g for g in range(total) if g not in used]
    groups = [free[i * tp : (i + 1) * tp] for i in range(n)]
    if len(free) < n * tp or any(g != list(range(g[0], g[0] + tp)) for g in groups):
        raise ConfigError(
            f"reward.model.num_servers={n} x gpus_per_server={tp} needs {n * tp} consecutive free GPUs on this "
            f"node, but the actor and the rollout engines leave {free}; lower them, share the engines' GPUs "
            "(reward.model.placement=colocated), or serve the reward model elsewhere and give reward.model.url"
        )
    return groups
