"""The `megatron-dapo` command line: every command listed by `--help` without importing any of
them, a command line importing only the command it runs, argparse's error for an unknown one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
# every subcommand (README.md shows each in use) and the first words of its help line
EXPECTED = {
    "train": "run DAPO training",
    "demo": "DAPO on a tiny model on CPU",
    "ablate": "the DAPO ladder",
    "eval": "evaluate avg@k / pass@k / maj@k",
    "config": "print the resolved config",
    "convert": "convert checkpoints between HF and Megatron",
    "verify-model": "compare Megatron and HF transformers logits",
    "plot": "write PNG curves of a run",
    "tools": "try a tool YAML by hand",
    "plan": "estimate parameters, per-GPU memory",
    "data": "prepare the recipes' data sets",
}

# runs `cli.main(argv)` and reports its exit status, output and the command modules it imported
PROBE = """
import contextlib, io, json, sys
from megatron_dapo.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
loaded = sorted(m for m in sys.modules if m.startswith("megatron_dapo.commands."))
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(), "loaded": loaded,
                  "torch": "torch" in sys.modules}))
"""


def _probe(*argv: str) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=True,
    )
    return json.loads(run.stdout.splitlines()[-1])


def test_help_lists_every_command_and_imports_none():
    r = _probe("--help")
    assert r["code"] == 0
    text = " ".join(r["out"].split())  # argparse wraps the help lines
    for name, words in EXPECTED.items():
        assert f"{name} {words}" in text, name
    assert r["loaded"] == [] and not r["torch"]


def test_a_command_line_imports_only_its_command():
    r = _probe("config", "--help")
    assert r["code"] == 0 and "--keys" in r["out"]
    assert r["loaded"] == ["megatron_dapo.commands.config"]


def test_an_unknown_command_is_argparses_error_with_the_choices():
    r = _probe("trian", "configs/demo.yaml")
    assert r["code"] == 2 and r["loaded"] == []
    choices = ", ".join(f"'{name}'" for name in EXPECTED)
    assert f"argument COMMAND: invalid choice: 'trian' (choose from {choices})" in r["err"]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_command_registers_its_arguments(name):
    parser = build_parser(name)
    sub = next(a for a in parser._actions if a.dest == "command")
    command = sub.choices[name]
    if name in ("convert", "data", "tools"):  # sub-actions, each with its own run function
        directions = next(a for a in command._actions if a.dest in ("direction", "action"))
        assert all(p.get_default("func") for p in directions.choices.values())
    else:
        assert command.get_default("func") is not None
