"""The `megatron-dapo` command. Each subcommand lives in `megatron_dapo/commands/<name>.py` and
exposes ``register(subparsers)`` (adds its parser and sets ``func``); heavy imports happen inside
the command's run function so `--help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order shown by --help.
COMMANDS = ["train", "demo", "ablate", "eval", "config", "convert", "verify_model", "plot", "plan"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-dapo",
        description="DAPO reinforcement learning: Megatron-core actor, SGLang (or HF on CPU) rollouts.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"megatron_dapo.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"megatron_dapo.commands.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
