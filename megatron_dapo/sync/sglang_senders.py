"""Trainer-side senders of HF-named buckets to SGLang servers: NCCL broadcast and CUDA IPC.

Disaggregated (``push_weights_distributed``): once per run, every server joins a process group
with the trainer's bucket holder (``/init_weights_update_group``: trainer rank 0, server TP
ranks from ``rank_offset``); then per bucket, the metadata goes over HTTP
(``/update_weights_from_distributed``: names, dtypes, shapes) while the tensors go by
``broadcast`` from rank 0. Both halves run concurrently (the server's handler blocks in the
broadcast), and every wait has a deadline whose error names the engine and the bucket.

Colocated (``push_weights_ipc``): each bucket's tensors are pickled with
``multiprocessing.reduction.ForkingPickler`` (torch's reductions turn CUDA tensors into IPC
handles), base64-encoded, one copy per server TP rank, and posted to
``/update_weights_from_tensor``, which is how SGLang's ``MultiprocessingSerializer`` expects
them. SGLang's own reduction patch (device UUIDs instead of indices, for differing
``CUDA_VISIBLE_DEVICES``) is applied when sglang is importable; sglang is imported only there.

Both sides run ``pause_generation`` -> ``flush_cache`` (once per sync, retried while requests
drain) -> updates -> ``continue_generation``. SGLang >= 0.5.21 refuses tensor/distributed updates
outside ``/begin_weight_update`` .. ``/end_weight_update``; the client opens that session with the
first update and closes it in ``continue_generation``. CPU tensors (a CPU server on the same host)
go through ``/update_weights_from_tensor`` as shared-memory files (``file_system`` strategy).
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist

from megatron_dapo.sync.protocol import WeightSyncTimeoutError, describe_bucket


def broadcast_bucket(
    bucket: dict[str, torch.Tensor],
    group,
    *,
    src: int = 0,
    timeout_s: float = 600.0,
    engine: str = "?",
    bucket_index: int = 0,
) -> None:
    """Broadcast every tensor of ``bucket`` from ``src`` in ``group``; receivers pass tensors to fill.

    Raises :class:`WeightSyncTimeoutError` naming ``engine`` and the bucket when the collectives
    do not complete within ``timeout_s`` (a dead or stuck receiver), instead of hanging.
    """
    deadline = time.monotonic() + timeout_s
    works = [dist.broadcast(t, src=src, group=group, async_op=True) for t in bucket.values()]
    for name, work in zip(bucket, works):
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            ok = work.wait(timeout=timedelta(seconds=remaining))
        except RuntimeError as e:
            raise WeightSyncTimeoutError(
                f"weight sync to engine {engine}: broadcast of {describe_bucket(bucket_index, bucket)} failed at "
                f"{name!r} within {timeout_s:g}s: {e}"
            ) from e
        if ok is False:
            raise WeightSyncTimeoutError(
                f"weight sync to engine {engine}: broadcast of {describe_bucket(bucket_index, bucket)} timed out at "
                f"{name!r} after {timeout_s:g}s"
            )


def init_custom_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "nccl",
    timeout_s: float = 600.0,
):
    """A process group outside the default one (the trainer's own world is untouched).

    The same construction SGLang uses on its side of ``/init_weights_update_group``: a TCP store
    at ``master_address:master_port`` that rank 0 hosts, prefixed by ``group_name``, and a
    backend-specific group over all ``world_size`` ranks. The store is made directly, not by
    ``rendezvous("tcp://...")``: under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) that makes rank
    0 a client of a store nobody hosts, and the group never forms.
    """
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(
        master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True
    )
    pg, _ = _new_process_group_helper(
        world_size, rank, [], backend, PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def serialize_bucket_for_ipc(bucket: dict[str, torch.Tensor], tp_size: int = 1) -> list[str]:
    """SGLang's ``serialized_named_tensors``: base64 ForkingPickler bytes of [(name, tensor)], per TP rank."""
    _patch_reductions_like_sglang()
    buf = io.BytesIO()
    # CPU tensors are copied: pickling moves a storage into shared memory in place
    named = [
        (name, t.detach().clone() if t.device.type == "cpu" else t.detach()) for name, t in bucket.items()
    ]
    # CPU tensors travel as shared-memory files the server opens by name; the default strategy
    # passes file descriptors over a multiprocessing connection, which HTTP is not. Only the
    # pickling needs it (the files live as long as the tensors), so the process setting is restored.
    # The sender keeps a torch_shm_manager daemon; whoever owns the process ends it.
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        ForkingPickler(buf).dump(named)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return [data] * tp_size


def _patch_reductions_like_sglang() -> None:
    """Use SGLang's CUDA-tensor reduction patch when it is installed (GPU runs only)."""
    for module in ("sglang.srt.utils.patch_torch", "sglang.srt.patch_torch"):
        try:
            patch = __import__(
                module, fromlist=["monkey_patch_torch_reductions"]
            ).monkey_patch_torch_reductions
        except (ImportError, AttributeError):
            continue
        patch()
        return


def push_weights_ipc(engine, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> int:
    """Colocated update of one :class:`~megatron_dapo.sglang.client.SGLangEngine`; returns buckets sent."""
    client = engine.client
    engine.run(client.pause_generation("abort"))
    engine.run(client.flush_cache())
    sent = 0
    try:
        for bucket in buckets:
            # CUDA tensors go as IPC handles, CPU tensors (a CPU server on this host) as shm files
            # the tensors must stay alive until the server has copied them: the reply comes after that
            engine.run(
                client.update_weights_from_tensor(serialize_bucket_for_ipc(bucket, engine.tp_size), version)
            )
            sent += 1
    finally:
        engine.run(client.continue_generation())
    return sent


def push_weights_distributed(
    engines: Sequence,
    buckets: Iterable[dict[str, torch.Tensor]],
    version: int,
    group,
    group_name: str,
    timeout_s: float = 600.0,
) -> int:
    """Disaggregated update of ``engines`` (all in ``group``, the trainer as rank 0); returns buckets sent."""
    for e in engines:
        e.run(e.client.pause_generation("abort"))
        e.run(e.client.flush_cache())
    sent = 0
    try:
        for index, bucket in enumerate(buckets):
            replies: list[tuple[str, Future]] = [
                (e.name, e.submit(e.client.update_weights_from_distributed(bucket, version, group_name)))
                for e in engines
            ]
            names = ",".join(e.name for e in engines)
            broadcast_bucket(bucket, group, timeout_s=timeout_s, engine=names, bucket_index=index)
            deadline = time.monotonic() + timeout_s
            for name, fut in replies:
                try:
                    fut.result(timeout=max(deadline - time.monotonic(), 0.001))
                except TimeoutError as e:
                    raise WeightSyncTimeoutError(
                        f"weight sync: engine {name} did not confirm {describe_bucket(index, bucket)} within {timeout_s:g}s"
                    ) from e
            sent += 1
    finally:
        for e in engines:
            e.run(e.client.continue_generation())
    for e in engines:
        e.weight_version = version
    return sent
