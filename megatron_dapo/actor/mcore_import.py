"""Importing this module imports megatron.core (and its GPT model) without wandb.

megatron-core imports wandb at module level (timers.py, inference/contexts/dynamic_context.py)
only to offer it as an optional metrics writer, which this project never hands it: our metrics go
through driver/run_dir.py, which imports wandb itself when logging.wandb is on. Each rank and Ray
actor process pays that import (about 1 s of CPU) for nothing, so it is hidden while megatron
loads: megatron falls back to `wandb = None`, exactly as when wandb is not installed, and nothing
it computes depends on it. wandb stays importable afterwards (the None entry is removed), and a
process that already imported wandb keeps it as it is.

On a machine without CUDA, megatron also loads without the compiler: its ``jit_fuser`` is
``torch.compile``, applied at import to fused kernels (bias-GeLU/SwiGLU/GeGLU, gated attention,
grouped-GEMM experts) that the CPU path never runs (gpu_settings.fusion_flags turns them off), and
that import pulls in torch._dynamo and torch._inductor: 1.4 s of the 2.4 s megatron takes to load
in every rank and Ray actor. While megatron loads, ``torch.compile`` returns what it is given;
afterwards it is torch's again, and megatron's own switch (``disable_jit_fuser``) keeps the
decorators it applies later, at model build, eager too. On CUDA nothing changes.
"""

from __future__ import annotations

import sys

from megatron_dapo.notices import route_from_environment


def _import_without_wandb() -> None:
    if "megatron.core.models.gpt" in sys.modules:
        return
    # megatron's CPU notices go where the process's environment says (a run's or convert's log),
    # also in processes nothing else routes in, such as the ranks' forkserver
    route_from_environment()
    import torch

    hide = "wandb" not in sys.modules
    if hide:
        sys.modules["wandb"] = None  # `import wandb` now raises ImportError
    eager = not torch.cuda.is_available()
    compile_ = torch.compile
    if eager:
        torch.compile = _eager_compile
    try:
        import megatron.core  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        from megatron.core import jit

        if eager:
            jit.disable_jit_fuser()
    finally:
        torch.compile = compile_
        if hide and "wandb" in sys.modules and sys.modules["wandb"] is None:
            del sys.modules["wandb"]


def _eager_compile(model=None, **_options):
    """``torch.compile``'s two call forms (``compile(fn)`` and ``compile(**options)(fn)``), eager."""
    return model if model is not None else (lambda fn: fn)


_import_without_wandb()
