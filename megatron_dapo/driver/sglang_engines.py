"""SGLang rollout engines for the driver: connect or launch the servers, and push weights to them.

`start_sglang_engines(cfg)` returns one `SGLangEngine` (HTTP client) per server:
- `rollout.sglang.urls` given: connect to those servers (started by `launch/start_sglang_servers.sh`
  or by hand), each health-checked until `rollout.sglang.startup_timeout_s`.
- otherwise: launch `rollout.num_engines` servers on this node (`python -m sglang.launch_server`,
  ports `base_port + i`, logs in RUN_DIR/sglang/), on GPUs chosen by `engine_gpu_ids`:
  colocated = the actor's GPUs on this node (engine i on GPUs [i*tp, (i+1)*tp) of them),
  disaggregated = the GPUs after the actor's (engine i on first + [i*tp, (i+1)*tp)).
  The actor's GPUs on this node are 0..LOCAL_WORLD_SIZE-1 under torchrun, and
  0..min(actor_world_size, GPUs)-1 under Ray (a fresh PACK placement group fills GPUs in order).
  GPU indices are relative to the launching process's CUDA_VISIBLE_DEVICES (`--base-gpu-id`).
Launched servers stay attached to their engines (`engine.server`); `stop_sglang_engines` ends them.

`sglang_transport(cfg, engines)` returns the driver's weight transport (`begin(version)`,
`send(index, bucket)`, `finish()`, run by global rank 0's worker) per `trainer.weight_sync.transport`:
nccl (disaggregated), cuda_ipc (colocated), disk (anywhere with a shared filesystem), auto = cuda_ipc
when colocated and every server is on this node, nccl otherwise. Every engine is paused and its cache flushed before the
first bucket, every update carries the weight version, and generation continues after the last.
A transport holds only the servers' addresses, so it pickles into a Ray actor; its HTTP clients
and the NCCL group are made on first use, in the process that sends. Every wait has a deadline
(`trainer.weight_sync.timeout_s`) whose error names the engine and the bucket.

Nothing here imports sglang: servers are child processes and talk HTTP.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from megatron_dapo.config import ConfigError
from megatron_dapo.driver.weight_transport import DiskTransport, WeightSyncTimeout, describe_bucket
from megatron_dapo.rollout.engine import EngineError

log = logging.getLogger(__name__)

_SGLANG_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


# ---------------------------------------------------------------- where the servers go (pure)
def engine_gpu_ids(
    placement: str, actor_gpus: Sequence[int], total_gpus: int, num_engines: int, tp: int
) -> list[list[int]]:
    """GPU indices of each engine on this node; see the module docstring for the mapping.

    Raises ConfigError when the engines do not fit, or when an engine's GPUs are not contiguous
    (SGLang takes a base GPU id and counts up from it).
    """
    if num_engines < 1 or tp < 1:
        raise ConfigError(
            f"rollout.num_engines ({num_engines}) and rollout.tensor_parallel_size ({tp}) must be >= 1"
        )
    if placement == "colocated":
        pool = list(actor_gpus)
        where = f"the actor's GPUs on this node ({pool})"
    elif placement == "disaggregated":
        first = max(actor_gpus) + 1 if actor_gpus else 0
        pool = list(range(first, total_gpus))
        where = f"the GPUs after the actor's ({first}..{total_gpus - 1} of {total_gpus})"
    else:
        raise ConfigError(f"trainer.placement must be colocated or disaggregated, got {placement!r}")
    need = num_engines * tp
    if need > len(pool):
        raise ConfigError(
            f"rollout.num_engines={num_engines} x rollout.tensor_parallel_size={tp} needs {need} GPUs, but "
            f"trainer.placement={placement} leaves {len(pool)}: {where}. Use fewer or smaller engines, or "
            "start the servers yourself (launch/start_sglang_servers.sh) and give rollout.sglang.urls"
        )
    groups = [pool[i * tp : (i + 1) * tp] for i in range(num_engines)]
    for i, g in enumerate(groups):
        if g != list(range(g[0], g[0] + tp)):
            raise ConfigError(f"engine {i} would get non-contiguous GPUs {g}; SGLang needs consecutive ones")
    return groups


def local_actor_gpus(actor_world_size: int, total_gpus: int) -> list[int]:
    """The actor ranks' GPUs on this node: torchrun's local ranks, else Ray's first bundles."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    n = int(local) if local else min(actor_world_size, total_gpus)
    return list(range(n))


def server_configs(cfg, gpu_groups: list[list[int]], log_dir: str | Path) -> list:
    """One `SGLangServerConfig` per engine: model, TP, port base_port+i, base GPU, memory settings."""
    from megatron_dapo.rollout.sglang_server import SGLangServerConfig

    s = cfg.rollout.sglang
    colocated = cfg.trainer.placement == "colocated"
    return [
        SGLangServerConfig(
            model_path=str(cfg.model.path),
            tp_size=len(gpus),
            host=s.host,
            port=int(s.base_port) + i,
            mem_fraction_static=float(s.mem_fraction_static),
            api_key=s.api_key,
            # release/resume of memory between rollout and training only matters when sharing GPUs
            enable_memory_saver=bool(colocated and s.enable_memory_saver),
            dtype=_SGLANG_DTYPES.get(cfg.model.dtype, "auto"),
            base_gpu_id=gpus[0],
            extra_args=[str(a) for a in s.extra_args],
            startup_timeout_s=float(s.startup_timeout_s),
            log_file=str(Path(log_dir) / f"engine_{i}.log"),
        )
        for i, gpus in enumerate(gpu_groups)
    ]


# ---------------------------------------------------------------- connect / launch
def _check_url(i: int, url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not parsed.port:
        raise ConfigError(f"rollout.sglang.urls[{i}]={url!r} is not http(s)://HOST:PORT")
    return url.rstrip("/")


def wait_until_healthy(
    url: str, name: str, timeout_s: float, api_key: str | None = None, poll_s: float = 0.5
) -> None:
    """Poll `GET /health` until it answers 200; EngineError naming the engine after `timeout_s`."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            r = httpx.get(url + "/health", headers=headers, timeout=min(5.0, max(timeout_s, 0.1)))
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise EngineError(
                f"sglang engine {name} at {url} is not healthy after {timeout_s:g}s (last GET /health: {last}); "
                "is the server running and reachable from this node? (rollout.sglang.startup_timeout_s)"
            )
        time.sleep(poll_s)


def connect_sglang_engines(
    urls: Sequence[str],
    *,
    tp_size: int,
    api_key: str | None,
    health_timeout_s: float,
    request_timeout_s: float = 1800.0,
) -> list:
    """`SGLangEngine`s for running servers, after each answered `/health`; TP size from the server."""
    from megatron_dapo.rollout.sglang_client import SGLangEngine

    checked = [_check_url(i, u) for i, u in enumerate(urls)]
    deadline = time.monotonic() + health_timeout_s
    engines = []
    try:
        for i, url in enumerate(checked):
            name = f"sglang-{i}@{urlparse(url).netloc}"
            wait_until_healthy(url, name, max(deadline - time.monotonic(), 0.1), api_key)
            engine = SGLangEngine(
                url, name=name, tp_size=tp_size, api_key=api_key, timeout_s=request_timeout_s
            )
            engines.append(engine)
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


def launch_sglang_engines(cfg, gpu_groups: list[list[int]], log_dir: str | Path) -> list:
    """Start one server per GPU group, wait for all of them, and return their engines.

    The servers start together (loading weights in parallel); if any fails, all are stopped and
    the error carries the failing server's log tail.
    """
    from megatron_dapo.rollout.sglang_client import SGLangEngine
    from megatron_dapo.rollout.sglang_server import SGLangServer

    servers = []
    engines = []
    try:
        for c in server_configs(cfg, gpu_groups, log_dir):
            log.info(
                "starting %s on GPUs %d..%d (log %s)",
                c.url,
                c.base_gpu_id,
                c.base_gpu_id + c.tp_size - 1,
                c.log_file,
            )
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
        )
    total = torch.cuda.device_count()
    if total == 0:
        raise ConfigError(
            "rollout.engine=sglang launches servers on this node's GPUs and torch sees none; give "
            "rollout.sglang.urls of running servers, or use rollout.engine=hf on CPU"
        )
    groups = engine_gpu_ids(
        cfg.trainer.placement,
        local_actor_gpus(int(cfg.parallel.actor_world_size), total),
        total,
        int(cfg.rollout.num_engines),
        int(cfg.rollout.tensor_parallel_size),
    )
    return launch_sglang_engines(cfg, groups, Path(cfg.trainer.runs_dir) / cfg.trainer.run_name / "sglang")


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


# ---------------------------------------------------------------- weight transports
@dataclass(frozen=True)
class EngineEndpoint:
    """What a transport needs to reach one server from another process."""

    name: str
    url: str
    tp_size: int = 1
    api_key: str | None = None


def endpoints_of(engines: Sequence[Any], api_key: str | None) -> list[EngineEndpoint]:
    return [EngineEndpoint(e.name, e.client.base_url, int(e.tp_size), api_key) for e in engines]


class EngineCalls:
    """HTTP calls to the servers with deadlines; clients are made lazily in the sending process."""

    def __init__(self, endpoints: Sequence[EngineEndpoint], timeout_s: float):
        self.endpoints = list(endpoints)
        self.timeout_s = float(timeout_s)
        self._engines: list | None = None

    def __getstate__(self):
        # HTTP clients (event-loop threads) stay in the process that made them
        return {**self.__dict__, "_engines": None}

    @property
    def engines(self) -> list:
        if self._engines is None:
            from megatron_dapo.rollout.sglang_client import SGLangEngine

            self._engines = [
                SGLangEngine(
                    ep.url, name=ep.name, tp_size=ep.tp_size, api_key=ep.api_key, timeout_s=self.timeout_s
                )
                for ep in self.endpoints
            ]
        return self._engines

    def submit(self, i: int, call: Callable[[Any], Any]) -> Future:
        """Start `call(client)` (a coroutine) on engine i; a Future."""
        engine = self.engines[i]
        return engine.submit(call(engine.client))

    def wait(self, i: int, fut: Future, what: str, deadline: float | None = None) -> Any:
        """The Future's result by `deadline`; errors name the engine and `what`."""
        name = self.endpoints[i].name
        remaining = self.timeout_s if deadline is None else deadline - time.monotonic()
        try:
            return fut.result(timeout=max(remaining, 0.001))
        except FutureTimeout as e:
            raise WeightSyncTimeout(
                f"weight sync: engine {name} did not answer {what} within {self.timeout_s:g}s "
                "(trainer.weight_sync.timeout_s); is it alive and reachable?"
            ) from e
        except EngineError as e:
            raise EngineError(f"weight sync, {what}: {e}") from e

    def each(self, what: str, call: Callable[[Any], Any]) -> list[Any]:
        """`call(client)` on every engine at once, all answers by one deadline."""
        futures = [self.submit(i, call) for i in range(len(self.endpoints))]
        deadline = time.monotonic() + self.timeout_s
        return [self.wait(i, f, what, deadline) for i, f in enumerate(futures)]

    def pause(self) -> None:
        self.each("pause_generation", lambda c: c.pause_generation("abort"))
        self.each("flush_cache", lambda c: c.flush_cache())

    def resume(self, version: int) -> None:
        self.each("continue_generation", lambda c: c.continue_generation())
        for e in self.engines:
            e.weight_version = version

    def close(self) -> None:
        if self._engines is not None:
            for e in self._engines:
                e.close()
            self._engines = None


class SGLangIPCTransport:
    """Colocated: each bucket's CUDA tensors go by IPC handle (`/update_weights_from_tensor`).

    The server copies the tensors before it answers, so the bucket (a view of the gather
    buffer that the next bucket reuses) may be overwritten as soon as `send` returns.
    """

    def __init__(self, endpoints: Sequence[EngineEndpoint], timeout_s: float):
        self.calls = EngineCalls(endpoints, timeout_s)

    def begin(self, version: int) -> None:
        self.version = version
        self.calls.pause()

    def send(self, index: int, bucket: dict[str, torch.Tensor]) -> None:
        from megatron_dapo.rollout.sglang_weight_sync import serialize_bucket_for_ipc

        what = describe_bucket(index, bucket)
        if any(t.device.type != "cuda" for t in bucket.values()):
            raise EngineError(
                f"weight sync to {', '.join(ep.name for ep in self.calls.endpoints)}: CUDA IPC needs CUDA "
                f"tensors and {what} is on the CPU; set trainer.weight_sync.transport=disk or nccl"
            )
        futures = [
            self.calls.submit(
                i,
                lambda c, tp=ep.tp_size: c.update_weights_from_tensor(
                    serialize_bucket_for_ipc(bucket, tp), self.version
                ),
            )
            for i, ep in enumerate(self.calls.endpoints)
        ]
        deadline = time.monotonic() + self.calls.timeout_s
        for i, f in enumerate(futures):
            self.calls.wait(i, f, what, deadline)

    def finish(self) -> None:
        self.calls.resume(self.version)


class SGLangNCCLTransport:
    """Disaggregated: tensors by broadcast from this process (rank 0 of a group with every server).

    The group forms on the first `begin`: each server is asked to join it
    (`/init_weights_update_group`, server TP ranks from `rank_offset`) while this process
    creates it. Per bucket, the names/dtypes/shapes go over HTTP (`/update_weights_from_distributed`)
    while the tensors are broadcast; a server's handler returns once its copy is loaded.
    `backend` is "nccl" on GPUs; tests use "gloo".
    """

    def __init__(
        self,
        endpoints: Sequence[EngineEndpoint],
        timeout_s: float,
        *,
        backend: str = "nccl",
        master_address: str | None = None,
        group_name: str | None = None,
    ):
        self.calls = EngineCalls(endpoints, timeout_s)
        self.backend = backend
        self.master_address = master_address
        self.group_name = group_name or f"megatron_dapo_sync_{uuid.uuid4().hex[:8]}"
        self._group = None

    def __getstate__(self):
        return {**self.__dict__, "_group": None}

    @property
    def names(self) -> str:
        return ",".join(ep.name for ep in self.calls.endpoints)

    def _form_group(self) -> None:
        from megatron_dapo.actor.spawn import free_port
        from megatron_dapo.rollout.sglang_weight_sync import init_custom_group

        eps = self.calls.endpoints
        addr = self.master_address or route_address(eps[0].url)
        port = free_port()
        world = 1 + sum(ep.tp_size for ep in eps)
        futures, offset = [], 1
        for i, ep in enumerate(eps):
            kwargs = dict(
                master_address=addr,
                master_port=port,
                rank_offset=offset,
                world_size=world,
                group_name=self.group_name,
                backend=self.backend,
            )
            futures.append(self.calls.submit(i, lambda c, kw=kwargs: c.init_weights_update_group(**kw)))
            offset += ep.tp_size
        timeout = self.calls.timeout_s
        holder: dict[str, Any] = {}

        def form() -> None:
            try:
                holder["group"] = init_custom_group(
                    addr, port, 0, world, self.group_name, self.backend, timeout
                )
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                holder["error"] = e

        # The rendezvous blocks until every server has joined; watch the servers' answers meanwhile
        # so that a refusal surfaces now rather than at the rendezvous deadline.
        thread = threading.Thread(target=form, name="weight-sync-group", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive() and time.monotonic() < deadline:
            for i, f in enumerate(futures):
                if f.done() and f.exception() is not None:
                    self.calls.wait(
                        i, f, f"/init_weights_update_group ({self.backend} group at {addr}:{port})"
                    )
            thread.join(0.05)
        if thread.is_alive() or "error" in holder:
            waiting = [ep.name for ep, f in zip(eps, futures) if not f.done()]
            raise WeightSyncTimeout(
                f"weight sync: the {self.backend} group {self.group_name} at {addr}:{port} (world {world}) did "
                f"not form within {timeout:g}s; engines still joining: {waiting or 'none'} "
                f"({holder.get('error', 'rendezvous timed out')}); can the servers reach {addr}:{port}?"
            ) from holder.get("error")
        for i, f in enumerate(futures):
            self.calls.wait(
                i, f, f"/init_weights_update_group ({self.backend} group at {addr}:{port})", deadline
            )
        self._group = holder["group"]

    def begin(self, version: int) -> None:
        self.version = version
        if self._group is None:
            self._form_group()
        self.calls.pause()

    def send(self, index: int, bucket: dict[str, torch.Tensor]) -> None:
        from megatron_dapo.rollout.sglang_weight_sync import WeightSyncTimeoutError, broadcast_bucket

        what = describe_bucket(index, bucket)
        futures = [
            self.calls.submit(
                i, lambda c: c.update_weights_from_distributed(bucket, self.version, self.group_name)
            )
            for i in range(len(self.calls.endpoints))
        ]
        try:
            broadcast_bucket(
                bucket, self._group, timeout_s=self.calls.timeout_s, engine=self.names, bucket_index=index
            )
        except WeightSyncTimeoutError as e:
            # a server that refused the metadata never joins the broadcast: say so
            refused = [
                f"{ep.name}: {f.exception()}"
                for ep, f in zip(self.calls.endpoints, futures)
                if f.done() and f.exception() is not None
            ]
            if refused:
                raise EngineError(f"{e}; the engines answered: {'; '.join(refused)}") from e
            raise
        deadline = time.monotonic() + self.calls.timeout_s
        for i, f in enumerate(futures):
            self.calls.wait(i, f, f"the load of {what}", deadline)

    def finish(self) -> None:
        self.calls.resume(self.version)


class SGLangDiskReloader:
    """One server's side of `DiskTransport`: pause, flush, `/update_weights_from_disk`, continue."""

    def __init__(self, calls: EngineCalls, index: int):
        self.calls = calls
        self.index = index

    def load_from_disk(self, path: str, version: int) -> bool:
        i, c = self.index, self.calls
        c.wait(i, c.submit(i, lambda cl: cl.pause_generation("abort")), "pause_generation")
        c.wait(i, c.submit(i, lambda cl: cl.flush_cache()), "flush_cache")
        c.wait(i, c.submit(i, lambda cl: cl.update_weights_from_disk(path, version)), f"the reload of {path}")
        c.wait(i, c.submit(i, lambda cl: cl.continue_generation()), "continue_generation")
        c.engines[i].weight_version = version
        return True


class SGLangDiskTransport(DiskTransport):
    """`DiskTransport` to SGLang servers; keeps only the newest version's files on disk.

    The directory must be visible to every server under the same path (a shared filesystem
    when they run on other nodes).
    """

    def __init__(
        self,
        endpoints: Sequence[EngineEndpoint],
        directory: str | Path,
        timeout_s: float,
        hf_metadata_dir=None,
    ):
        calls = EngineCalls(endpoints, timeout_s)
        reloaders = [(ep.name, SGLangDiskReloader(calls, i)) for i, ep in enumerate(endpoints)]
        super().__init__(reloaders, directory, timeout_s, hf_metadata_dir)
        self.calls = calls

    def finish(self) -> None:
        super().finish()
        for old in self.directory.glob("v*"):
            if old.is_dir() and old != self.target:
                shutil.rmtree(old, ignore_errors=True)


def route_address(url: str) -> str:
    """This host's address on the route to `url`'s host (what that server can connect back to)."""
    parsed = urlparse(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((parsed.hostname, parsed.port or 80))  # UDP: no packet is sent
        return s.getsockname()[0]


def is_local(url: str) -> bool:
    """True when `url`'s host is this machine (CUDA IPC handles only open on the same node)."""
    host = urlparse(url).hostname
    try:
        ip = socket.gethostbyname(host)
        return ip.startswith("127.") or route_address(url) == ip
    except OSError:
        return False


def resolve_transport_kind(cfg, endpoints: Sequence[EngineEndpoint] = ()) -> str:
    """nccl / cuda_ipc / disk from `trainer.weight_sync.transport` and the placement.

    auto = cuda_ipc when colocated and every server is on this node, nccl otherwise (servers
    given by URL on other nodes cannot open this process's CUDA IPC handles).
    """
    kind = cfg.trainer.weight_sync.transport
    if kind == "auto":
        if cfg.trainer.placement != "colocated":
            return "nccl"
        remote = [ep.name for ep in endpoints if not is_local(ep.url)]
        if remote:
            log.info("weight sync: %s not on this node; using nccl instead of cuda_ipc", ", ".join(remote))
            return "nccl"
        return "cuda_ipc"
    if kind == "object_store":
        raise ConfigError(
            "trainer.weight_sync.transport=object_store is for HF engines in Ray actors; SGLang engines "
            "take nccl, cuda_ipc, disk or auto"
        )
    return kind


def sglang_transport(cfg, engines: Sequence[Any]):
    """The weight transport to `engines` chosen by `trainer.weight_sync.transport` (module docstring)."""
    endpoints = endpoints_of(engines, cfg.rollout.sglang.api_key)
    timeout = float(cfg.trainer.weight_sync.timeout_s)
    kind = resolve_transport_kind(cfg, endpoints)
    if kind == "cuda_ipc":
        return SGLangIPCTransport(endpoints, timeout)
    if kind == "nccl":
        return SGLangNCCLTransport(endpoints, timeout, backend="nccl")
    directory = Path(cfg.trainer.runs_dir) / cfg.trainer.run_name / "weight_sync"
    return SGLangDiskTransport(endpoints, directory.resolve(), timeout, hf_metadata_dir=cfg.model.path)
