"""Bad conversion input fails before any rank starts, names the file/tensor/field, writes nothing."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from megatron_dapo.arch import ModelConfigError
from megatron_dapo.cli import main as cli
from megatron_dapo.convert import hf_to_megatron, megatron_to_hf
from megatron_dapo.weights.hf_io import CheckpointError


@pytest.fixture
def hf_copy(tiny_hf_checkpoint, tmp_path):
    src = tiny_hf_checkpoint(family="qwen2", num_layers=2, seed=21)
    dst = tmp_path / "hf"
    shutil.copytree(src, dst)
    return dst


def _nothing_written(tmp_path, name="out"):
    return not (tmp_path / name).exists() and not list(tmp_path.glob(f".{name}.tmp-*"))


def test_missing_hf_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="HF config not found"):
        hf_to_megatron(tmp_path / "absent", tmp_path / "out")
    assert _nothing_written(tmp_path)


def test_unsupported_architecture_lists_supported(hf_copy, tmp_path):
    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="MistralForCausalLM.*Qwen2ForCausalLM, LlamaForCausalLM"):
        hf_to_megatron(hf_copy, tmp_path / "out")
    assert _nothing_written(tmp_path)


def test_corrupt_safetensors_names_the_file(hf_copy, tmp_path):
    (hf_copy / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        hf_to_megatron(hf_copy, tmp_path / "out")
    assert _nothing_written(tmp_path)


def test_shape_mismatch_names_the_tensor(hf_copy, tmp_path):
    weights = load_file(str(hf_copy / "model.safetensors"))
    weights["model.layers.1.self_attn.k_proj.weight"] = weights["model.layers.1.self_attn.k_proj.weight"][:-2]
    save_file(weights, str(hf_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"'model.layers.1.self_attn.k_proj.weight' has shape \(30, 64\)"
    ):
        hf_to_megatron(hf_copy, tmp_path / "out")
    assert _nothing_written(tmp_path)


def test_missing_tensor_names_it(hf_copy, tmp_path):
    weights = load_file(str(hf_copy / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(hf_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="'model.norm.weight' not found"):
        hf_to_megatron(hf_copy, tmp_path / "out")


def test_layout_that_does_not_divide_heads(hf_copy, tmp_path):
    with pytest.raises(ModelConfigError, match="tp=3 must divide num_attention_heads=4"):
        hf_to_megatron(hf_copy, tmp_path / "out", tp=3)
    assert _nothing_written(tmp_path)


def test_existing_output_is_not_touched(hf_copy, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists"):
        hf_to_megatron(hf_copy, out)
    assert (out / "keep.txt").read_text() == "mine"


def _fake_dist_checkpoint(path, architecture):
    path.mkdir()
    (path / "metadata.json").write_text("{}")
    (path / "megatron_dapo_model.json").write_text(json.dumps({"architecture": architecture}))


def test_megatron_to_hf_config_architecture_mismatch(hf_copy, tmp_path):
    ckpt = tmp_path / "ckpt"
    _fake_dist_checkpoint(ckpt, "LlamaForCausalLM")
    with pytest.raises(CheckpointError, match="holds a LlamaForCausalLM model but .* is Qwen2ForCausalLM"):
        megatron_to_hf(ckpt, tmp_path / "out", hf_config_dir=hf_copy)
    assert _nothing_written(tmp_path)


def test_megatron_to_hf_needs_a_config_and_a_dist_checkpoint(hf_copy, tmp_path):
    with pytest.raises(CheckpointError, match="not a megatron-core distributed checkpoint"):
        megatron_to_hf(hf_copy, tmp_path / "out")
    ckpt = tmp_path / "ckpt"
    _fake_dist_checkpoint(ckpt, "Qwen2ForCausalLM")
    with pytest.raises(CheckpointError, match="no config.json .* pass --hf-config-dir"):
        megatron_to_hf(ckpt, tmp_path / "out")


def test_cli_reports_errors_with_exit_code(tmp_path, capsys):
    code = cli(
        [
            "convert",
            "hf-to-megatron",
            "--hf-dir",
            str(tmp_path / "nope"),
            "--megatron-dir",
            str(tmp_path / "m"),
        ]
    )
    assert code == 2  # bad input
    assert "error: HF config not found" in capsys.readouterr().err
