"""Multi-turn episodes into the actor's batch, by hand: the environment's tokens are outside the
loss mask (and outside the sampled mask that the KL in the reward and REINFORCE++'s whitening
count), overlong filtering clears a truncated episode's loss tokens but not its sampled ones, and
the reward penalty sums over sampled tokens only."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from megatron_dapo.config import load_config
from megatron_dapo.data.types import PromptSample
from megatron_dapo.driver.batch_builder import build_actor_batch
from megatron_dapo.driver.kl_reward import KLInReward
from megatron_dapo.rollout.types import RolloutSample


def _sample(group, reward, mask, truncated=False):
    prompt = PromptSample(
        index=group, data_source="d", messages=[], prompt_text="p", prompt_ids=[1, 2], ground_truth="1"
    )
    n = len(mask)
    return RolloutSample(
        group_id=group,
        prompt=prompt,
        response_ids=[5] * n,
        rollout_logprobs=[-1.0 if m else 0.0 for m in mask],
        response_text="r",
        finish_reason="length" if truncated else "stop",
        score=reward,
        acc=reward > 0,
        pred="",
        overlong_penalty=0.0,
        final_reward=reward,
        weight_version=0,
        truncated=truncated,
        loss_mask=list(mask),
        episode={"turns": [], "end": "stop"},
    )


# group 0: a 2-turn episode (2 sampled, 3 environment, 1 sampled) and a single sampled turn;
# group 1: a truncated episode and a plain one
SAMPLES = [
    _sample(0, 1.0, [1, 1, 0, 0, 0, 1]),
    _sample(0, -1.0, [1, 1, 1]),
    _sample(1, 1.0, [1, 0, 0, 1, 1], truncated=True),
    _sample(1, -1.0, [1, 1]),
]


def test_masks_by_hand():
    batch, metrics = build_actor_batch(SAMPLES, overlong_filter=True)
    want_sampled = [
        [1, 1, 0, 0, 0, 1],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 1, 0],
        [1, 1, 0, 0, 0, 0],
    ]
    assert batch.sampled_mask.int().tolist() == want_sampled
    want_loss = [row if i != 2 else [0] * 6 for i, row in enumerate(want_sampled)]
    assert batch.response_mask.int().tolist() == want_loss
    assert batch.num_loss_tokens() == 3 + 3 + 2
    # the environment's tokens are in the sequence (the model reads them), outside every mask
    assert batch.response_lens.tolist() == [6, 3, 5, 2]
    # mean token prob over the loss tokens only: every one has log-prob -1
    assert metrics["rollout/mean_token_prob"] == pytest.approx(math.exp(-1.0))


def test_reinforce_plus_plus_whitens_over_sampled_tokens_only():
    batch, _ = build_actor_batch(SAMPLES, adv_estimator="reinforce_plus_plus_baseline")
    centred = [1.0, -1.0, 1.0, -1.0]  # each group's scores minus its mean
    sampled = [3, 3, 3, 2]  # sampled tokens per response (the truncated one's count too)
    tokens = [c for c, n in zip(centred, sampled) for _ in range(n)]
    m = sum(tokens) / len(tokens)
    v = sum((x - m) ** 2 for x in tokens) / (len(tokens) - 1)
    want = [(c - m) / math.sqrt(v + 1e-8) for c in centred]
    assert batch.advantages.tolist() == pytest.approx(want, abs=1e-6)
    # counting the environment's tokens would give another mean: the test tells them apart
    every = [c for c, n in zip(centred, [6, 3, 5, 2]) for _ in range(n)]
    assert abs(sum(every) / len(every) - m) > 0.05


def test_kl_in_reward_sums_over_sampled_tokens():
    batch, _ = build_actor_batch(SAMPLES[:2])
    cfg = load_config(
        None,
        [
            "model.path=/x",
            "trainer.train_batch_size=2",
            "rollout.gen_batch_size=2",
            "rollout.n=2",
            "actor.ppo_mini_batch_size=2",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_penalty=kl",
            "algorithm.kl_ctrl.kl_coef=0.5",
        ],
    ).algorithm
    old = torch.full((2, 6), -1.0)
    ref = torch.full((2, 6), -1.5)  # k1 = 0.5 on every position, sampled or not
    out, metrics = KLInReward(cfg).apply(replace(batch, scores=torch.tensor([1.0, -1.0])), old, ref)
    # row 0 has 3 sampled tokens (1.5), row 1 three (1.5): score - 0.5 * 1.5
    assert out.scores.tolist() == pytest.approx([1.0 - 0.75, -1.0 - 0.75])
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)
