"""`megatron-dapo config` is the launch scripts' pre-check: it makes every check of the run's
inputs that `train` makes before Ray starts (model directory, data files, custom reward file,
tool YAML, the checkpoint to resume), each a one-line error with exit status 2; and `train` makes
them before it writes anything, so a config error leaves no run directory behind."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.cli import main
from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.driver.launch import prepare_run

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "demo.yaml")


@pytest.fixture
def inputs(tiny_hf_checkpoint, tmp_path):
    """Overrides that make the demo recipe's inputs exist: the tiny model and a one-row data file."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    return [
        f"model.path={tiny_hf_checkpoint()}",
        f"data.train_files=[{data}]",
        f"data.val_files=[{data}]",
        f"trainer.runs_dir={tmp_path / 'runs'}",
    ]


def _config(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["config", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("config error: "), err
    return lines[0]


def test_the_inputs_all_there_pass_and_print_the_config(capsys, inputs):
    code, out, err = _config(capsys, DEMO, *inputs)
    assert code == 0, err
    assert "run_name: demo" in out


def test_a_missing_model_path_exits_2_naming_it(capsys, inputs):
    code, _, err = _config(capsys, DEMO, *inputs, "model.path=/nonexistent")
    assert code == 2
    assert "model.path=/nonexistent: no config.json there" in _one_error_line(err)


def test_a_missing_custom_reward_file_exits_2_naming_it(capsys, inputs, tmp_path):
    code, _, err = _config(capsys, DEMO, *inputs, f"reward.custom_fn={tmp_path}/nope.py:score")
    assert code == 2
    assert f"reward.custom_fn={tmp_path}/nope.py:score: no file {tmp_path}/nope.py" in _one_error_line(err)
    # a file without the function: named, with what it does define; the file is not run
    reward = tmp_path / "reward.py"
    reward.write_text("import sys\nsys.exit(7)\ndef other(a, b, c, d):\n    return 1.0\n")
    code, _, err = _config(capsys, DEMO, *inputs, f"reward.custom_fn={reward}:score")
    assert code == 2
    assert "defines no 'score' (top-level names: other, sys)" in _one_error_line(err)
    code, _, err = _config(capsys, DEMO, *inputs, f"reward.custom_fn={reward}:other")
    assert code == 0, err


def test_a_missing_tool_yaml_exits_2_naming_it(capsys, inputs, tmp_path):
    missing = tmp_path / "tools.yaml"
    on = ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={missing}"]
    code, _, err = _config(capsys, DEMO, *inputs, *on)
    assert code == 2
    assert f"rollout.multi_turn.tool_config_path={missing}" in _one_error_line(err)


def test_an_unknown_call_format_exits_2_naming_it(capsys, inputs):
    tools = REPO / "configs" / "tools" / "calculator.yaml"
    on = ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={tools}"]
    code, _, err = _config(capsys, DEMO, *inputs, *on, "rollout.multi_turn.format=nosuch_module:fmt")
    assert code == 2
    assert (
        "rollout.multi_turn.format='nosuch_module:fmt': importing 'nosuch_module' failed"
        in _one_error_line(err)
    )


def test_a_missing_data_file_exits_2_naming_it_and_how_to_make_it(capsys, inputs, tmp_path):
    wanted = tmp_path / "data" / "dapo-math-17k.parquet"
    code, _, err = _config(capsys, DEMO, *inputs, f"data.train_files=[{wanted}]")
    assert code == 2
    line = _one_error_line(err)
    assert f"data.train_files: {wanted}: no such file" in line
    assert f"megatron-dapo data prepare dapo-math-17k --out {wanted.parent}" in line
    # a file that is there but is not parquet
    wanted.parent.mkdir()
    wanted.write_text("not parquet")
    code, _, err = _config(capsys, DEMO, *inputs, f"data.val_files=[{wanted}]")
    assert code == 2 and f"data.val_files: {wanted}: not a readable parquet file" in _one_error_line(err)


def test_values_alone_with_no_files(capsys):
    code, out, err = _config(capsys, DEMO, "model.path=/nonexistent", "--no-files")
    assert code == 0, err
    assert "path: /nonexistent" in out


def test_a_config_error_in_train_leaves_no_run_directory(inputs, tmp_path):
    # before: prepare_run made runs/NAME/{checkpoints,hf,plots,rollouts}, then found the error
    cfg = load_config(DEMO, [*inputs, "model.path=/nonexistent"])
    with pytest.raises(ConfigError, match="model.path=/nonexistent"):
        prepare_run(cfg)
    assert not (tmp_path / "runs").exists()


def test_a_machine_that_cannot_make_the_sandbox_is_refused_before_ray(inputs, tmp_path):
    """The python tool on a machine without user namespaces (made real: a user namespace whose
    max_user_namespaces is 0): `config`, which the launch scripts run before Ray, exits 2 in one
    line naming the sandbox and the ways out."""
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - builtin: python\n")
    argv = [*inputs, "rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={tools}"]
    cmd = " ".join(
        [sys.executable, "-m", "megatron_dapo.cli", "config", DEMO, *(shlex.quote(a) for a in argv)]
    )
    res = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "sh",
            "-c",
            f"echo 0 > /proc/sys/user/max_user_namespaces && exec {cmd}",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=180,
    )
    assert res.returncode == 2, res.stderr
    line = _one_error_line(res.stderr)
    assert "tool python: the tool sandbox cannot be made on this machine" in line and "sandbox: none" in line
