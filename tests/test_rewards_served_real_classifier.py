"""A classifier reward model through the real SGLang 0.5.23 CPU server (``--is-embedding``,
``/classify``) on a tiny random Qwen2ForSequenceClassification saved by transformers (sharded, no
``score.bias``).

In order, on one server (a start takes 20-40 s on an idle 2-core machine):

1. The original checkpoint, served as it is, fails the start-up check, whose line names the
   missing bias; its scores are off from transformers' by one constant (SGLang's head bias at its
   random initialisation).
2. The same server loads the served copy (``/update_weights_from_disk``, through the same loader
   and index as a start): the check passes, and the client's scores equal transformers' within
   1e-4 for several conversations, asked by the servers' URLs and by ``reward.model.url``.

A fresh server started on a served copy (whose head bias is built at a new random value and
replaced by the checkpoint's zero again) passing the check and scoring as transformers is
test_eval_reward_real_classifier's: `eval` writes the copy of the same sharded checkpoint and
starts one.
"""

from __future__ import annotations

import httpx
import pytest
from reward_model_fixtures import make_tiny_classifier, served_settings
from sglang_fixtures import start_cpu_server, stop_cpu_server

from megatron_dapo.rewards.served import (
    BlockingRewardModel,
    RewardModelError,
    RewardSample,
    ServedRewardSettings,
    check_classifier_server,
    prepare_served_checkpoint,
)
from megatron_dapo.rewards.served.classifier import load_tokenizer, render_ids
from megatron_dapo.rewards.served.startup_check import reference_scores

TOLERANCE = 1e-4
EMBEDDING = ["--is-embedding"]

SAMPLES = [
    RewardSample(0, [{"role": "user", "content": "What is 6*7?"}], "6*7=42. Answer: 42"),
    RewardSample(1, [{"role": "user", "content": "What is 6*7?"}], "Answer: 48"),
    RewardSample(
        2,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        "Blue",
    ),
    RewardSample(3, [{"role": "user", "content": "Spell cat backwards."}], "tac, that is: t-a-c"),
]


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    """Sharded, so the served copy's index (which SGLang's loader follows) is what is tested."""
    return make_tiny_classifier(tmp_path_factory.mktemp("rm") / "qwen2_rm", max_shard_size="100KB")


@pytest.fixture(scope="module")
def expected(rm) -> list[float]:
    """transformers' score of each sample, on the conversation its chat template renders."""
    tokenizer = load_tokenizer(str(rm), "test")
    ids = [render_ids(tokenizer, s.messages, s.response, "test") for s in SAMPLES]
    return [row[0] for row in reference_scores(rm, ids)]


def served_scores(settings: ServedRewardSettings, urls=None) -> list[float]:
    with BlockingRewardModel(settings, urls) as model:
        outcomes = model.score_many(SAMPLES)
    assert all(o.scored and o.attempts == 1 for o in outcomes), outcomes
    return [o.score for o in outcomes]


@pytest.fixture(scope="module")
def served_copy(rm, tmp_path_factory):
    served = prepare_served_checkpoint(rm, tmp_path_factory.mktemp("served") / "qwen2_rm")
    assert served.zero_filled == ("score.bias",)
    return served.path


@pytest.fixture(scope="module")
def server(rm, tmp_path_factory):
    """Started on the original checkpoint; test 2 loads the served copy into it."""
    handle = start_cpu_server(rm, tmp_path_factory.mktemp("sglang"), extra_args=EMBEDDING)
    yield handle
    stop_cpu_server(handle)


def test_the_original_checkpoint_fails_the_start_up_check_naming_the_missing_bias(rm, expected, server):
    url = server.url
    with pytest.raises(RewardModelError) as e:
        check_classifier_server(url, rm)
    line = str(e.value)
    assert "\n" not in line and url in line and str(rm) in line
    assert (
        "has no score.bias" in line
        and "qwen2_classification.py:47" in line
        and "random initialisation" in line
    )
    assert "prepare_served_checkpoint" in line
    # the defect itself: one constant offset on every conversation (the bias's random draw; the
    # check above raised, so it is past the tolerance, however small the draw was this start)
    served = served_scores(served_settings("classifier", path=str(rm)), [url])
    offsets = [s - r for s, r in zip(served, expected)]
    assert max(offsets) - min(offsets) < TOLERANCE and abs(offsets[0]) > TOLERANCE, offsets


def test_the_served_copy_passes_the_check_and_scores_as_transformers(rm, expected, server, served_copy):
    url = server.url
    reply = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(served_copy)}, timeout=600)
    assert reply.status_code == 200 and reply.json()["success"], reply.text
    check = check_classifier_server(url, rm)
    assert check.max_abs_diff <= TOLERANCE and len(check.served) == 2
    assert len({round(e, 3) for e in expected}) == len(expected), "the texts score differently"
    by_path = served_scores(served_settings("classifier", path=str(rm)), [url])
    assert by_path == pytest.approx(expected, abs=TOLERANCE)
    # given by URL, the client renders with the tokenizer the server reports
    by_url = served_scores(served_settings("classifier", url=url))
    assert by_url == pytest.approx(expected, abs=TOLERANCE)
