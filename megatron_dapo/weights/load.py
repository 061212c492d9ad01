"""HF safetensors -> this rank's TP/PP shards of live Megatron model chunks."""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_dapo.arch import arch_spec, load_hf_config
from megatron_dapo.weights.hf_io import CheckpointError, SafetensorsReader
from megatron_dapo.weights.layout import READERS
from megatron_dapo.weights.model_io import hf_config_of, padded_vocab_of
from megatron_dapo.weights.plan import bind, dims_of, is_expert
from megatron_dapo.weights.progress import progress_bar

_CHECKED_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "tie_word_embeddings",
)


def check_same_architecture(model_config: Any, ckpt_config: Any, where: str) -> None:
    """Raise CheckpointError naming the first field where the checkpoint's config differs."""

    a, b = arch_spec(model_config).architecture, arch_spec(ckpt_config).architecture
    if a != b:
        raise CheckpointError(f"{where}: architecture {b} does not match the model's {a}")
    for field in _CHECKED_FIELDS:
        x, y = getattr(model_config, field, None), getattr(ckpt_config, field, None)
        if x != y:
            raise CheckpointError(f"{where}: config {field}={y} does not match the model's {field}={x}")


def load_hf_weights(
    model_chunks: list[Any],
    hf_dir: str | os.PathLike,
    *,
    progress: bool = False,
) -> int:
    """Copy the HF checkpoint in ``hf_dir`` into this rank's parameters; returns bytes read.

    Reads only this rank's slices. Raises CheckpointError for a config that does not match the
    model (naming the field), a missing tensor, a shape mismatch (naming both tensor names) or an
    unreadable safetensors file (naming it).
    """
    from megatron.core import parallel_state as ps

    model_config = hf_config_of(model_chunks)
    check_same_architecture(model_config, load_hf_config(hf_dir), str(hf_dir))
    reader = SafetensorsReader(hf_dir)
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    # Experts are split over the expert-tensor-parallel group (megatron's ETP, = TP here).
    etp, erank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    dims = dims_of(model_config, padded_vocab_of(model_chunks))
    bindings = bind(model_chunks, model_config)
    total = 0
    with progress_bar(progress, len(bindings), f"loading {hf_dir}") as advance:
        for b in bindings:
            size, at = (etp, erank) if is_expert(b) else (tp, rank)
            shard = READERS[b.kind](reader, b.hf_names, size, at, dims)
            if tuple(shard.shape) != tuple(b.param.shape):
                raise CheckpointError(
                    f"shape mismatch for {', '.join(b.hf_names)} -> {b.megatron_name}: checkpoint gives "
                    f"{tuple(shard.shape)} for TP rank {at}/{size}, the model expects {tuple(b.param.shape)}"
                )
            with torch.no_grad():
                b.param.data.copy_(shard)
            total += shard.numel() * shard.element_size()
            advance()
    return total
