"""``rollout.multi_turn`` -> the pieces a run needs: the tools' schemas (for the prompts) and the
episode runner (for the rollout manager and validation)."""

from __future__ import annotations

from typing import Any

from megatron_dapo.agent.bridge import ChatBridge
from megatron_dapo.agent.calls import get_call_format
from megatron_dapo.agent.runner import AppendOnly, MultiTurn, MultiTurnSettings
from megatron_dapo.agent.tools.host import ToolHost
from megatron_dapo.agent.tools.spec import ToolSpec, load_tool_config
from megatron_dapo.config import ConfigError


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


def multi_turn_runner(cfg: Any, tokenizer: Any, max_context: int) -> MultiTurn | None:
    """The episode runner of a multi-turn run (None when ``rollout.multi_turn.enable`` is off). It
    owns the tool processes: ``close()`` it when the run ends."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return None
    try:
        parser = get_call_format(mt.format)
    except ValueError as e:
        raise ConfigError(f"rollout.multi_turn.format={mt.format!r}: {e}") from e
    try:
        bridge = ChatBridge(tokenizer)
    except ValueError as e:
        raise ConfigError(
            f"rollout.multi_turn: the model's chat template cannot render tool turns ({e}); use a tokenizer "
            "whose template has a tool role (model.tokenizer_path)"
        ) from e
    host = ToolHost(
        tool_specs(cfg), timeout_s=mt.tool_timeout_s, workers=mt.tool_workers, memory_mb=mt.tool_memory_mb
    )
    settings = MultiTurnSettings.from_config(cfg, max_context=max_context)
    return MultiTurn(settings, AppendOnly(bridge), host, parser, tokenizer)
