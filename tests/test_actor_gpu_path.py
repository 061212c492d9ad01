"""GPU-path defects that CPU tests can pin down without a GPU: each test names the defect of
issue 12 it guards and fails on the code before the fix."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_weight_sync_gathers_onto_the_parameters_device():
    """Defect 12: the gather list was allocated on CPU while NCCL gathers CUDA parameters. A
    meta-device parameter stands in for a CUDA one: the buffers must follow its device."""
    bench = _tool("bench_weight_sync")
    param = torch.empty(3, 5, dtype=torch.bfloat16, device="meta")
    bufs = bench.gather_buffers(param, 2)
    assert len(bufs) == 2
    assert all(b.device == param.device and b.dtype == param.dtype and b.shape == param.shape for b in bufs)


def test_dockerfile_transformers_accepts_the_dtype_argument():
    """Defect 13: the code calls ``from_pretrained(..., dtype=...)``, added in transformers 4.56
    (huggingface/transformers#39782); older releases pass ``dtype`` on to the model config,
    silently loading in the checkpoint's default dtype."""
    text = (REPO / "Dockerfile").read_text()
    (pin,) = re.findall(r'"transformers==(\d+)\.(\d+)\.(\d+)"', text)
    assert tuple(int(x) for x in pin) >= (4, 56, 0), pin
