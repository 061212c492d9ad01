"""`megatron-dapo config CONFIG [key=value ...]`: print the resolved, validated config."""

from __future__ import annotations

import argparse
import sys

from megatron_dapo.config import ConfigError, all_keys, load_config, to_yaml


def register(p: argparse.ArgumentParser) -> None:
    p.description = "Merge CONFIG with key=value overrides onto the schema, validate, print as YAML."
    p.add_argument(
        "config", nargs="?", help="YAML recipe (e.g. configs/demo.yaml); omit for the schema defaults"
    )
    p.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. rollout.n=8 trainer.total_steps=10"
    )
    p.add_argument("--keys", action="store_true", help="list every valid key and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.keys:
        print("\n".join(all_keys()))
        return 0
    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)
        config = None
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), end="")
    return 0
