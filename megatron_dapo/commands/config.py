"""`megatron-dapo config CONFIG [key=value ...]`: print the resolved, validated config, after every
check of the run's inputs that `train` makes before Ray starts (the launch scripts' pre-check)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_dapo.config import ConfigError, load_config, to_yaml
from megatron_dapo.config.reference import key_lines, reference_markdown
from megatron_dapo.driver.hub import resolve_hub_paths
from megatron_dapo.driver.preflight import preflight
from megatron_dapo.plan.sizing import check_gpus


def register(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Merge CONFIG with key=value overrides onto the schema, validate, check the files it names "
        "(model, data, reward function, tool YAML, checkpoint to resume) as `train` does, print as YAML."
    )
    p.add_argument(
        "config", nargs="?", help="YAML recipe (e.g. configs/demo.yaml); omit for the schema defaults"
    )
    p.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. rollout.n=8 trainer.total_steps=10"
    )
    p.add_argument(
        "--keys", action="store_true", help="list every valid key with its type and default, and exit"
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="print the config reference (every key, type, default, meaning) as Markdown: docs/config.md",
    )
    p.add_argument("--no-files", action="store_true", help="check the values only, not the files they name")
    p.add_argument(
        "--num-gpus",
        type=int,
        default=None,
        help="the GPUs of the allocation: refuse a layout that needs another number, naming the overrides that fit",
    )
    p.add_argument("--gpu", default="h100", help="with --num-gpus: h100 (default), h200 or a100, for the fit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.keys:
        print("\n".join(key_lines()))
        return 0
    if args.reference:
        print(reference_markdown(), end="")
        return 0
    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides.insert(0, config)
        config = None
    try:
        cfg = load_config(config, overrides)
        if args.num_gpus is not None:
            check_gpus(cfg, args.num_gpus, args.gpu, config or "the config")
        if not args.no_files:
            # as train does: hub ids resolved (downloaded once into the shared cache), then checked
            checked = resolve_hub_paths(cfg)
            preflight(checked, Path(cfg.trainer.runs_dir) / cfg.trainer.run_name / "checkpoints")
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), end="")
    return 0
