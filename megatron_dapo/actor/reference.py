"""The frozen reference policy of a KL term: the run's initial weights, in the actor's layout.

It is built like the actor (same megatron model, same TP/PP/CP/EP layout, same rank) from the
same initial weights (the HF checkpoint, or ``model.megatron_path``), but with no DDP wrapper, no
gradients and no optimizer, and it is never written by a resume: a resumed run still compares
against the weights it started from. The actor scores a batch with it in the same forward-only
pass schedule as pi_old (``Actor.score``).

On a GPU its parameters live in host memory between uses and come to the device only for that
pass, as megatron's offload does with the actor's optimizer state for the colocated engines. On
the CPU path there is no device memory to give back, so nothing moves (the one CPU/GPU
difference of this module).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_dapo.actor import compat


def freeze(model_chunks: list[Any]) -> list[Any]:
    """The chunks with every parameter frozen (no gradients, evaluation mode)."""
    for chunk in model_chunks:
        chunk.eval()
        for p in chunk.parameters():
            p.requires_grad_(False)
    return model_chunks


def move_parameters(model_chunks: list[Any], device: torch.device | str) -> int:
    """Move every parameter's storage to ``device`` (into pinned host memory when it leaves a
    GPU, so both ways are asynchronous copies, waited for once at the end); returns the bytes
    moved. The Parameter objects stay, with megatron's attributes on them (tensor-parallel
    partition, expert flags); buffers (RoPE frequencies, FP8 scales) are small and stay put."""
    device = torch.device(device)
    moved = 0
    for chunk in model_chunks:
        for p in chunk.parameters():
            if p.device == device:
                continue
            if device.type == "cpu":
                host = torch.empty(p.shape, dtype=p.dtype, pin_memory=torch.cuda.is_available())
                p.data = host.copy_(p.data, non_blocking=True)
            else:
                p.data = p.data.to(device, non_blocking=True)
            moved += p.numel() * p.element_size()
    if moved and torch.cuda.is_available():
        torch.cuda.synchronize()
    return moved


class ReferenceModel:
    """The reference policy's model chunks, parked in host memory between uses on a GPU."""

    def __init__(self, model_chunks: list[Any], offload: bool | None = None):
        self.chunks = freeze(model_chunks)
        # nothing to give back on the CPU path
        self.offload = (not compat.on_cpu()) if offload is None else offload
        self.param_bytes = sum(p.numel() * p.element_size() for c in self.chunks for p in c.parameters())
        if self.offload:
            move_parameters(self.chunks, "cpu")

    @contextmanager
    def on_device(self) -> Iterator[list[Any]]:
        """The chunks with their parameters on the compute device for the body of the block."""
        if self.offload:
            move_parameters(self.chunks, compat.device())
        try:
            yield self.chunks
        finally:
            if self.offload:
                move_parameters(self.chunks, "cpu")
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
