"""Checkpoint conversion HF <-> Megatron dist checkpoint, launching the ranks it needs.

Both directions validate their input in the calling process first (missing files, unsupported
or mismatching architecture, corrupt safetensors headers) so bad input fails before any rank
starts, then write into a temporary sibling directory that is renamed into place only when every
rank has finished.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megatron_dapo.actor.model import build_gpt_model, transformer_config_from_hf
from megatron_dapo.actor.parallel import destroy_parallel, init_parallel
from megatron_dapo.actor.spawn import run_ranks
from megatron_dapo.arch import arch_spec, load_hf_config
from megatron_dapo.weights.atomic import atomic_directory
from megatron_dapo.weights.dist_ckpt import (
    is_dist_checkpoint,
    load_model_checkpoint,
    read_layout,
    save_model_checkpoint,
)
from megatron_dapo.weights.hf_io import CheckpointError, SafetensorsReader
from megatron_dapo.weights.load import load_hf_weights
from megatron_dapo.weights.plan import expected_hf_shapes
from megatron_dapo.weights.save_hf import save_hf_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_dtype(hf_dir: str | os.PathLike) -> str:
    """The dtype an HF config.json declares (``dtype`` or ``torch_dtype``), float32 if none."""
    data = json.loads((Path(hf_dir) / "config.json").read_text())
    name = data.get("dtype") or data.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise CheckpointError(f"{hf_dir}/config.json: dtype {name!r} is not one of {sorted(DTYPES)}")
    return name


def _check_hf_dir(hf_dir: str | os.PathLike):

    config = load_hf_config(hf_dir)
    arch_spec(config)
    reader = SafetensorsReader(hf_dir)  # opens index + headers: names missing/corrupt files
    for name, shape in expected_hf_shapes(config).items():
        got = reader.shape(name)
        if got != shape:
            raise CheckpointError(
                f"{hf_dir}: tensor {name!r} has shape {got}, but config.json implies {shape}"
            )
    return config


def _hf_to_megatron_rank(rank, world, hf_dir, out_dir, tp, pp, vpp, dtype, progress, ep=1):

    init_parallel(tp=tp, pp=pp, vpp=vpp, ep=ep)
    chunks = build_gpt_model(load_hf_config(hf_dir), params_dtype=DTYPES[dtype], perform_initialization=False)
    load_hf_weights(chunks, hf_dir, progress=progress)
    save_model_checkpoint(chunks, out_dir, hf_dir=hf_dir)
    destroy_parallel()


def hf_to_megatron(
    hf_dir: str | os.PathLike,
    megatron_dir: str | os.PathLike,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    dtype: str = "auto",
    overwrite: bool = False,
    progress: bool = True,
    ep: int = 1,
) -> Path:
    """Convert an HF checkpoint into a Megatron dist checkpoint written at layout TP x PP (x VPP),
    MoE experts split over ``ep`` expert-parallel ranks; runs ``tp * pp * ep`` local ranks.
    Returns the checkpoint directory."""

    config = _check_hf_dir(hf_dir)
    dtype = hf_dtype(hf_dir) if dtype == "auto" else dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    transformer_config_from_hf(config, tp=tp, pp=pp, vpp=vpp)  # layout errors before launching
    if ep > 1 and arch_spec(config).num_experts % ep:
        raise ValueError(f"ep={ep} does not divide the model's num_experts={arch_spec(config).num_experts}")
    with atomic_directory(megatron_dir, overwrite) as tmp:
        run_ranks(_hf_to_megatron_rank, tp * pp * ep, str(hf_dir), str(tmp), tp, pp, vpp, dtype, progress, ep)
    return Path(megatron_dir)


def _megatron_to_hf_rank(rank, world, megatron_dir, out_dir, config_dir, dtype, max_shard_bytes, progress):

    init_parallel(tp=1, pp=1)
    chunks = build_gpt_model(
        load_hf_config(config_dir), params_dtype=DTYPES[dtype], perform_initialization=False
    )
    load_model_checkpoint(chunks, megatron_dir)
    save_hf_checkpoint(chunks, out_dir, config_dir, max_shard_bytes=max_shard_bytes, progress=progress)
    destroy_parallel()


def megatron_to_hf(
    megatron_dir: str | os.PathLike,
    hf_dir: str | os.PathLike,
    hf_config_dir: str | os.PathLike | None = None,
    dtype: str = "auto",
    overwrite: bool = False,
    max_shard_bytes: int = 5 << 30,
    progress: bool = True,
) -> Path:
    """Convert a Megatron dist checkpoint (from the converter or a training checkpoint, any
    TP/PP layout) into an HF safetensors directory, on one CPU process. The HF config and
    tokenizer come from ``hf_config_dir`` or, by default, the copies inside ``megatron_dir``."""

    megatron_dir = Path(megatron_dir)
    if not megatron_dir.is_dir():
        raise CheckpointError(f"Megatron checkpoint directory not found: {megatron_dir}")
    if not is_dist_checkpoint(megatron_dir):
        raise CheckpointError(
            f"{megatron_dir} is not a megatron-core distributed checkpoint (no metadata.json)"
        )
    config_dir = Path(hf_config_dir) if hf_config_dir else megatron_dir
    if not (config_dir / "config.json").is_file():
        raise CheckpointError(
            f"no config.json in {config_dir}; pass --hf-config-dir with the HF model's config and tokenizer"
        )
    config = load_hf_config(config_dir)
    layout = read_layout(megatron_dir)
    arch = arch_spec(config).architecture
    if layout.get("architecture") and layout["architecture"] != arch:
        raise CheckpointError(
            f"{megatron_dir} holds a {layout['architecture']} model but {config_dir}/config.json is {arch}"
        )
    if dtype == "auto":
        dtype = layout.get("params_dtype") or hf_dtype(config_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
    with atomic_directory(hf_dir, overwrite) as tmp:
        run_ranks(
            _megatron_to_hf_rank,
            1,
            str(megatron_dir),
            str(tmp),
            str(config_dir),
            dtype,
            max_shard_bytes,
            progress,
        )
    return Path(hf_dir)
