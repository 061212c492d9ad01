"""The `megatron-dapo` command. Each subcommand lives in `megatron_dapo/commands/<module>.py` and
exposes ``register(parser)`` (adds its arguments to the subcommand's parser and sets ``func``).
`COMMANDS` names them with their help line, so `--help` imports none of them and a command line
imports only the command it runs."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from dataclasses import dataclass

from megatron_dapo.errors import report


@dataclass(frozen=True)
class Command:
    """One subcommand: the module under ``megatron_dapo.commands`` that implements it (its
    ``register(parser)`` adds the arguments and sets ``func``), and its line in ``--help``."""

    module: str
    help: str


# Order is the order shown by --help. Only the chosen command's module is imported: the others
# import torch, transformers or the driver at their top, which `--help` and `config` do not need.
COMMANDS: dict[str, Command] = {
    "train": Command("train", "run DAPO training (Ray driver: actor ranks + rollout engines)"),
    "demo": Command("demo", "DAPO on a tiny model on CPU, in minutes (what `make demo` runs)"),
    "ablate": Command(
        "ablate", "the DAPO ladder (GRPO -> ... -> DAPO) and the loss variants on the demo task"
    ),
    "eval": Command("eval", "evaluate avg@k / pass@k / maj@k (AIME protocol by default)"),
    "config": Command("config", "print the resolved config (YAML + overrides), validated"),
    "convert": Command("convert", "convert checkpoints between HF and Megatron dist-checkpoint formats"),
    "verify-model": Command("verify_model", "compare Megatron and HF transformers logits for a checkpoint"),
    "plot": Command("plot", "write PNG curves of a run (reward, length, entropy, clip, keep rate, val)"),
    "tools": Command(
        "tools", "try a tool YAML by hand: `check` its boundary here, `call` one tool as training does"
    ),
    "plan": Command(
        "plan", "estimate parameters, per-GPU memory, fit (with fixes) and step time of a recipe"
    ),
    "data": Command("data", "prepare the recipes' data sets (DAPO-Math-17k, AIME 2024) as verl parquet"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every command listed; ``command`` (a name in COMMANDS) gets its arguments."""
    parser = argparse.ArgumentParser(
        prog="megatron-dapo",
        description="DAPO reinforcement learning: Megatron-core actor, SGLang (or HF on CPU) rollouts.",
    )
    parser.add_argument(
        "--debug", action="store_true", help="print full tracebacks here instead of a one-line error"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help)
        if name == command:
            importlib.import_module(f"megatron_dapo.commands.{cmd.module}").register(p)
    return parser


def parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parse_args``, except that ``key=value`` overrides may also come after a flag
    (``plan CFG --num-gpus 32 rollout.num_engines=8``): argparse ends a positional list at the first
    flag and would refuse the words after it, so those go to the command's overrides."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        stray = [a for a in extra if a.startswith("-") or "=" not in a]
        if stray or not isinstance(getattr(args, "overrides", None), list):
            parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
        args.overrides.extend(extra)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Before any command imports torch (its OpenMP reads it once): waiting threads sleep rather
    # than spin. A run's processes (driver, ranks, engines, tool workers) share the node's cores,
    # and on a loaded CPU spinning threads starved each other: 5-6x slower training steps in two
    # processes on 2 cores (tools/bench_omp_wait.py). A user's own setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # --debug is accepted anywhere on the line, also after the subcommand
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    # the top-level options take no value: the first word that is not an option names the command
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen)
    args = parse_with_overrides(parser, argv)
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
        if args.debug:
            traceback.print_exc()
        status, line = report(e, debug=args.debug)
        print(line, file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
