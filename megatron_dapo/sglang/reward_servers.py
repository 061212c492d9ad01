"""The SGLang servers a run starts for a served reward model (``reward.model.path``), kept alive.

They run on the driver's node, beside the rollout engines but apart from them: no weight sync
ever reaches them (they serve ``reward.model.path``, frozen), and the engine pool does not hold
them. On a CPU they take the CPU flags of the rollout servers. On GPUs (:func:`reward_gpu_groups`),
``reward.model.placement=own`` gives them the node's GPUs that neither the actor nor the rollout
engines use (``placement.engine_gpu_ids``), counted by ``megatron-dapo plan``; a node without
enough left refuses in one line (give ``reward.model.url`` to use a server placed elsewhere).
``colocated`` puts server i on the first GPUs of rollout engine i, in
``reward.model.mem_fraction_static`` of each.

A classifier is served from a corrected copy of its checkpoint (``rewards.served.checkpoint``:
SGLang's Qwen2/Qwen3 classification head has a bias the checkpoint lacks) and checked at start-up
against transformers (``rewards.served.startup_check``), after every restart too.

Supervision: a thread polls each server's process; a dead one is restarted (``SGLangServer
.restart``, health-waited) and the client is told (``mark_restarted``), so the samples scored
while it was down come back unscored, never 0, and the ones after score again. A server that
cannot be brought back keeps failing its requests until ``reward.model.down_grace_s``, when the
client stops the run with one line.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.config import ConfigError
from megatron_dapo.ports import free_port
from megatron_dapo.rewards.served import (
    ServedRewardSettings,
    check_classifier_server,
    prepare_served_checkpoint,
    server_specs,
)
from megatron_dapo.sglang.engines import CPU_SERVER_ARGS, cpu_server_env
from megatron_dapo.sglang.placement import engine_gpu_ids, local_actor_gpus
from megatron_dapo.sglang.server import SGLangServer, SGLangServerConfig

log = logging.getLogger(__name__)

_POLL_S = 2.0


class RewardServers:
    """The reward model's servers on this node; :meth:`launch` starts them, :meth:`stop` ends them."""

    def __init__(self, settings: ServedRewardSettings, servers: list[SGLangServer], probe_model: str | None):
        self.settings = settings
        self.servers = servers
        self.probe_model = probe_model  # the original checkpoint the start-up check compares with
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.restarts = 0

    @property
    def urls(self) -> list[str]:
        return [s.cfg.url for s in self.servers]

    @classmethod
    def launch(cls, cfg: Any, settings: ServedRewardSettings, run_root: str | Path) -> RewardServers:
        """Start ``reward.model.num_servers`` servers for ``reward.model.path`` and wait for them."""
        run_root = Path(run_root)
        probe = None
        served = settings.path
        if settings.kind == "classifier":
            copy = prepare_served_checkpoint(settings.path, run_root / "reward_model_served")
            served, probe = str(copy.path), str(settings.path)
        specs = server_specs(settings, served)
        cpu = torch.cuda.device_count() == 0
        gpus = [()] * len(specs) if cpu else reward_gpu_groups(cfg, settings, torch.cuda.device_count())
        # a colocated server takes its own share of an engine's GPU; on GPUs of its own, an engine's
        share = (
            settings.mem_fraction_static
            if settings.placement == "colocated"
            else float(cfg.rollout.sglang.mem_fraction_static)
        )
        configs = [
            SGLangServerConfig(
                model_path=spec.model_path,
                tp_size=spec.tp_size,
                host="127.0.0.1",
                port=free_port(),
                mem_fraction_static=0.05 if cpu else share,
                dtype="float32" if cpu else "auto",
                base_gpu_id=None if cpu else group[0],
                extra_args=(list(CPU_SERVER_ARGS) if cpu else []) + list(spec.extra_args),
                startup_timeout_s=float(cfg.rollout.sglang.startup_timeout_s),
                log_file=str(run_root / "sglang" / f"reward_{spec.index}.log"),
                env=cpu_server_env() if cpu else {},
                python=cfg.rollout.sglang.python,
            )
            for spec, group in zip(specs, gpus)
        ]
        (run_root / "sglang").mkdir(parents=True, exist_ok=True)
        servers: list[SGLangServer] = []
        try:
            for c in configs:
                log.info("starting reward server %s (%s, log %s)", c.url, settings.kind, c.log_file)
                servers.append(SGLangServer(c).start())
            for srv in servers:
                srv.wait_healthy()
            out = cls(settings, servers, probe)
            for srv in servers:
                out.check(srv)
            return out
        except BaseException:
            for srv in servers:
                srv.stop()
            raise

    def check(self, server: SGLangServer) -> None:
        """A classifier scores a probe text as transformers does (raises one line otherwise)."""
        if self.probe_model is not None:
            check_classifier_server(server.cfg.url, self.probe_model, timeout_s=self.settings.timeout_s)

    def watch(self, on_restart: Callable[[str], None]) -> None:
        """Restart any server that dies, from a daemon thread, and tell ``on_restart(url)``."""
        self._thread = threading.Thread(
            target=self._watch, args=(on_restart,), name="reward-servers", daemon=True
        )
        self._thread.start()

    def _watch(self, on_restart: Callable[[str], None]) -> None:
        while not self._stop.wait(_POLL_S):
            for srv in self.servers:
                if self._stop.is_set() or srv.alive():
                    continue
                log.error("reward server %s died (log %s); restarting it", srv.cfg.url, srv.cfg.log_file)
                try:
                    srv.restart()
                    srv.wait_healthy()
                    self.check(srv)
                except Exception as e:  # noqa: BLE001 - the client's down grace decides when the run stops
                    log.error("reward server %s did not come back: %s", srv.cfg.url, e)
                    continue
                self.restarts += 1
                on_restart(srv.cfg.url)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for srv in self.servers:
            srv.stop()


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
