"""Accelerators the planner knows: memory, dense BF16 peak and HBM bandwidth (datasheet values)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    bf16_tflops: float  # dense, no sparsity
    hbm_tb_s: float


GPUS: dict[str, GPU] = {
    "h100": GPU("H100 80GB SXM", 80.0, 989.0, 3.35),
    "h200": GPU("H200 141GB SXM", 141.0, 989.0, 4.8),
    "a100": GPU("A100 80GB SXM", 80.0, 312.0, 2.04),
}


def gpu_for(name: str = "h100", memory_gib: float | None = None) -> GPU:
    """The table entry for `name`, with its memory replaced by `memory_gib` when given."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; use one of {', '.join(GPUS)} (and --gpu-mem-gb for others)")
    gpu = GPUS[key]
    if memory_gib is None:
        return gpu
    if memory_gib <= 0:
        raise ValueError(f"--gpu-mem-gb={memory_gib} must be > 0")
    return GPU(f"{gpu.name} ({memory_gib:g} GiB)", memory_gib, gpu.bf16_tflops, gpu.hbm_tb_s)
