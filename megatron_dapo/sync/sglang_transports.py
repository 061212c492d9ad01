"""Weight transports to SGLang servers, and the choice between them.

`sglang_transport(cfg, engines)` returns the driver's `WeightTransport` (sync/protocol.py; run by
global rank 0's worker, or by every rank for CUDA IPC per rank) per `trainer.weight_sync.transport`:
nccl (disaggregated), cuda_ipc (colocated, servers on this node), disk (anywhere with a shared
filesystem); `resolve_transport_kind` says which auto picks and refuses nccl when colocated. Every
engine is paused and its cache flushed before the first bucket, every update carries the weight
version, and generation continues after the last. A transport holds only the servers' addresses,
so it pickles into a Ray actor; its HTTP clients and the NCCL group are made on first use, in the
process that sends. Every wait has a deadline (`trainer.weight_sync.timeout_s`) whose error names
the engine and the bucket.

Nothing here imports sglang: servers are other processes and talk HTTP.
"""

from __future__ import annotations

import logging
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
from megatron_dapo.ports import free_port
from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.sglang.client import SGLangEngine
from megatron_dapo.sglang.ipc import serialize_bucket_for_ipc
from megatron_dapo.sync.protocol import WeightSyncTimeoutError, describe_bucket
from megatron_dapo.sync.sglang_senders import broadcast_bucket, init_custom_group
from megatron_dapo.sync.transports import DiskTransport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineEndpoint:
    """What a transport needs to reach one server from another process."""

    name: str
    url: str
    tp_size: int = 1
    api_key: str | None = None
    ipc_ranks: tuple[int, ...] = ()  # colocated launch: the trainer rank on each of its TP ranks' GPUs


def endpoints_of(engines: Sequence[Any], api_key: str | None) -> list[EngineEndpoint]:
    return [
        EngineEndpoint(
            e.name,
            e.client.base_url,
            int(e.tp_size),
            api_key,
            tuple(getattr(getattr(e, "plan", None), "ipc_ranks", ())),
        )
        for e in engines
    ]


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
            raise WeightSyncTimeoutError(
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

    def drop(self, names: set[str]) -> None:
        """Stop sending to these engines (servers given by URL that hung: the run goes on
        without them); their clients are closed."""
        keep = [i for i, ep in enumerate(self.endpoints) if ep.name not in names]
        if self._engines is not None:
            for i, e in enumerate(self._engines):
                if i not in keep:
                    e.close()
            self._engines = [self._engines[i] for i in keep]
        self.endpoints = [self.endpoints[i] for i in keep]

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

    every_rank = False

    def __init__(self, endpoints: Sequence[EngineEndpoint], timeout_s: float):
        self.calls = EngineCalls(endpoints, timeout_s)

    def drop(self, names: set[str]) -> None:
        self.calls.drop(names)

    def reset(self) -> None:
        """Nothing to forget: every bucket goes to each server on its own."""

    def begin(self, version: int) -> None:
        self.version = version
        self.calls.pause()

    def send(self, index: int, bucket: dict[str, torch.Tensor]) -> None:
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


def _serialize_one(bucket: dict[str, torch.Tensor]) -> str:
    return serialize_bucket_for_ipc(bucket, 1)[0]


class SGLangRankIPCTransport:
    """Colocated on a cluster: every engine TP rank gets CUDA IPC handles made on its own GPU.

    Run by every trainer rank (`every_rank`): per bucket, global rank 0 (a bucket holder)
    broadcasts the tensors; each rank named in an engine's `ipc_ranks` (the rank on that TP
    rank's GPU, on the engine's node) serializes its own copy, so each TP rank gets one payload
    of its own rather than one payload copied TP times; the payloads are gathered, and each
    engine's first IPC rank, on the engine's node, posts them in TP order
    (`/update_weights_from_tensor`). Every rank keeps its copy until every engine answered. Rank 0
    pauses and flushes the engines before the first bucket and continues them after the last.
    `serialize` turns a bucket into one payload (tests replace it).
    """

    every_rank = True

    def __init__(self, endpoints: Sequence[EngineEndpoint], timeout_s: float, serialize=_serialize_one):
        missing = [ep.name for ep in endpoints if len(ep.ipc_ranks) != ep.tp_size]
        if missing:
            raise ConfigError(
                f"weight sync by CUDA IPC per rank needs the trainer rank of each TP rank of {', '.join(missing)}; "
                "only engines that the driver launched have them (use trainer.weight_sync.transport=disk)"
            )
        self.calls = EngineCalls(endpoints, timeout_s)
        self.serialize = serialize

    def drop(self, names: set[str]) -> None:
        self.calls.drop(names)

    def reset(self) -> None:
        """Nothing to forget: every bucket goes to each server on its own."""

    def begin(self, version: int) -> None:
        import torch.distributed as dist

        self.version = version
        if dist.get_rank() == 0:
            self.calls.pause()

    def send(self, index: int, bucket: dict[str, torch.Tensor] | None) -> None:
        import torch.distributed as dist

        rank = dist.get_rank()
        meta = [[(k, tuple(v.shape), v.dtype) for k, v in bucket.items()] if rank == 0 else None]
        dist.broadcast_object_list(meta, src=0)
        sources = {r for ep in self.calls.endpoints for r in ep.ipc_ranks}
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        mine: dict[str, torch.Tensor] = {}
        for name, shape, dtype in meta[0]:
            t = bucket[name].contiguous() if rank == 0 else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, src=0)
            mine[name] = t
        payload = self.serialize(mine) if rank in sources else None
        payloads: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(payloads, payload)
        what = describe_bucket(index, mine)
        error = None
        try:
            futures = {
                i: self.calls.submit(
                    i,
                    lambda c, ep=ep: c.update_weights_from_tensor(
                        [payloads[r] for r in ep.ipc_ranks], self.version
                    ),
                )
                for i, ep in enumerate(self.calls.endpoints)
                if ep.ipc_ranks[0] == rank
            }
            deadline = time.monotonic() + self.calls.timeout_s
            for i, f in futures.items():
                self.calls.wait(i, f, what, deadline)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, not wait in a collective
            error = f"rank {rank}: {e}"
        # the copies stay alive until every engine has loaded them; a failure reaches every rank
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        failed = [e for e in errors if e]
        if failed:
            raise EngineError(f"weight sync by CUDA IPC, {what}: " + "; ".join(failed))

    def finish(self) -> None:
        import torch.distributed as dist

        if dist.get_rank() == 0:
            self.calls.resume(self.version)


class SGLangNCCLTransport:
    """Disaggregated: tensors by broadcast from this process (rank 0 of a group with every server).

    The group forms on the first `begin`: each server is asked to join it
    (`/init_weights_update_group`, server TP ranks from `rank_offset`) while this process
    creates it. Per bucket, the names/dtypes/shapes go over HTTP (`/update_weights_from_distributed`)
    while the tensors are broadcast; a server's handler returns once its copy is loaded.
    `backend` is "nccl" on GPUs; tests use "gloo".
    """

    every_rank = False

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

    def reset(self) -> None:
        """A server was restarted and is in no group: form a new one (new name) at the next sync."""
        if self._group is not None:
            import torch.distributed as dist

            try:
                dist.destroy_process_group(self._group)
            except Exception as e:  # noqa: BLE001 - the old group may be broken by the dead server
                log.warning("weight sync: dropping the old group %s: %s", self.group_name, e)
        self._group = None
        self.group_name = f"megatron_dapo_sync_{uuid.uuid4().hex[:8]}"

    def drop(self, names: set[str]) -> None:
        """The group's world is every server: without these, a new one forms at the next sync."""
        self.calls.drop(names)
        self.reset()

    @property
    def names(self) -> str:
        return ",".join(ep.name for ep in self.calls.endpoints)

    def _form_group(self) -> None:
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
            raise WeightSyncTimeoutError(
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

    def drop(self, names: set[str]) -> None:
        self.calls.drop(names)  # the reloaders address servers by index: renumber them
        self.engines = [
            (ep.name, SGLangDiskReloader(self.calls, i)) for i, ep in enumerate(self.calls.endpoints)
        ]

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


def resolve_transport_kind(cfg, endpoints: Sequence[EngineEndpoint] = (), gpus: bool = True) -> str:
    """nccl / cuda_ipc / disk from `trainer.weight_sync.transport` and the placement.

    Colocated never uses NCCL: the trainer's sending rank and an engine TP rank would sit on one
    GPU in one communicator, which NCCL refuses ("Duplicate GPU detected"). So auto = cuda_ipc
    when colocated on GPUs and every server is on this node (the sender's handles open only there), disk
    when colocated servers are elsewhere, nccl when disaggregated.
    """
    kind = cfg.trainer.weight_sync.transport
    # on CPUs (`gpus=False`: tests, the demo) nothing shares a GPU: the group runs over gloo
    colocated = cfg.trainer.placement == "colocated" and gpus
    if kind == "nccl" and colocated:
        raise ConfigError(
            "trainer.weight_sync.transport=nccl with trainer.placement=colocated puts the sending trainer "
            "rank and an engine's TP rank on one GPU in one NCCL group, which NCCL refuses (Duplicate GPU "
            "detected); use trainer.weight_sync.transport=auto, cuda_ipc or disk"
        )
    if kind == "auto":
        if not colocated:
            return "nccl"
        # engines the driver launched come with the trainer ranks on their own GPUs
        remote = [ep.name for ep in endpoints if not ep.ipc_ranks and not is_local(ep.url)]
        if remote:
            log.info(
                "weight sync: %s not on this node, where the CUDA IPC handles are made; using disk",
                ", ".join(remote),
            )
            return "disk"
        return "cuda_ipc"
    if kind == "object_store":
        raise ConfigError(
            "trainer.weight_sync.transport=object_store is for HF engines in Ray actors; SGLang engines "
            "take nccl, cuda_ipc, disk or auto"
        )
    return kind


def sglang_transport(cfg, engines: Sequence[Any], backend: str = "nccl"):
    """The weight transport to `engines` chosen by `trainer.weight_sync.transport` (module docstring)."""
    endpoints = endpoints_of(engines, cfg.rollout.sglang.api_key)
    timeout = float(cfg.trainer.weight_sync.timeout_s)
    kind = resolve_transport_kind(cfg, endpoints, gpus=backend != "gloo")
    if kind == "cuda_ipc":
        if endpoints and all(ep.ipc_ranks for ep in endpoints):
            return SGLangRankIPCTransport(endpoints, timeout)
        return SGLangIPCTransport(endpoints, timeout)
    if kind == "nccl":
        return SGLangNCCLTransport(endpoints, timeout, backend=backend)
    directory = Path(cfg.trainer.runs_dir) / cfg.trainer.run_name / "weight_sync"
    return SGLangDiskTransport(endpoints, directory.resolve(), timeout, hf_metadata_dir=cfg.model.path)
