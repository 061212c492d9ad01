"""`megatron-dapo tools check|call TOOL_YAML`: try a tool by hand, exactly as training runs it.

``check`` lists the tools, their schemas and the boundary each runs behind on this machine (with
the probe that decided it), and exits 2 in one line when a tool needs the sandbox and this machine
cannot make it. ``call`` runs one call through the same ToolHost, boundary and limits as training
(``rollout.multi_turn``'s tool settings, overridable as ``key=value``) and prints one JSON line with
``status`` and ``text`` (and ``metrics``).
"""

from __future__ import annotations

import argparse
import json
import sys

from omegaconf import OmegaConf

from megatron_dapo.agent.calls import ToolCall
from megatron_dapo.agent.tools.boundary import SANDBOXED, require_boundaries
from megatron_dapo.agent.tools.host import ToolHost
from megatron_dapo.agent.tools.sandbox import Sandbox, probe
from megatron_dapo.agent.tools.spec import load_tool_config
from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.schema import MultiTurnConfig


def register(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = actions.add_parser("check", help="list the tools, their schemas and the boundary in effect here")
    check.add_argument("tool_yaml", help="a tool YAML (rollout.multi_turn.tool_config_path)")
    check.set_defaults(func=run_check)
    call = actions.add_parser("call", help="run one call as training runs it; prints one JSON line")
    call.add_argument("tool_yaml", help="a tool YAML (rollout.multi_turn.tool_config_path)")
    call.add_argument("name", help="the tool's name (tool_schema.function.name)")
    call.add_argument(
        "arguments", help='the call\'s arguments as a JSON object, e.g. \'{"code": "print(1)"}\''
    )
    call.add_argument(
        "overrides",
        nargs="*",
        help="rollout.multi_turn tool settings as key=value (tool_timeout_s=30 tool_memory_mb=2048)",
    )
    call.set_defaults(func=run_call)


def run_check(args: argparse.Namespace) -> int:
    specs = load_tool_config(args.tool_yaml)
    found = probe(Sandbox())
    boundaries = require_boundaries(specs, sandbox_probe=found)
    print(f"sandbox on this machine: {'available' if found.ok else 'NOT available'} ({found.detail})")
    if found.ok:
        print(f"  process count bounded by: {found.process_limit}")
    for spec in specs:
        print(f"\n{spec.name}  [{spec.kind}: {spec.target}]  runs behind: {boundaries[spec.name]}")
        if spec.config:
            print(f"  config: {json.dumps(spec.config, sort_keys=True)}")
        print("  schema: " + json.dumps(spec.schema["function"], sort_keys=True))
    if SANDBOXED not in boundaries.values():
        print("\nno tool here runs behind the sandbox")
    return 0


def run_call(args: argparse.Namespace) -> int:
    try:
        arguments = json.loads(args.arguments)
    except ValueError as e:
        raise ConfigError(
            f'ARGS_JSON: not JSON ({e}); give an object, e.g. \'{{"code": "print(1)"}}\''
        ) from None
    if not isinstance(arguments, dict):
        raise ConfigError(f"ARGS_JSON: must be a JSON object of the tool's arguments, got {args.arguments!r}")
    settings = _settings(args.tool_yaml, args.overrides)
    specs = load_tool_config(settings.tool_config_path)
    require_boundaries(specs)
    with ToolHost.from_config(settings) as host:
        result = host.call("tools-call", ToolCall(args.name, arguments))
    json.dump(
        {"status": result.status, "text": result.text, "metrics": result.metrics}, sys.stdout, default=str
    )
    print()
    return 0


def _settings(tool_yaml: str, overrides: list[str]) -> MultiTurnConfig:
    base = OmegaConf.structured(MultiTurnConfig(tool_config_path=tool_yaml))
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.removeprefix("rollout.multi_turn.")
        if not sep or key not in base:
            raise ConfigError(
                f"{item!r}: give rollout.multi_turn settings as key=value, e.g. tool_timeout_s=30 "
                "(see `megatron-dapo config --keys`)"
            )
        base[key] = OmegaConf.create({"v": value})["v"] if value else value
    return OmegaConf.to_object(base)
