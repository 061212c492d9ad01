"""Live Megatron model chunks -> an HF safetensors checkpoint directory (via the sync gather)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megatron_dapo.weights.atomic import atomic_directory
from megatron_dapo.weights.gather import is_bucket_holder, iter_hf_buckets
from megatron_dapo.weights.hf_io import ShardedSafetensorsWriter, copy_hf_metadata
from megatron_dapo.weights.model_io import hf_config_of, unwrap
from megatron_dapo.weights.plan import expected_hf_names
from megatron_dapo.weights.progress import progress_bar


def save_hf_checkpoint(
    model_chunks: list[Any],
    out_dir: str | os.PathLike,
    hf_metadata_dir: str | os.PathLike | None = None,
    *,
    max_shard_bytes: int = 5 << 30,
    bucket_bytes: int = 512 << 20,
    progress: bool = False,
    write: bool = True,
) -> list[str] | None:
    """Write the model as HF safetensors into ``out_dir`` (on the bucket holder; call on every
    model-parallel rank). Copies config.json/tokenizer from ``hf_metadata_dir`` (or writes the
    chunks' HF config) and records the parameter dtype in config.json. Returns the weight files
    on the holder, None elsewhere. With ``write=False`` the rank only takes part in the gather."""
    hf_config = hf_config_of(model_chunks)
    holder = is_bucket_holder() and write
    writer = ShardedSafetensorsWriter(out_dir, max_shard_bytes) if holder else None
    with progress_bar(progress and holder, len(expected_hf_names(hf_config)), "writing HF tensors") as step:
        for bucket in iter_hf_buckets(model_chunks, bucket_bytes=bucket_bytes):
            if writer is not None:
                writer.add(bucket)
                step(len(bucket))
    if writer is None:
        return None
    files = writer.close()
    out = Path(out_dir)
    if hf_metadata_dir is not None:
        copy_hf_metadata(hf_metadata_dir, out)
    else:
        hf_config.save_pretrained(str(out))
    dtype = str(next(unwrap(model_chunks[0]).parameters()).dtype).removeprefix("torch.")
    _set_config_dtype(out / "config.json", dtype)
    return files


def _set_config_dtype(config_file: Path, dtype: str) -> None:
    data = json.loads(config_file.read_text())
    keys = [k for k in ("dtype", "torch_dtype") if k in data] or ["torch_dtype"]
    for k in keys:
        data[k] = dtype
    config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def export_hf_checkpoint(
    model_chunks: list[Any], out_dir: str | os.PathLike, hf_metadata_dir: str | os.PathLike | None = None
) -> str | None:
    """Collective over every actor rank: write the model as an HF checkpoint at ``out_dir``
    (atomically). Only the first data-parallel replica gathers; global rank 0, its bucket holder,
    writes. Other replicas hold the same weights, so gathering there would only repeat the whole
    transfer (once per DP replica). With expert parallelism one copy of the experts is spread over
    the first expert-data-parallel replica, which spans EP data-parallel replicas: those ranks
    gather too (rank 0's expert gather waits for them otherwise), but only rank 0 writes (another
    replica's model-parallel rank 0 is a bucket holder too). Returns ``out_dir`` on global rank 0,
    None elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    result = None
    if dist.get_rank() == 0:
        with atomic_directory(out_dir, overwrite=True) as tmp:
            save_hf_checkpoint(model_chunks, tmp, hf_metadata_dir=hf_metadata_dir)
        result = str(out_dir)
    elif ps.get_data_parallel_rank(with_context_parallel=True) == 0 or (
        ps.get_expert_model_parallel_world_size() > 1 and ps.get_expert_data_parallel_rank() == 0
    ):
        # TP/PP peers of rank 0 (and at EP > 1 its EP peers in other replicas) take part in the
        # gather; only rank 0 writes files.
        save_hf_checkpoint(model_chunks, out_dir, hf_metadata_dir=hf_metadata_dir, write=False)
    dist.barrier()
    return result
