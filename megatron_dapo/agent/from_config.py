"""``rollout.multi_turn`` -> the pieces a run needs: the tools' schemas (for the prompts) and the
episode runner (for the rollout manager and validation)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from megatron_dapo.agent.bridge import ChatBridge
from megatron_dapo.agent.calls import get_call_format
from megatron_dapo.agent.runner import AppendOnly, MultiTurn, MultiTurnSettings
from megatron_dapo.agent.tool_instances import ToolInstances
from megatron_dapo.agent.tools.boundary import require_boundaries, write_boundaries
from megatron_dapo.agent.tools.host import ToolHost
from megatron_dapo.agent.tools.spec import ToolSpec, load_tool_config
from megatron_dapo.config import ConfigError
from megatron_dapo.pyfile import import_file

# the run's tool log, in its run directory: the tools' stderr and the tracebacks of failed calls
TOOL_LOG = "tools.log"


def tool_specs(cfg: Any) -> list[ToolSpec]:
    """The tools of ``rollout.multi_turn.tool_config_path`` ([] when multi-turn is off)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return []
    try:
        return load_tool_config(mt.tool_config_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"rollout.multi_turn.tool_config_path={mt.tool_config_path}: {e}") from e


def tool_schemas(cfg: Any) -> list[dict] | None:
    """The OpenAI function schemas the chat template renders into every prompt, or None."""
    specs = tool_specs(cfg)
    return [s.schema for s in specs] or None


def call_format(spec: str) -> Any:
    """``rollout.multi_turn.format`` -> its parser: a registered name (``hermes``), or
    ``MODULE:NAME`` / ``path/to/file.py:NAME`` whose module registers ``NAME`` with
    ``register_call_format`` when imported. The module is imported here, in the process that runs
    the episodes, so a config names a format of its own without any other process knowing it."""
    where, sep, name = spec.rpartition(":")
    if sep:
        if not where or not name:
            raise ConfigError(
                f"rollout.multi_turn.format={spec!r}: write a registered name, MODULE:NAME or path/to/file.py:NAME"
            )
        try:
            _import_format_module(where)
        except Exception as e:  # the user's module: any error of its import is the config's
            raise ConfigError(
                f"rollout.multi_turn.format={spec!r}: importing {where!r} failed ({type(e).__name__}: {e})"
            ) from e
    try:
        return get_call_format(name)
    except ValueError as e:
        hint = f" ({where} was imported but did not register {name!r})" if sep else ""
        raise ConfigError(f"rollout.multi_turn.format={spec!r}: {e}{hint}") from e


def _import_format_module(where: str) -> None:
    if not where.endswith(".py"):
        importlib.import_module(where)
        return
    import_file(where, "megatron_dapo_call_format")


def multi_turn_runner(
    cfg: Any, tokenizer: Any, max_context: int, run_root: str | Path | None = None
) -> ToolInstances | None:
    """The episode runner of a multi-turn run (None when ``rollout.multi_turn.enable`` is off). It
    owns the tool processes: ``close()`` it when the run ends. Stops (ToolConfigError, one line)
    when a tool needs the sandbox and this machine cannot make it; ``run_root``: where the tools'
    boundaries are recorded (``tool_boundaries.json``)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return None
    parser = call_format(mt.format)
    try:
        bridge = ChatBridge(tokenizer)
    except ValueError as e:
        raise ConfigError(
            f"rollout.multi_turn: the model's chat template cannot render tool turns ({e}); use a tokenizer "
            "whose template has a tool role (model.tokenizer_path)"
        ) from e
    specs = tool_specs(cfg)
    boundaries = require_boundaries(specs)
    if run_root is not None:
        write_boundaries(boundaries, run_root)
    host = ToolHost(
        specs,
        timeout_s=mt.tool_timeout_s,
        workers=mt.tool_workers,
        memory_mb=mt.tool_memory_mb,
        log_path=Path(cfg.trainer.runs_dir) / cfg.trainer.run_name / TOOL_LOG,
    )
    settings = MultiTurnSettings.from_config(cfg, max_context=max_context)
    episodes = MultiTurn(settings, AppendOnly(bridge), host, parser, tokenizer)
    # aborted episodes are continued only by partial rollouts: otherwise their instances go
    return ToolInstances(episodes, keep_aborted=bool(cfg.rollout.partial))
