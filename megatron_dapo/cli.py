"""The `megatron-dapo` command. Each subcommand lives in `megatron_dapo/commands/<name>.py` and
exposes ``register(subparsers)`` (adds its parser and sets ``func``); heavy imports happen inside
the command's run function so `--help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

# Order is the order shown by --help.
COMMANDS = ["train", "demo", "ablate", "eval", "config", "convert", "verify_model", "plot", "plan"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-dapo",
        description="DAPO reinforcement learning: Megatron-core actor, SGLang (or HF on CPU) rollouts.",
    )
    parser.add_argument(
        "--debug", action="store_true", help="print full tracebacks here instead of a one-line error"
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
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug is accepted anywhere on the line, also after the subcommand
    debug = "--debug" in argv
    args = parser.parse_args([a for a in argv if a != "--debug"])
    args.debug = debug
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every failure ends as one line (and a log file)
        from megatron_dapo.errors import report

        if args.debug:
            traceback.print_exc()
        status, line = report(e, debug=args.debug)
        print(line, file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
