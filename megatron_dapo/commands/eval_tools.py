"""`eval`'s tools: which tool YAML an evaluation's episodes use, and the episode loop that runs them.

A run trained with ``rollout.multi_turn.enable`` is evaluated as its validation ran: prompts that
list its tools, episodes through the same loop (``agent.runner.MultiTurn``: its call format, turn
and token budgets, tool processes). ``--tools PATH`` gives another tool YAML (with the run's other
``rollout.multi_turn`` settings, or the schema's defaults without a run); ``--tools none`` samples
one turn without tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from megatron_dapo.agent.from_config import multi_turn_runner, tool_specs
from megatron_dapo.config import ConfigError, DAPOConfig

NO_TOOLS = "none"


class EvalToolsError(ValueError):
    """A tool setting of `eval` that cannot work: printed as one line, exit status 2."""


@dataclass
class EvalTools:
    """The ``rollout.multi_turn`` section an evaluation runs its episodes with, and where its tool
    YAML came from (for messages)."""

    cfg: Any  # a config holding the rollout.multi_turn section (the run's, or the schema's)
    origin: str
    schemas: list[dict]

    @property
    def section(self) -> Any:
        return self.cfg.rollout.multi_turn

    def runner(self, tokenizer: Any, max_context: int | None):
        """The episode loop (``close()`` it: it owns the tool processes)."""
        try:
            return multi_turn_runner(self.cfg, tokenizer, max_context or 1 << 30)
        except ConfigError as e:
            raise EvalToolsError(f"{self.origin}: {e}") from e


def eval_tools(flag: str | None, run_cfg: Any, run_path: Path | None) -> EvalTools | None:
    """The tools of an evaluation: ``--tools`` (a YAML, or ``none``), else the run's when it trained
    with them, else None (one turn)."""
    if flag is not None and flag.strip().lower() == NO_TOOLS:
        return None
    if flag is None:
        if run_cfg is None or not run_cfg.rollout.multi_turn.enable:
            return None
        cfg, origin = run_cfg, f"rollout.multi_turn.tool_config_path in {run_path}"
        path = run_cfg.rollout.multi_turn.tool_config_path
        fix = f"give --tools PATH (the tool YAML) or --tools {NO_TOOLS}"
    else:
        base = run_cfg if run_cfg is not None else OmegaConf.structured(DAPOConfig)
        cfg = OmegaConf.merge(base, {"rollout": {"multi_turn": {"enable": True, "tool_config_path": flag}}})
        origin, path = f"--tools {flag}", flag
        fix = f"point --tools at a tool YAML, or give --tools {NO_TOOLS}"
    if not Path(path).is_file():
        raise EvalToolsError(
            f"{origin}: no tool YAML at {path} (relative paths are read from {Path.cwd()}); {fix}"
        )
    try:
        specs = tool_specs(cfg)
    except ConfigError as e:
        raise EvalToolsError(f"{origin}: {e}") from e
    return EvalTools(cfg, origin, [s.schema for s in specs])
