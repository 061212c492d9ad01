"""A response the reward model could not score (reward.model: time-out, 5xx, unparseable verdict,
dead server) is never scored 0: it leaves its group. By hand: the group filter judges the scored
members only and drops a group left with fewer than two; the batch leaves the response out and
the group's advantages come from its scored members."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from megatron_dapo.data.types import PromptSample
from megatron_dapo.driver.batch_builder import build_actor_batch
from megatron_dapo.rollout.scoring import GroupScoring
from megatron_dapo.rollout.types import RolloutSample


def _sample(group, score, unscored=None, n_tokens=2):
    prompt = PromptSample(
        index=group, data_source="d", messages=[], prompt_text="p", prompt_ids=[1], ground_truth="1"
    )
    return RolloutSample(
        group_id=group,
        prompt=prompt,
        response_ids=[4] * n_tokens,
        rollout_logprobs=[-1.0] * n_tokens,
        response_text="r",
        finish_reason="stop",
        score=score,
        acc=score > 0,
        pred="",
        overlong_penalty=0.0,
        final_reward=score,
        weight_version=0,
        truncated=False,
        unscored=unscored,
    )


def _judge(samples, enable=True):
    cfg = SimpleNamespace(filter_groups_enable=enable, filter_metric="acc")
    return GroupScoring(cfg, scorer=None, tokenizer=None).judge(samples)


def test_the_filter_judges_scored_members_only():
    # scored: +1, -1 (mixed) beside two unscored: kept
    assert _judge(
        [_sample(0, 1.0), _sample(0, -1.0), _sample(0, 0.0, "timeout"), _sample(0, 0.0, "down")]
    ) == (
        "kept",
        True,
    )
    # scored: +1, +1 (no spread among them; the unscored ones are not a -1): filtered all_correct
    assert _judge([_sample(0, 1.0), _sample(0, 1.0), _sample(0, 0.0, "server_error")]) == (
        "all_correct",
        False,
    )
    # one scored response left: no baseline for it, the group goes (refilled by dynamic sampling)
    assert _judge([_sample(0, 1.0), _sample(0, 0.0, "timeout"), _sample(0, 0.0, "unparseable")]) == (
        "unscored",
        False,
    )
    # even with the filter off: a group that cannot have advantages is not trained on
    assert _judge([_sample(0, 1.0), _sample(0, 0.0, "timeout")], enable=False)[0] == "unscored"
    assert _judge([_sample(0, 1.0), _sample(0, 1.0)], enable=False) == ("kept", False)


def test_the_batch_leaves_unscored_responses_out_and_takes_advantages_from_the_scored():
    samples = [
        _sample(0, 1.0),
        _sample(0, -1.0),
        _sample(0, 0.0, "timeout"),  # would pull the group mean to 0 if it counted as a 0
        _sample(0, 1.0),
        _sample(1, 1.0),
        _sample(1, -1.0),
    ]
    batch, metrics = build_actor_batch(samples)
    assert len(batch) == 5 and metrics["train/unscored_left_out"] == 1.0
    # group 0's scored: 1, -1, 1 -> mean 1/3, unbiased std sqrt(4/3)
    mean, std = 1 / 3, math.sqrt(((2 / 3) ** 2 * 2 + (4 / 3) ** 2) / 2)
    want = [(x - mean) / (std + 1e-6) for x in (1.0, -1.0, 1.0)] + [
        1 / (math.sqrt(2) + 1e-6),
        -1 / (math.sqrt(2) + 1e-6),
    ]
    assert batch.advantages.tolist() == pytest.approx(want, abs=1e-6)
