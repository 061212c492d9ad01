"""The classifier's start-up probe follows the server's precision: a bfloat16 server (a GPU's
``--dtype auto`` on a bf16 checkpoint) scores the probes as transformers does in bfloat16, which
differs from float32 by more than the float32 tolerance; training's probe (the one launch path
eval uses too) must pass it, and still catch a head bias."""

from __future__ import annotations

import pytest
import torch
from judge_standin import StandIn
from reward_model_fixtures import make_tiny_classifier, served_settings

from megatron_dapo.rewards.served import RewardModelError, startup_check
from megatron_dapo.rewards.served.classifier import load_tokenizer
from megatron_dapo.rewards.served.startup_check import (
    DEFAULT_TOLERANCE,
    check_classifier_server,
    probe_ids,
    probe_tolerance,
    served_dtype,
)
from megatron_dapo.sglang.reward_servers import RewardServer, RewardServers


def _scores(model_dir, ids, dtype) -> dict[tuple, float]:
    """transformers' first logit per id list, computed in ``dtype`` (what a server in it returns)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=dtype).eval()
    with torch.no_grad():
        return {tuple(row): float(model(torch.tensor([row])).logits[0, 0].float()) for row in ids}


@pytest.fixture(scope="module")
def bf16_server(tmp_path_factory):
    """A stand-in /classify that answers the probes with transformers' bfloat16 scores."""
    path = make_tiny_classifier(tmp_path_factory.mktemp("rm") / "bf16", dtype=torch.bfloat16)
    ids = probe_ids(load_tokenizer(str(path), "rm"), "rm")
    scores = _scores(path, ids, torch.bfloat16)
    reference = _scores(path, ids, torch.float32)
    offset = {"value": 0.0}

    def classify(body):
        return 200, {"embedding": [scores[tuple(body["input_ids"])] + offset["value"]], "meta_info": {}}

    server = StandIn({"/classify": classify})
    yield path, server, scores, reference, offset
    server.close()


def test_a_bf16_checkpoint_served_auto_runs_in_bf16_and_a_float32_one_in_float16(tmp_path):
    f32 = make_tiny_classifier(tmp_path / "f32")
    assert served_dtype(f32, "auto") == "float16"  # SGLang's auto for a float32 checkpoint
    assert served_dtype(f32, "float32") == "float32"
    assert probe_tolerance(f32, "float32") == 1e-4 and probe_tolerance(f32, "auto") == 4e-2
    assert probe_tolerance(f32, "auto", override=0.5) == 0.5


def test_training_s_probe_passes_a_bf16_server_and_still_catches_a_bias(bf16_server, monkeypatch):
    path, server, scores, reference, offset = bf16_server
    loads = []  # transformers' side is computed once per run, not at every restart's probe
    real = startup_check.reference_scores
    monkeypatch.setattr(startup_check, "reference_scores", lambda *a: loads.append(1) or real(*a))
    assert served_dtype(path, "auto") == "bfloat16"
    # bf16 against float32 transformers: past the float32 tolerance, within bf16's
    worst = max(abs(scores[k] - reference[k]) for k in scores)
    assert DEFAULT_TOLERANCE < worst < probe_tolerance(path, "auto"), worst
    with pytest.raises(RewardModelError, match="start-up check failed"):  # the fixed 1e-4 of before
        check_classifier_server(server.url, path, tolerance=DEFAULT_TOLERANCE)
    settings = served_settings(kind="classifier", path=str(path))
    loads.clear()
    servers = RewardServers(settings, [RewardServer(server.url, "/log", None)], str(path), dtype="auto")
    servers.check(servers.servers[0])  # a GPU server (--dtype auto) on a bf16 checkpoint starts
    offset["value"] = 0.1  # a head bias left at its random initialisation: still caught
    try:
        with pytest.raises(RewardModelError, match="same offset on every probe|differences"):
            servers.check(servers.servers[0])
    finally:
        offset["value"] = 0.0
    assert len(loads) == 1
