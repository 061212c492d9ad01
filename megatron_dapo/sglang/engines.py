"""SGLang rollout engines for the driver: connect to running servers, or launch them.

`start_sglang_engines(cfg)` returns one `SGLangEngine` (HTTP client) per server:
- `rollout.sglang.urls` given: connect to those servers (started by `launch/start_sglang_servers.sh`
  or by hand), each health-checked until `rollout.sglang.startup_timeout_s`.
- otherwise, without Ray (`start_sglang_engines`): launch `rollout.num_engines` servers on this node
  (`python -m sglang.launch_server`, ports `base_port + i`, logs in RUN_DIR/sglang/) on the GPUs
  that `sglang.placement.engine_gpu_ids` picks. The actor's GPUs on this node are
  0..LOCAL_WORLD_SIZE-1. Without GPUs: CPU servers on free ports (SGLang's CPU flags).
  torchrun's `megatron_dapo.train` instead starts every node's servers (`sglang.torchrun`).
- under Ray, `launch_on_nodes` starts every node's servers from an `SGLangNodeHost` actor pinned to
  that node, as `sglang.placement.plan_engines` planned them.
With `actor.routing_replay: rollout` every server launched here gets SGLang's routed-experts flag
and every engine's client asks for and parses the experts, shaped by `routed_experts_shape(cfg)`.
Launched servers stay attached to their engines (`engine.server`: `stop()`, `alive()`,
`restart()`); `stop_sglang_engines` ends them. Weight transports are in `sync.sglang_transports`.

Nothing here imports sglang: servers are child processes and talk HTTP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from megatron_dapo.config import ConfigError
from megatron_dapo.ports import free_port
from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.sglang.client import SGLangEngine
from megatron_dapo.sglang.health import poll_health
from megatron_dapo.sglang.node_host import launch_on_nodes
from megatron_dapo.sglang.placement import engine_gpu_ids, local_actor_gpus
from megatron_dapo.sglang.server import SGLangServer, SGLangServerConfig

log = logging.getLogger(__name__)

_SGLANG_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


# SGLang on a CPU (tests, `megatron-dapo demo --engine sglang`): torch-native attention and
# sampling, no CUDA graphs, no overlap scheduler (it needs streams).
CPU_SERVER_ARGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
]
# A CPU server's --mem-fraction-static. SGLang checks that the host memory available after its
# weights load is at least (1 - fraction) of what was available before, and on a CPU that is the
# whole host's memory: another server's KV pool, a trainer rank or the other test worker allocating
# in that second failed a server's start at 0.05 ("Loaded weights leave no GPU memory for the KV
# cache ... minimum viable 0.0600", two servers of one torchrun test starting together). The pool
# itself is sized by --max-total-tokens (kv_pool_tokens), so the fraction only bounds that check.
CPU_MEM_FRACTION = 0.3
# The stand-ins for the two CUDA-only imports of the CPU server (tests/sglang_cpu/README.md); a
# source checkout has them, and only the server's PYTHONPATH gets them.
CPU_STANDINS = Path(__file__).resolve().parents[2] / "tests" / "sglang_cpu"


def cpu_server_env() -> dict[str, str]:
    env = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}
    if CPU_STANDINS.is_dir():
        env["PYTHONPATH"] = str(CPU_STANDINS)
    return env


def routed_experts_shape(cfg) -> tuple[int, int] | None:
    """``(layers, top-k)`` of the experts SGLang returns per token for ``model.path``, or None when
    ``actor.routing_replay`` is not ``rollout`` (then servers and clients leave them out).

    SGLang's reply has a row per decoder layer (``num_hidden_layers``) of ``num_experts_per_tok``
    experts (``RoutedExpertsCapturer``); the trainer's MoE layers are those same layers, since it
    takes only models whose every layer is MoE. The one place that shape is read: every server and
    client the driver makes (Ray, torchrun nodes, servers given by URL) gets it from here."""
    if cfg.actor.routing_replay != "rollout":
        return None
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(cfg.model.path))
    hf = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    k = getattr(hf, "num_experts_per_tok", None)
    if not k:
        raise ConfigError(
            f"actor.routing_replay=rollout needs a mixture-of-experts model; model.path={cfg.model.path} "
            f"({type(hf).__name__}) has no num_experts_per_tok; set actor.routing_replay=none"
        )
    step = getattr(hf, "decoder_sparse_step", 1)
    dense = list(getattr(hf, "mlp_only_layers", None) or [])
    if step != 1 or dense:
        raise ConfigError(
            f"actor.routing_replay=rollout: model.path={cfg.model.path} has dense layers "
            f"(decoder_sparse_step={step}, mlp_only_layers={dense}); every layer must be MoE"
        )
    return int(hf.num_hidden_layers), int(k)


def server_config(
    cfg,
    i: int,
    gpus: Sequence[int],
    log_dir: str | Path,
    host: str | None = None,
    port=None,
    cpu: bool = False,
):
    """The `SGLangServerConfig` of engine i: model, TP, address, base GPU, memory settings.

    `cpu`: a server without GPUs (CPU flags, environment and memory fraction above).
    With `actor.routing_replay: rollout` it returns the routed experts (`routed_experts_shape`).
    """
    s = cfg.rollout.sglang
    colocated = cfg.trainer.placement == "colocated"
    return SGLangServerConfig(
        model_path=str(cfg.model.path),
        tp_size=len(gpus) or int(cfg.rollout.tensor_parallel_size),
        host=host or s.host,
        port=int(s.base_port) + i if port is None else int(port),
        mem_fraction_static=CPU_MEM_FRACTION if cpu else float(s.mem_fraction_static),
        api_key=s.api_key,
        # release/resume of memory between rollout and training only matters when sharing GPUs
        enable_memory_saver=bool(colocated and s.enable_memory_saver and not cpu),
        dtype=_SGLANG_DTYPES.get(cfg.model.dtype, "auto"),
        base_gpu_id=gpus[0] if gpus else None,
        extra_args=(CPU_SERVER_ARGS if cpu else []) + [str(a) for a in s.extra_args],
        startup_timeout_s=float(s.startup_timeout_s),
        log_file=str(Path(log_dir) / f"engine_{i}.log"),
        env=cpu_server_env() if cpu else {},
        python=s.python,
        max_total_tokens=kv_pool_tokens(cfg),
        # the CPU flags choose torch_native attention, for which SGLang refuses determinism
        deterministic=seeds_apply(s) and not cpu,
        return_routed_experts=routed_experts_shape(cfg) is not None,
        sleep_on_idle=bool(s.sleep_on_idle),
    )


# SGLang 0.5.23 refuses --enable-deterministic-inference with these attention backends (it
# names the ones it accepts: ascend, fa3, fa4, flashinfer, intel_xpu, triton).
_NO_DETERMINISTIC_BACKENDS = ("torch_native",)


def seeds_apply(s) -> bool:
    """Whether the servers get ``--enable-deterministic-inference`` (the only way SGLang applies
    ``sampling_seed``). Not with an attention backend SGLang refuses it for (the CPU one): then
    the sampled tokens vary run to run, and a warning says so."""
    if not s.deterministic:
        return False
    args = [str(a) for a in s.extra_args]
    backend = args[args.index("--attention-backend") + 1] if "--attention-backend" in args[:-1] else None
    if backend in _NO_DETERMINISTIC_BACKENDS:
        log.warning(
            "SGLang refuses --enable-deterministic-inference with --attention-backend %s: it ignores "
            "sampling_seed, so rollouts are not reproducible run to run (log-probs still are)",
            backend,
        )
        return False
    return True


def kv_pool_tokens(cfg) -> int:
    """``--max-total-tokens``: ``rollout.sglang.max_total_tokens``, else room for every concurrent
    request at full length. SGLang takes the smaller of this and what its memory fraction holds,
    so the cap only stops it sizing the pool from whatever memory is free at its start."""
    if cfg.rollout.sglang.max_total_tokens is not None:
        return int(cfg.rollout.sglang.max_total_tokens)
    per_request = int(cfg.data.max_prompt_length) + int(cfg.data.max_response_length)
    return per_request * int(cfg.rollout.max_concurrency_per_engine)


def server_configs(cfg, gpu_groups: list[list[int]], log_dir: str | Path) -> list:
    """One `SGLangServerConfig` per engine on this node: port base_port+i."""
    return [server_config(cfg, i, gpus, log_dir) for i, gpus in enumerate(gpu_groups)]


# ---------------------------------------------------------------- connect / launch
def _check_url(i: int, url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not parsed.port:
        raise ConfigError(f"rollout.sglang.urls[{i}]={url!r} is not http(s)://HOST:PORT")
    return url.rstrip("/")


def wait_until_healthy(url: str, name: str, timeout_s: float, api_key: str | None = None) -> None:
    """Poll `GET /health` until it answers 200; EngineError naming the engine after `timeout_s`."""
    seen = poll_health(url, timeout_s, path="/health", api_key=api_key)
    if not seen.healthy:
        raise EngineError(
            f"sglang engine {name} at {url} is not healthy after {timeout_s:g}s (last GET /health: {seen.last}); "
            "is the server running and reachable from this node? (rollout.sglang.startup_timeout_s)"
        )


def connect_sglang_engines(
    urls: Sequence[str],
    *,
    tp_size: int,
    api_key: str | None,
    health_timeout_s: float,
    request_timeout_s: float = 1800.0,
    answer_timeout_s: float = 120.0,
    routed_experts_shape: tuple[int, int] | None = None,
) -> list:
    """`SGLangEngine`s for running servers, after each answered `/health` (within `health_timeout_s`
    in all); TP size from the server. Later health checks wait `answer_timeout_s` for an answer.
    `routed_experts_shape`: ask every reply for the routed experts (the servers must have been
    started with `sglang.server.ROUTED_EXPERTS_FLAG`; a reply without them is an error naming it)."""
    checked = [_check_url(i, u) for i, u in enumerate(urls)]
    deadline = time.monotonic() + health_timeout_s
    engines = []
    try:
        for i, url in enumerate(checked):
            name = f"sglang-{i}@{urlparse(url).netloc}"
            wait_until_healthy(url, name, max(deadline - time.monotonic(), 0.1), api_key)
            engine = SGLangEngine(
                url,
                name=name,
                tp_size=tp_size,
                api_key=api_key,
                timeout_s=request_timeout_s,
                health_timeout_s=answer_timeout_s,
                routed_experts_shape=routed_experts_shape,
            )
            engines.append(engine)
            # refuses an unsupported SGLang; resumes a server a crashed trainer left paused
            engine.run(engine.client.on_connect(), timeout=request_timeout_s)
            engine.tp_size = _server_tp_size(engine, tp_size)
    except BaseException:
        stop_sglang_engines(engines)
        raise
    return engines


def _server_tp_size(engine, configured: int) -> int:
    """The server's own TP size when it reports one (CUDA IPC sends one payload per TP rank)."""
    try:
        info = engine.run(engine.client.get_server_info(), timeout=30)
    except Exception as e:  # noqa: BLE001 - older servers: keep the configured size
        log.info("%s: no /get_server_info (%s); assuming tp_size=%d", engine.name, e, configured)
        return configured
    reported = info.get("tp_size") if isinstance(info, dict) else None
    if reported is None:
        return configured
    if int(reported) != configured:
        log.warning(
            "%s reports tp_size=%s, rollout.tensor_parallel_size=%d; using the server's",
            engine.name,
            reported,
            configured,
        )
    return int(reported)


def launch_sglang_engines(cfg, configs: Sequence[Any]) -> list:
    """Start one server per `SGLangServerConfig` on this node, wait for all of them; their engines.

    The servers start together (loading weights in parallel); if any fails, all are stopped and
    the error carries the failing server's log tail.
    """
    servers = []
    engines = []
    shape = routed_experts_shape(cfg)
    try:
        for c in configs:
            where = (
                "the CPU"
                if c.base_gpu_id is None
                else f"GPUs {c.base_gpu_id}..{c.base_gpu_id + c.tp_size - 1}"
            )
            log.info("starting %s on %s (log %s)", c.url, where, c.log_file)
            servers.append(SGLangServer(c).start())
        for srv in servers:
            srv.wait_healthy()
        for i, srv in enumerate(servers):
            engines.append(
                SGLangEngine(
                    srv.cfg.url,
                    name=f"sglang-{i}@{srv.cfg.host}:{srv.cfg.port}",
                    server=srv,
                    tp_size=srv.cfg.tp_size,
                    api_key=srv.cfg.api_key,
                    timeout_s=float(cfg.rollout.request_timeout_s),
                    health_timeout_s=float(cfg.rollout.sglang.health_timeout_s),
                    routed_experts_shape=shape,
                )
            )
    except BaseException:
        stop_sglang_engines(engines)
        for srv in servers:
            srv.stop()
        raise
    return engines


def start_sglang_engines(cfg) -> list:
    """The run's SGLang engines: connected to `rollout.sglang.urls`, else launched on this node."""
    s = cfg.rollout.sglang
    if s.urls:
        if len(s.urls) != cfg.rollout.num_engines:
            log.info(
                "rollout.sglang.urls lists %d servers; using all of them (rollout.num_engines=%d)",
                len(s.urls),
                cfg.rollout.num_engines,
            )
        return connect_sglang_engines(
            list(s.urls),
            tp_size=int(cfg.rollout.tensor_parallel_size),
            api_key=s.api_key,
            health_timeout_s=float(s.startup_timeout_s),
            request_timeout_s=float(cfg.rollout.request_timeout_s),
            answer_timeout_s=float(s.health_timeout_s),
            routed_experts_shape=routed_experts_shape(cfg),
        )
    log_dir = Path(cfg.trainer.runs_dir).resolve() / cfg.trainer.run_name / "sglang"
    total = torch.cuda.device_count()
    if total == 0:
        # CPU servers (tests, laptops): this node, SGLang's CPU flags, free ports
        configs = [
            server_config(cfg, i, (), log_dir, port=free_port(), cpu=True)
            for i in range(int(cfg.rollout.num_engines))
        ]
        return launch_sglang_engines(cfg, configs)
    groups = engine_gpu_ids(
        cfg.trainer.placement,
        local_actor_gpus(int(cfg.parallel.actor_world_size), total),
        total,
        int(cfg.rollout.num_engines),
        int(cfg.rollout.tensor_parallel_size),
    )
    return launch_sglang_engines(cfg, server_configs(cfg, groups, log_dir))


def launch_planned_engines(
    cfg, plans: Sequence[Any], log_dir: str | Path, commands=None, cpu: bool = False
) -> list:
    """Under Ray: every plan's server started on its own node (`sglang.node_host`); their engines.

    Each engine keeps its plan (`engine.plan`: node, GPUs, and the trainer ranks on them) and a
    `RemoteServer` (`engine.server`) through which the driver checks, restarts or stops it.
    """
    configs = [
        server_config(cfg, p.index, p.gpus, log_dir, host=p.node_ip, port=p.port, cpu=cpu) for p in plans
    ]
    _, servers = launch_on_nodes(
        plans, configs, startup_timeout_s=float(cfg.rollout.sglang.startup_timeout_s), commands=commands
    )
    shape = routed_experts_shape(cfg)
    engines = []
    for p, c, srv in zip(plans, configs, servers):
        engine = SGLangEngine(
            srv.url,
            name=srv.name,
            server=srv,
            tp_size=c.tp_size,
            api_key=c.api_key,
            timeout_s=float(cfg.rollout.request_timeout_s),
            health_timeout_s=float(cfg.rollout.sglang.health_timeout_s),
            routed_experts_shape=shape,
        )
        engine.plan = p
        engines.append(engine)
    return engines


def stop_sglang_engines(engines: Sequence[Any]) -> None:
    """Close every engine's client and stop the servers this process launched (best effort)."""
    for e in engines:
        try:
            e.close()
        except Exception as err:  # noqa: BLE001 - keep stopping the others
            log.warning("closing %s: %s", e.name, err)
        server = getattr(e, "server", None)
        if server is not None:
            server.stop()
