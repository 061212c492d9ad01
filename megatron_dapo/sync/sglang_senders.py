"""Trainer-side sender of HF-named buckets to SGLang servers by NCCL broadcast (gloo on CPUs).

Disaggregated (``push_weights_distributed``): once per run, every server joins a process group
with the trainer's bucket holder (``/init_weights_update_group``: trainer rank 0, server TP
ranks from ``rank_offset``); then per bucket, the metadata goes over HTTP
(``/update_weights_from_distributed``: names, dtypes, shapes) while the tensors go by
``broadcast`` from rank 0. Both halves run concurrently (the server's handler blocks in the
broadcast), and every wait has a deadline whose error names the engine and the bucket.

The colocated path (CUDA IPC, ``/update_weights_from_tensor``) is ``sglang/ipc.py``.

Both sides run ``pause_generation`` -> ``flush_cache`` (once per sync, retried while requests
drain) -> updates -> ``continue_generation``. SGLang >= 0.5.21 refuses tensor/distributed updates
outside ``/begin_weight_update`` .. ``/end_weight_update``; the client opens that session with the
first update and closes it in ``continue_generation``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from datetime import timedelta

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
