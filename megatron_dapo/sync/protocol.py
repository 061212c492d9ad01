"""What every weight transport does, and what they share: the timeout error, the bucket's
description in errors, and the sync's metrics.

`ActorWorker.push_weights` runs one weight version through a transport: `begin(version)`, then
`send(index, bucket)` for every HF-named bucket of `weights.gather.iter_hf_buckets`, then
`finish()`. The driver tells it about engines that changed between syncs: `drop(names)` for
engines the run goes on without, `reset()` after an engine was restarted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from megatron_dapo.rollout.engine import EngineError


class WeightSyncTimeoutError(EngineError):
    """An engine did not take a bucket, or a collective did not complete, in time; names the
    engine, the bucket and the deadline instead of hanging the job."""


@runtime_checkable
class WeightTransport(Protocol):
    """Carries one weight version's buckets to the rollout engines.

    `every_rank` False: only global rank 0 (a bucket holder) runs it, with every bucket. True: every
    trainer rank runs it, in lockstep (rank 0 with the buckets, the others with None), for a
    transport that makes a copy on each rank (CUDA IPC handles from each engine's own GPUs).
    """

    every_rank: bool

    def begin(self, version: int) -> None:
        """Before the first bucket of `version` (engines paused, a group formed ...)."""

    def send(self, index: int, bucket: dict[str, torch.Tensor] | None) -> None:
        """One bucket; it may be a view of a gather buffer that the next bucket reuses."""

    def finish(self) -> None:
        """After the last bucket: the engines serve `version`."""

    def drop(self, names: set[str]) -> None:
        """Stop sending to these engines: the run goes on without them."""

    def reset(self) -> None:
        """An engine was restarted: forget per-server state (a weight-update group)."""


@dataclass
class SyncStats:
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    engines: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        return {
            "sync/buckets": self.buckets,
            "sync/tensors": self.tensors,
            "sync/gbytes": self.bytes / 1e9,
            "sync/seconds": self.seconds,
        }


def bucket_nbytes(bucket: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in bucket.values())


def describe_bucket(index: int, bucket: dict[str, torch.Tensor]) -> str:
    """How errors name a bucket: its index, size and first and last tensor."""
    names = list(bucket)
    span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
    return f"bucket {index} ({len(names)} tensors, {bucket_nbytes(bucket) / 2**20:.1f} MiB: {span})"
