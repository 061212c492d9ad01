"""The served copy of a classifier checkpoint (no server): links to the original's files, the
score bias SGLang's head has and the checkpoint lacks added as zeros, the index naming it (single
file or sharded); the architectures whose heads agree served as they are; the others refused in
one line."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import hf_state_dict, make_tiny_hf_checkpoint
from reward_model_fixtures import make_tiny_classifier

from megatron_dapo.rewards.served.checkpoint import (
    BIAS_FILE,
    INDEX,
    MANIFEST,
    prepare_served_checkpoint,
)
from megatron_dapo.rewards.served.outcome import RewardModelError


@pytest.fixture(scope="module")
def qwen2_rm(tmp_path_factory):
    return make_tiny_classifier(tmp_path_factory.mktemp("rm") / "qwen2_rm")


def test_a_single_file_qwen2_classifier_gets_a_zero_bias_and_an_index(qwen2_rm, tmp_path):
    served = prepare_served_checkpoint(qwen2_rm, tmp_path / "served")
    assert served.path == tmp_path / "served" and served.original == qwen2_rm.resolve()
    assert served.architecture == "Qwen2ForSequenceClassification" and served.zero_filled == ("score.bias",)
    for f in qwen2_rm.iterdir():
        link = served.path / f.name
        assert link.is_symlink() and os.readlink(link) == str(f.resolve())
    original = hf_state_dict(qwen2_rm)
    assert "score.bias" not in original, "transformers saves no score bias"
    tensors = hf_state_dict(served.path)  # every file the index names
    assert set(tensors) == set(original) | {"score.bias"}
    assert torch.equal(tensors["score.bias"], torch.zeros(1)) and tensors["score.bias"].dtype == torch.float32
    assert all(torch.equal(tensors[k], v) for k, v in original.items())
    index = json.loads((served.path / INDEX).read_text())
    assert index["weight_map"]["score.bias"] == BIAS_FILE
    assert not (qwen2_rm / INDEX).exists(), "the original is left alone"


def test_a_sharded_bf16_qwen3_classifier_keeps_its_index_metadata(tmp_path):
    rm = make_tiny_classifier(
        tmp_path / "qwen3_rm", family="qwen3", max_shard_size="40KB", dtype=torch.bfloat16
    )
    original_index = json.loads((rm / INDEX).read_text())
    assert len(set(original_index["weight_map"].values())) > 1
    served = prepare_served_checkpoint(rm, tmp_path / "served")
    index = json.loads((served.path / INDEX).read_text())
    assert index["metadata"] == original_index["metadata"]
    assert index["weight_map"] == {**original_index["weight_map"], "score.bias": BIAS_FILE}
    assert not (served.path / INDEX).is_symlink()
    bias = hf_state_dict(served.path)["score.bias"]
    assert bias.dtype == torch.bfloat16 and torch.equal(bias, torch.zeros(1, dtype=torch.bfloat16))
    assert json.loads((rm / INDEX).read_text()) == original_index


def test_a_head_with_several_labels_gets_a_bias_of_that_size(tmp_path):
    served = prepare_served_checkpoint(make_tiny_classifier(tmp_path / "rm3", num_labels=3), tmp_path / "s")
    assert torch.equal(hf_state_dict(served.path)["score.bias"], torch.zeros(3))


def test_llama_s_head_has_no_bias_on_either_side_so_it_is_served_as_it_is(tmp_path):
    rm = make_tiny_classifier(tmp_path / "llama_rm", family="llama")
    served = prepare_served_checkpoint(rm, tmp_path / "served")
    assert served.path == rm.resolve() and served.zero_filled == ()
    assert not (tmp_path / "served").exists()


def test_the_copy_is_reused_and_rebuilt_when_the_original_changes(qwen2_rm, tmp_path):
    first = prepare_served_checkpoint(qwen2_rm, tmp_path / "served")
    bias = first.path / BIAS_FILE
    stamp = bias.stat().st_mtime_ns
    assert prepare_served_checkpoint(qwen2_rm, tmp_path / "served") == first
    assert bias.stat().st_mtime_ns == stamp
    manifest = json.loads((first.path / MANIFEST).read_text())
    (first.path / MANIFEST).write_text(json.dumps({**manifest, "fingerprint": "stale"}))
    prepare_served_checkpoint(qwen2_rm, tmp_path / "served")
    assert json.loads((first.path / MANIFEST).read_text()) == manifest


def _with_architecture(rm, tmp_path, arch: str):
    copy = tmp_path / arch
    copy.mkdir()
    for f in rm.iterdir():
        (copy / f.name).symlink_to(f)
    config = json.loads((rm / "config.json").read_text())
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
    return copy


@pytest.mark.parametrize(
    "arch, why",
    [
        ("Qwen2ForRewardModel", r"qwen2_rm.py:47\) is remote code with no transformers class"),
        ("InternLM2ForRewardModel", "remote code"),
        ("BertForSequenceClassification", "no chat template"),
        ("MistralForSequenceClassification", "has not been compared with transformers'"),
    ],
)
def test_architectures_that_cannot_be_vouched_for_are_refused_in_one_line(qwen2_rm, tmp_path, arch, why):
    with pytest.raises(RewardModelError, match=why) as e:
        prepare_served_checkpoint(_with_architecture(qwen2_rm, tmp_path, arch), tmp_path / "served")
    line = str(e.value)
    assert "\n" not in line and f"architecture {arch} is not served as a classifier reward" in line
    assert "supported: Qwen2ForSequenceClassification, Qwen3ForSequenceClassification" in line
    assert "reward.model.kind=judge" in line


def test_checkpoints_it_cannot_correct_are_refused(qwen2_rm, tmp_path):
    causal = make_tiny_hf_checkpoint(tmp_path / "causal")
    with pytest.raises(RewardModelError, match="has no score.weight; it is not a sequence-classification"):
        prepare_served_checkpoint(
            _with_architecture(causal, tmp_path, "Qwen2ForSequenceClassification"), tmp_path / "s"
        )
    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    (bin_only / "config.json").symlink_to(qwen2_rm / "config.json")
    (bin_only / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(RewardModelError, match="no safetensors weights"):
        prepare_served_checkpoint(bin_only, tmp_path / "s2")
    with pytest.raises(RewardModelError, match="cannot read .*config.json"):
        prepare_served_checkpoint(tmp_path / "nowhere", tmp_path / "s3")
    stranger = tmp_path / "not_a_copy"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(RewardModelError, match="is not a served copy of a reward model"):
        prepare_served_checkpoint(qwen2_rm, stranger)
