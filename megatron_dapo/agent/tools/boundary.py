"""Which boundary each tool runs behind, checked before a run starts (fail closed).

The ``python`` builtin runs behind the kernel sandbox (:mod:`.sandbox`) unless its entry says
``sandbox: none``; a function tool runs in the tool workers as trusted code unless its entry asks
for the sandbox (``sandbox: {read: [...]}``); the calculator and verl class tools are trusted code.
:func:`require_boundaries` probes the sandbox once when any tool needs it and stops the run in one
line when it cannot be made; every opt-out is warned about at every start and written into the
run's ``tool_boundaries.json``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from megatron_dapo.agent.tools.sandbox import Probe, Sandbox, probe
from megatron_dapo.agent.tools.spec import ToolConfigError, ToolSpec

__all__ = ["SANDBOXED", "boundary_of", "require_boundaries", "write_boundaries"]

log = logging.getLogger(__name__)

SANDBOXED = "sandbox (bwrap namespaces + rlimits)"
OPTED_OUT = "none: `sandbox: none` in the tool YAML (trusted code only)"
TRUSTED = "tool worker process (trusted code)"


def boundary_of(spec: ToolSpec) -> str:
    """The boundary ``spec``'s calls run behind (one of the module's constants)."""
    if spec.kind == "builtin" and spec.target == "python":
        return OPTED_OUT if spec.config.get("sandbox", "bwrap") == "none" else SANDBOXED
    if spec.kind == "function" and spec.config.get("sandbox") is not None:
        return SANDBOXED
    return TRUSTED


def require_boundaries(specs: Iterable[ToolSpec], *, sandbox_probe: Probe | None = None) -> dict[str, str]:
    """``{tool name: boundary}``; raises ToolConfigError (one line: the cause and the ways out) when
    a tool needs the sandbox and this machine cannot make it. ``sandbox_probe``: a probe already
    made (tests simulate a machine without user namespaces with one)."""
    boundaries = {spec.name: boundary_of(spec) for spec in specs}
    if SANDBOXED in boundaries.values():
        found = sandbox_probe or probe(Sandbox())
        if not found.ok:
            needing = ", ".join(sorted(n for n, b in boundaries.items() if b == SANDBOXED))
            raise ToolConfigError(f"tool {needing}: {found.detail}")
    for name, boundary in boundaries.items():
        if boundary == OPTED_OUT:
            log.warning(
                "tool %s runs model-written code WITHOUT the sandbox (`sandbox: none` in the tool YAML): "
                "it can read, change and signal whatever this trainer can",
                name,
            )
    return boundaries


def write_boundaries(boundaries: dict[str, str], run_root: str | Path) -> Path:
    """The run's record of what each tool ran behind (``runs/NAME/tool_boundaries.json``)."""
    path = Path(run_root) / "tool_boundaries.json"
    path.write_text(json.dumps(boundaries, indent=2, sort_keys=True) + "\n")
    return path
