"""Megatron checkpoints: megatron-core distributed checkpoints (torch_dist) of the model chunks.

Layout of a checkpoint directory (shared by the converter and the trainer's training checkpoints):

- the dist checkpoint of ``{"model": chunk.sharded_state_dict()}`` (with virtual pipeline stages,
  megatron's ``{"model0": ..., "model1": ...}``), plus whatever else the caller saves in the same
  call (``extra``: e.g. ``"optimizer"``, ``"rng"``, ``"iteration"``);
- ``config.json`` and the tokenizer files of the HF model (:func:`copy_hf_metadata`);
- ``megatron_dapo_model.json``: the layout it was written with (tp, pp, ep, vpp, params dtype,
  architecture), informative only, since dist checkpoints load into any layout.

Every rank of the world calls save/load (dist_checkpointing is collective).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.arch import arch_spec
from megatron_dapo.weights.hf_io import CheckpointError
from megatron_dapo.weights.hf_io import copy_hf_metadata as _copy_hf_metadata
from megatron_dapo.weights.model_io import hf_config_of, unwrap
from megatron_dapo.weights.orphan_guard import exit_with_parent

LAYOUT_FILE = "megatron_dapo_model.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def model_keys(num_chunks: int) -> list[str]:
    """Top-level state-dict keys of the model chunks: "model", or "model0".."modelN-1" with vpp."""
    return ["model"] if num_chunks == 1 else [f"model{i}" for i in range(num_chunks)]


def model_sharded_state_dict(model_chunks: list[Any]) -> dict[str, Any]:
    """``{"model": sharded_state_dict}`` (or model0.. with vpp) of the (unwrapped) chunks."""
    return {
        key: unwrap(chunk).sharded_state_dict()
        for key, chunk in zip(model_keys(len(model_chunks)), model_chunks)
    }


def copy_hf_metadata(hf_dir: str | os.PathLike, ckpt_dir: str | os.PathLike) -> list[str]:
    """Copy config.json, generation config and tokenizer files of ``hf_dir`` into ``ckpt_dir``."""
    return _copy_hf_metadata(hf_dir, ckpt_dir)


def _layout_record(model_chunks: list[Any]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    first = unwrap(model_chunks[0])
    dtype = next(first.parameters()).dtype
    return {
        "format": "megatron-core torch_dist",
        "model_keys": model_keys(len(model_chunks)),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "vpp": len(model_chunks) if len(model_chunks) > 1 else None,
        "params_dtype": _DTYPE_NAMES.get(dtype, str(dtype)),
        "architecture": arch_spec(hf_config_of(model_chunks)).architecture,
    }


def save_model_checkpoint(
    model_chunks: list[Any],
    ckpt_dir: str | os.PathLike,
    hf_dir: str | os.PathLike | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save the model chunks (and ``extra`` sharded/common state) as one dist checkpoint.

    ``hf_dir``: copy its config.json and tokenizer files next to the weights (rank 0), so the
    checkpoint converts back to HF on its own.
    """
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = model_sharded_state_dict(model_chunks)
    if extra:
        clash = set(extra) & set(state)
        if clash:
            raise ValueError(f"extra state uses reserved model keys {sorted(clash)}")
        state.update(extra)
    _guard_writer_results_queue()
    dist_checkpointing.save(state, str(ckpt_dir))
    if dist.get_rank() == 0:
        (ckpt_dir / LAYOUT_FILE).write_text(json.dumps(_layout_record(model_chunks), indent=2) + "\n")
        if hf_dir is not None:
            copy_hf_metadata(hf_dir, ckpt_dir)
    dist.barrier()


def _guard_writer_results_queue() -> None:
    """Start megatron-core's writer results queue ourselves, in a Manager process that exits
    with this rank (weights/orphan_guard.py says why); megatron then reuses it."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is not None:
        return  # already made (by us or by megatron), or a megatron-core without it
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(exit_with_parent, (os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    _managers.append(manager)  # shut down at exit by its finalizer; the queue's proxy needs it alive


_managers: list[Any] = []


def is_dist_checkpoint(ckpt_dir: str | os.PathLike) -> bool:
    return (Path(ckpt_dir) / "metadata.json").is_file()


def read_layout(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """The layout record of a checkpoint ({} when it was not written by megatron-dapo)."""
    path = Path(ckpt_dir) / LAYOUT_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def load_model_checkpoint(model_chunks: list[Any], ckpt_dir: str | os.PathLike) -> None:
    """Load only the model keys of the dist checkpoint in ``ckpt_dir`` into the chunks, whatever
    TP/PP/VPP layout it was saved with (other keys, e.g. the optimizer, are not read)."""
    from megatron.core import dist_checkpointing

    if not is_dist_checkpoint(ckpt_dir):
        raise CheckpointError(
            f"{ckpt_dir} is not a megatron-core distributed checkpoint (no metadata.json); "
            "write one with `megatron-dapo convert hf-to-megatron`"
        )
    state = model_sharded_state_dict(model_chunks)
    try:
        loaded = dist_checkpointing.load(state, str(ckpt_dir))
    except Exception as e:
        raise CheckpointError(f"cannot load the model from {ckpt_dir}: {e}") from e
    for key, chunk in zip(model_keys(len(model_chunks)), model_chunks):
        unwrap(chunk).load_state_dict(loaded[key])
