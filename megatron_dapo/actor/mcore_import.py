"""Importing this module imports megatron.core (and its GPT model) without wandb.

megatron-core imports wandb at module level (timers.py, inference/contexts/dynamic_context.py)
only to offer it as an optional metrics writer, which this project never hands it: our metrics go
through driver/run_dir.py, which imports wandb itself when logging.wandb is on. Each rank and Ray
actor process pays that import (about 1 s of CPU) for nothing, so it is hidden while megatron
loads: megatron falls back to `wandb = None`, exactly as when wandb is not installed, and nothing
it computes depends on it. wandb stays importable afterwards (the None entry is removed), and a
process that already imported wandb keeps it as it is.
"""

from __future__ import annotations

import sys


def _import_without_wandb() -> None:
    if "megatron.core.models.gpt" in sys.modules:
        return
    hide = "wandb" not in sys.modules
    if hide:
        sys.modules["wandb"] = None  # `import wandb` now raises ImportError
    try:
        import megatron.core  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
    finally:
        if hide and "wandb" in sys.modules and sys.modules["wandb"] is None:
            del sys.modules["wandb"]


_import_without_wandb()
