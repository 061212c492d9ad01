"""Runs many `megatron-dapo` command lines cheaply: each in a process forked from this one once
the imports every command makes (torch, transformers, Ray, megatron-dapo's commands) are done,
so the bad-input table pays them once instead of once per row. Each command line still runs the
real `megatron_dapo.cli.main` in a process of its own, with its own stdout, stderr, exit status
and exit handlers; only the interpreter start-up and the imports are shared.

stdin: a JSON list of argv lists; stdout: a JSON list of {"returncode", "stdout", "stderr"}."""

from __future__ import annotations

import atexit
import importlib
import json
import os
import shutil
import sys
import tempfile
import traceback

import megatron_dapo.cli as cli

PRELOAD = (
    "torch",
    "transformers",
    "ray",
    "megatron_dapo.config",
    "megatron_dapo.driver.launch",
    *(f"megatron_dapo.commands.{c.module}" for c in cli.COMMANDS.values()),
)
PARALLEL = 3


def _child(argv: list[str], out: str, err: str) -> None:
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["megatron-dapo", *argv]
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse, or a command that exits itself
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001 - what an uncaught exception would show
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what interpreter exit would run (Ray, logging, temp files)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _start(argv: list[str], tmp: str, i: int) -> tuple[int, str, str]:
    out, err = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(argv, out, err)
    return pid, out, err


def main() -> None:
    argvs = json.load(sys.stdin)
    for name in PRELOAD:
        importlib.import_module(name)
    results: list[dict | None] = [None] * len(argvs)
    # not TemporaryDirectory: its exit handler would run in every child and delete the outputs
    tmp = tempfile.mkdtemp(prefix="cli-fork-runner-")
    try:
        running: dict[int, tuple[int, str, str]] = {}
        todo = list(enumerate(argvs))
        while todo or running:
            while todo and len(running) < PARALLEL:
                i, argv = todo.pop(0)
                pid, out, err = _start(argv, tmp, i)
                running[pid] = (i, out, err)
            pid, status = os.wait()
            if pid not in running:
                continue  # a grandchild re-parented to us
            i, out, err = running.pop(pid)
            with open(out) as o, open(err) as e:
                results[i] = {
                    "returncode": os.waitstatus_to_exitcode(status),
                    "stdout": o.read(),
                    "stderr": e.read(),
                }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
