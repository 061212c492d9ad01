"""megatron-core's warnings that are expected on the CPU path, said once instead of per worker.

Without Transformer Engine and Apex (neither exists for CPU) megatron-core falls back to its own
local implementations and says so at import, in every Ray worker, along with two GPU-only tuning
hints. On CPU they are the design, not a problem: the workers ignore exactly these messages
(``PYTHONWARNINGS`` in their environment) and the driver prints ``CPU_NOTE`` once. Every other
warning still shows. On GPUs nothing is filtered: a missing Transformer Engine matters there.
"""

from __future__ import annotations

import os

# message prefixes, as the warnings module matches them (start of the message, case-insensitive)
KNOWN_CPU_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
)
CPU_NOTE = (
    "megatron-core on CPU: Transformer Engine and Apex are absent, so it uses its local implementations "
    "(optimizer, norms, grad clipping); its warnings saying so are hidden"
)


def pythonwarnings(existing: str | None = None) -> str:
    """A ``PYTHONWARNINGS`` value that ignores the known CPU warnings, after any ``existing`` filters."""
    ours = [f"ignore:{msg}:UserWarning" for msg in KNOWN_CPU_WARNINGS]
    return ",".join([existing, *ours] if existing else ours)


def worker_env() -> dict[str, str]:
    return {"PYTHONWARNINGS": pythonwarnings(os.environ.get("PYTHONWARNINGS"))}
