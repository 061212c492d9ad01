"""How the HF-named buckets from `weights.gather.iter_hf_buckets` reach the rollout engines.

The sender runs on the bucket holder of global rank 0 while every training rank iterates the
gather in lockstep (`ActorWorker.push_weights`). One transport (`sync.protocol.WeightTransport`)
per placement:
- `DirectTransport`: engines in this process (torchrun mode with the HF engine on rank 0).
- `RayObjectTransport`: engines as Ray actors (`EngineHost`), buckets through the object store;
  the CPU path, and small GPU runs with the HF engine.
- `DiskTransport`: the universal fallback: write an HF checkpoint, engines reload from disk.
SGLang's NCCL broadcast, CUDA IPC and disk transports are in `sync/sglang_transports.py`.
Every wait has a deadline, and a missed deadline names the engine and the bucket
(`WeightSyncTimeoutError`) instead of hanging the job.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.sync.protocol import WeightSyncTimeoutError, describe_bucket
from megatron_dapo.weights.hf_io import copy_hf_metadata


class DirectTransport:
    """Engines living in this process: buckets are handed over as they are."""

    every_rank = False

    def __init__(self, engines: list[Any]):
        self.engines = engines
        self._pending: list[dict[str, torch.Tensor]] = []

    def begin(self, version: int) -> None:
        self.version = version
        self._pending = []

    def send(self, index: int, bucket: dict[str, torch.Tensor]) -> None:
        # bucket tensors may be views of gather buffers that the next bucket reuses
        self._pending.append({k: v.detach().clone() for k, v in bucket.items()})

    def drop(self, names: set[str]) -> None:
        self.engines = [e for e in self.engines if e.name not in names]

    def reset(self) -> None:
        """Nothing to forget: every sync hands over whole buckets."""

    def finish(self) -> None:
        for engine in self.engines:
            engine.load_weights(self._pending, self.version)
        self._pending = []


class RayObjectTransport:
    """Engines are `EngineHost` Ray actors given as (name, handle) pairs."""

    every_rank = False

    def __init__(self, engines: list[tuple[str, Any]], timeout_s: float):
        self.engines = engines
        self.timeout_s = timeout_s

    def drop(self, names: set[str]) -> None:
        self.engines = [(n, h) for n, h in self.engines if n not in names]

    def reset(self) -> None:
        """Nothing to forget: every sync starts at the engine's own `begin_weight_update`."""

    def _wait(self, refs: list, what: str) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        deadline = time.monotonic() + self.timeout_s
        for (name, _), ref in zip(self.engines, refs):
            try:
                ray.get(ref, timeout=max(deadline - time.monotonic(), 0.001))
            except GetTimeoutError as e:
                raise WeightSyncTimeoutError(
                    f"weight sync: engine {name} did not take {what} within {self.timeout_s:.0f}s "
                    "(trainer.weight_sync.timeout_s); is the engine alive and not stuck generating?"
                ) from e

    def begin(self, version: int) -> None:
        self._wait([h.begin_weight_update.remote(version) for _, h in self.engines], "the update start")

    def send(self, index: int, bucket: dict[str, torch.Tensor]) -> None:
        import ray

        ref = ray.put(bucket)
        self._wait(
            [h.receive_bucket.remote(index, ref) for _, h in self.engines], describe_bucket(index, bucket)
        )

    def finish(self) -> None:
        self._wait([h.finish_weight_update.remote() for _, h in self.engines], "the update finish")


class DiskTransport:
    """Write the buckets as an HF safetensors checkpoint; engines reload it (`load_from_disk`)."""

    every_rank = False

    def __init__(
        self,
        engines: list[tuple[str, Any]],
        directory: str | Path,
        timeout_s: float,
        hf_metadata_dir: str | Path | None = None,
    ):
        self.engines = engines
        self.directory = Path(directory)
        self.timeout_s = timeout_s
        self.hf_metadata_dir = hf_metadata_dir

    def drop(self, names: set[str]) -> None:
        self.engines = [(n, e) for n, e in self.engines if n not in names]

    def reset(self) -> None:
        """Nothing to forget: every sync writes a whole checkpoint."""

    def begin(self, version: int) -> None:
        from safetensors.torch import save_file  # noqa: F401 - fail early if missing

        self.version = version
        self.target = self.directory / f"v{version}"
        self.target.mkdir(parents=True, exist_ok=True)
        self._names: dict[str, str] = {}

    def send(self, index: int, bucket: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        fname = f"model-{index:05d}.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in bucket.items()}, str(self.target / fname))
        self._names.update(dict.fromkeys(bucket, fname))

    def finish(self) -> None:
        import json

        (self.target / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": self._names}, indent=1)
        )
        if self.hf_metadata_dir:
            copy_hf_metadata(self.hf_metadata_dir, self.target)
        deadline = time.monotonic() + self.timeout_s
        for name, engine in self.engines:
            result = engine.load_from_disk(str(self.target), self.version)
            if time.monotonic() > deadline:
                raise WeightSyncTimeoutError(
                    f"weight sync: engine {name} took longer than {self.timeout_s:.0f}s to reload"
                )
            if result is False:
                raise RuntimeError(f"weight sync: engine {name} refused the checkpoint at {self.target}")
