"""Bad run inputs are refused at start-up with one line that names the real culprit: the key, the
file and the fix (driver/preflight.py for the model directory, driver/datasets.py and
data/loading.py for the data files)."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.data.types import DataError
from megatron_dapo.driver.datasets import load_tokenizer, train_dataset, val_problems
from megatron_dapo.driver.preflight import check_model_dir, preflight

# The tiny checkpoints' config.json says max_position_embeddings=128 (tests/helpers.py).
SHORT = ["data.max_prompt_length=32", "data.max_response_length=64", "algorithm.overlong_buffer.len=16"]


def _cfg(model, *overrides):
    return load_config(
        None,
        [f"model.path={model}", "data.apply_chat_template=false", "data.template=none", *SHORT, *overrides],
    )


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


@pytest.fixture
def model(tiny_hf_checkpoint):
    return tiny_hf_checkpoint()


def test_a_response_budget_beyond_the_models_context_is_refused(model, tmp_path):
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == 128
    check_model_dir(_cfg(model, "data.max_response_length=96"))  # 32 + 96 = 128 fits
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(model, "data.max_response_length=120", "trainer.resume=never"), tmp_path)
    assert _one_line(e) == (
        "data.max_prompt_length + data.max_response_length = 32 + 120 = 152 tokens exceed the model's "
        f"context, max_position_embeddings=128 in {model / 'config.json'}; lower data.max_response_length "
        "or data.max_prompt_length"
    )
    # validation's own response budget too
    with pytest.raises(
        ConfigError, match=r"data.max_prompt_length \+ rollout.val.max_response_length = 32 \+ 100"
    ):
        check_model_dir(_cfg(model, "rollout.val.max_response_length=100"))


def _without_tokenizer(model, where):
    shutil.copytree(model, where)
    for f in where.iterdir():
        if f.name.startswith("tokenizer") or f.name in (
            "vocab.json",
            "merges.txt",
            "special_tokens_map.json",
        ):
            f.unlink()
    return where


def test_a_model_directory_without_tokenizer_files_is_refused_at_start_up(model, tmp_path):
    bare = _without_tokenizer(model, tmp_path / "bare")
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(bare, "trainer.resume=never"), tmp_path / "ckpts")
    assert _one_line(e).startswith(
        f"model.path={bare} has no tokenizer files (one of: tokenizer.json, tokenizer.model, "
        "vocab.json + merges.txt, vocab.txt)"
    )
    # the tokenizer may live elsewhere, and that directory is checked instead
    check_model_dir(_cfg(bare, f"model.tokenizer_path={model}"))
    with pytest.raises(ConfigError, match=f"model.tokenizer_path={tmp_path} has no tokenizer files"):
        check_model_dir(_cfg(model, f"model.tokenizer_path={tmp_path}"))


def test_every_model_directory_piece_is_checked(model, tmp_path):
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    with pytest.raises(ConfigError, match=f"model.path={no_config}: no config.json there"):
        check_model_dir(_cfg(no_config))
    no_weights = _without_tokenizer(model, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(Exception, match="safetensors"):
        check_model_dir(_cfg(no_weights))
    # weights from a Megatron checkpoint: that directory must be one
    not_megatron = tmp_path / "not_megatron"
    not_megatron.mkdir()
    with pytest.raises(
        ConfigError, match=f"model.megatron_path={not_megatron} is not a Megatron distributed"
    ):
        check_model_dir(_cfg(model, f"model.megatron_path={not_megatron}"))


def _files(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(4))
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?"}) + "\n")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x " * 200, "answer": "1"}) + "\n")
    return good, empty, bad, long


def test_an_empty_data_file_is_named(model, tmp_path):
    good, empty, _, _ = _files(tmp_path)
    tok = load_tokenizer(_cfg(model))
    # alone (it was reported as a max_prompt_length problem) and as one file of a list
    for files in ([empty], [good, empty]):
        cfg = _cfg(model, f"data.train_files=[{','.join(map(str, files))}]")
        with pytest.raises(DataError) as e:
            train_dataset(cfg, tok)
        assert _one_line(e).startswith(f"data.train_files: {empty}: no rows (the file is empty)")
        assert "max_prompt_length" not in str(e.value)
    cfg = _cfg(model, f"data.train_files=[{good}]", f"data.val_files=[{good},{empty}]")
    assert len(train_dataset(cfg, tok)) == 4
    with pytest.raises(DataError, match=f"^data.val_files: {empty}: no rows"):
        val_problems(cfg, tok)


def test_every_data_file_is_named_in_its_error(model, tmp_path):
    good, _, bad, long = _files(tmp_path)
    tok = load_tokenizer(_cfg(model))
    # a file whose every row is malformed, even when malformed rows are skipped
    cfg = _cfg(model, f"data.train_files=[{good},{bad}]", "data.skip_bad_rows=true")
    with pytest.raises(
        DataError, match=f"^data.train_files: {bad}: all 1 rows are malformed; first: {bad}, line 1"
    ):
        train_dataset(cfg, tok)
    with pytest.raises(DataError, match=f"^data.val_files: {bad}, line 1: field .problem. is missing"):
        val_problems(_cfg(model, f"data.val_files=[{bad}]"), tok)
    # no prompt short enough: the files and the key are named
    cfg = _cfg(model, f"data.train_files=[{long}]", f"data.val_files=[{long}]")
    for load, key in ((train_dataset, "train"), (val_problems, "val")):
        with pytest.raises(DataError) as e:
            load(cfg, tok)
        assert _one_line(e).startswith(f"data.{key}_files ({long}): no prompts left")
        assert "raise data.max_prompt_length" in str(e.value)
