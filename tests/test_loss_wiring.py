"""The loss and advantage knobs from the config to the actor's micro-batch loss and the driver's
batch: `algorithm.policy_loss`, `tau_pos`/`tau_neg`, `entropy_coeff`, `adv_estimator`, checked
against hand-computed values (the layouts and the gradients are in test_actor_layouts)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import hand_micro, loss_settings

from megatron_dapo.actor.train_step import STAT_NAMES, micro_batch_loss
from megatron_dapo.algo import ADV_ESTIMATORS, POLICY_LOSS_TYPES
from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.config.validate import CHOICES
from megatron_dapo.data.types import PromptSample
from megatron_dapo.driver.batch_builder import build_actor_batch
from megatron_dapo.rollout.types import RolloutSample


def _load(*overrides: str):
    return load_config(None, ["model.path=/nonexistent", *overrides])


def test_choices_are_the_algorithms_names():
    assert CHOICES["algorithm.policy_loss"] == POLICY_LOSS_TYPES
    assert CHOICES["algorithm.adv_estimator"] == ADV_ESTIMATORS
    cfg = _load()
    assert (cfg.algorithm.policy_loss, cfg.algorithm.adv_estimator, cfg.algorithm.entropy_coeff) == (
        "vanilla",
        "grpo",
        0.0,
    )


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "algorithm.policy_loss=gpso",
            "algorithm.policy_loss='gpso' is not one of vanilla, .*did you mean 'gspo'",
        ),
        ("algorithm.policy_loss=CISPO", "did you mean 'cispo'"),
        ("algorithm.adv_estimator=rlo", "algorithm.adv_estimator='rlo' is not one of .*did you mean 'rloo'"),
        ("algorithm.tau_pos=0", r"algorithm.tau_pos=0.0 must be > 0 \(SAPO's gate temperature"),
        ("algorithm.tau_neg=-1", "algorithm.tau_neg=-1.0 must be > 0"),
        ("algorithm.entropy_coeff=-0.01", "algorithm.entropy_coeff=-0.01 must be >= 0"),
        (
            "algorithm.clip_ratio_low=1.0",
            r"with algorithm.policy_loss=vanilla .*1.0 \(no lower bound\) is allowed with algorithm.policy_loss=cispo",
        ),
    ],
)
def test_bad_loss_knobs_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        _load(override)


def test_cispo_may_drop_its_lower_bound():
    cfg = _load("algorithm.policy_loss=cispo", "algorithm.clip_ratio_low=1.0")
    assert cfg.algorithm.clip_ratio_low == 1.0
    with pytest.raises(ConfigError, match="must be in \\[0, 1\\] with algorithm.policy_loss=cispo"):
        _load("algorithm.policy_loss=cispo", "algorithm.clip_ratio_low=1.5")
    with pytest.raises(ConfigError, match="with algorithm.policy_loss=gspo"):
        _load("algorithm.policy_loss=gspo", "algorithm.clip_ratio_low=1.0")


def _settings(**over):
    return loss_settings(**over)


def _micro():
    gen = torch.Generator().manual_seed(3)
    lp = -torch.rand(2, 5, generator=gen, dtype=torch.float64) - 0.1
    old = lp + 0.3 * torch.randn(2, 5, generator=gen, dtype=torch.float64)
    return lp.requires_grad_(), hand_micro(old)


def test_the_loss_type_and_sapo_temperatures_reach_the_loss():
    lp, micro = _micro()
    adv = micro.advantages[:, None].expand_as(lp)
    keep = micro.loss_mask
    # gpg: -A log pi, over the global token count
    loss, _ = micro_batch_loss(lp, torch.zeros_like(lp), micro, _settings(policy_loss="gpg"))
    assert float(loss.detach()) == pytest.approx(float(-(adv * lp.detach())[keep].sum() / 10.0), rel=1e-12)
    # sapo: -A 4/tau sigmoid(tau (r - 1)), tau_pos for A > 0, tau_neg otherwise
    loss, _ = micro_batch_loss(
        lp, torch.zeros_like(lp), micro, _settings(policy_loss="sapo", tau_pos=2.0, tau_neg=0.5)
    )
    r = (lp.detach() - micro.old_logprobs).exp()
    tau = torch.where(adv > 0, 2.0, 0.5)
    want = (-adv * 4 / tau * torch.sigmoid(tau * (r - 1)))[keep].sum() / 10.0
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-12)


def test_entropy_bonus_is_subtracted_with_the_global_normaliser():
    lp, micro = _micro()
    ent = torch.rand(
        lp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    ).requires_grad_()
    base, _ = micro_batch_loss(lp, ent, micro, _settings())
    loss, stats = micro_batch_loss(lp, ent, micro, _settings(entropy_coeff=0.25))
    agg = float(ent[micro.loss_mask].sum() / 10.0)
    assert float(stats[STAT_NAMES.index("entropy_loss")]) == pytest.approx(agg, rel=1e-12)
    assert float(stats[STAT_NAMES.index("loss")]) == pytest.approx(
        float(base.detach()), rel=1e-12
    )  # pg alone
    assert float(loss.detach()) == pytest.approx(float(base.detach()) - 0.25 * agg, rel=1e-12)
    loss.backward()
    want = micro.loss_mask.double() * (-0.25 / 10.0)
    assert torch.allclose(ent.grad, want, rtol=1e-12, atol=1e-15), ent.grad - want
    # seq-mean-token-mean: each row's mean entropy, over the global sequence count
    _, stats = micro_batch_loss(
        lp, ent, micro, _settings(entropy_coeff=0.25, loss_agg_mode="seq-mean-token-mean")
    )
    rows = [float(ent[i][micro.loss_mask[i]].mean()) for i in range(2)]
    assert float(stats[STAT_NAMES.index("entropy_loss")]) == pytest.approx(sum(rows) / 3.0, rel=1e-12)


def _sample(group: int, reward: float, length: int) -> RolloutSample:
    prompt = PromptSample(
        index=group, data_source="d", messages=[], prompt_text="p", prompt_ids=[1, 2], ground_truth="1"
    )
    return RolloutSample(
        group_id=group,
        prompt=prompt,
        response_ids=[3] * length,
        rollout_logprobs=[-1.0] * length,
        response_text="r",
        finish_reason="stop",
        score=reward,
        acc=False,
        pred="",
        overlong_penalty=0.0,
        final_reward=reward,
        weight_version=0,
        truncated=False,
    )


# group 7: rewards 1, 0, 0 (lengths 2, 1, 3); group 9: rewards 1, 1 (lengths 2, 2)
SAMPLES = [(7, 1.0, 2), (7, 0.0, 1), (7, 0.0, 3), (9, 1.0, 2), (9, 1.0, 2)]


def _hand_advantages(estimator: str, norm: bool = True) -> list[float]:
    third = 1 / 3
    if estimator == "grpo":
        std = math.sqrt(((1 - third) ** 2 + 2 * third**2) / 2)  # unbiased, as torch.std
        centred = [1 - third, -third, -third, 0.0, 0.0]
        return [c / (std + 1e-6) if i < 3 and norm else c for i, c in enumerate(centred)]
    if estimator == "rloo":  # the score minus the mean of the others
        return [1.0, -0.5, -0.5, 0.0, 0.0]
    # reinforce_plus_plus_baseline: score - group mean, whitened over the 10 response tokens
    centred = [1 - third, -third, -third, 0.0, 0.0]
    tokens = [c for c, (_, _, n) in zip(centred, SAMPLES) for _ in range(n)]
    m = sum(tokens) / len(tokens)
    v = sum((x - m) ** 2 for x in tokens) / (len(tokens) - 1)
    return [(c - m) / math.sqrt(v + 1e-8) for c in centred]


@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
def test_adv_estimator_reaches_the_batch(estimator):
    samples = [_sample(*s) for s in SAMPLES]
    batch, metrics = build_actor_batch(samples, adv_estimator=estimator)
    assert batch.advantages.tolist() == pytest.approx(_hand_advantages(estimator), abs=1e-6)
    assert metrics["train/advantages/max"] == pytest.approx(max(_hand_advantages(estimator)), abs=1e-6)
    if estimator == "grpo":  # Dr. GRPO: no division by the group std
        batch, _ = build_actor_batch(samples, adv_estimator="grpo", norm_adv_by_std=False)
        assert batch.advantages.tolist() == pytest.approx(_hand_advantages("grpo", norm=False), abs=1e-7)
