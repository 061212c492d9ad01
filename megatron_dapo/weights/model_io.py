"""Shared helpers to look inside (possibly wrapped) Megatron model chunks."""

from __future__ import annotations

from typing import Any


def unwrap(chunk: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def hf_config_of(model_chunks: list[Any]) -> Any:
    cfg = getattr(unwrap(model_chunks[0]), "hf_config", None)
    if cfg is None:
        raise ValueError("model chunks carry no hf_config; build them with actor.model.build_gpt_model")
    return cfg


def padded_vocab_of(model_chunks: list[Any]) -> int:
    return unwrap(model_chunks[0]).vocab_size
