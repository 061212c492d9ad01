"""The reference-KL knobs from the config to the micro-batch loss and the driver's reward penalty,
against hand-computed values (the actor's layouts and HF are in test_reference_kl, the whole
stack and its resume in test_driver_e2e)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from helpers import hand_micro, loss_settings

from megatron_dapo.actor.batch import make_actor_batch
from megatron_dapo.actor.micro_batches import MicroBatch
from megatron_dapo.actor.train_step import STAT_NAMES, micro_batch_loss
from megatron_dapo.algo import KL_CONTROL_TYPES, KL_PENALTY_KINDS
from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.config.validate import CHOICES
from megatron_dapo.driver.kl_reward import KLInReward


def _load(*overrides: str):
    return load_config(None, ["model.path=/nonexistent", *overrides])


def test_choices_are_the_algorithms_names_and_verls_defaults():
    assert CHOICES["actor.kl_loss_type"] == KL_PENALTY_KINDS
    assert CHOICES["algorithm.kl_penalty"] == tuple(k for k in KL_PENALTY_KINDS if not k.endswith("+"))
    assert CHOICES["algorithm.kl_ctrl.type"] == KL_CONTROL_TYPES
    cfg = _load()
    assert (cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type) == (
        False,
        0.001,
        "low_var_kl",
    )
    assert (cfg.algorithm.use_kl_in_reward, cfg.algorithm.kl_penalty) == (False, "kl")
    ctrl = cfg.algorithm.kl_ctrl
    assert (ctrl.type, ctrl.kl_coef, ctrl.target_kl, ctrl.horizon) == ("fixed", 0.001, 0.1, 10000)


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "actor.kl_loss_type=low_var",
            "actor.kl_loss_type='low_var' is not one of .*did you mean 'low_var_kl'",
        ),
        ("actor.kl_loss_coef=-0.1", r"actor.kl_loss_coef=-0.1 must be >= 0 \(the KL loss's weight"),
        ("algorithm.kl_penalty=k3+", "algorithm.kl_penalty='k3\\+' is not one of .*did you mean 'k3'"),
        ("algorithm.kl_ctrl.type=adaptiv", "algorithm.kl_ctrl.type='adaptiv' is not one of .*'adaptive'"),
        ("algorithm.kl_ctrl.kl_coef=-1", "algorithm.kl_ctrl.kl_coef=-1.0 must be >= 0"),
        ("algorithm.kl_ctrl.kl_cof=0.1", "algorithm.kl_ctrl.kl_coef"),  # the nearest key
        ("actor.use_kl_los=true", "actor.use_kl_loss"),
    ],
)
def test_bad_kl_knobs_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        _load(override)


@pytest.mark.parametrize("name", ["target_kl", "horizon"])
def test_the_adaptive_controller_needs_a_positive_target_and_horizon(name):
    _load("algorithm.kl_ctrl.type=fixed", f"algorithm.kl_ctrl.{name}=0")  # unused by fixed
    with pytest.raises(
        ConfigError, match=f"algorithm.kl_ctrl.{name}=0.0 must be > 0 with algorithm.kl_ctrl.type=adaptive"
    ):
        _load("algorithm.kl_ctrl.type=adaptive", f"algorithm.kl_ctrl.{name}=0")


def _micro(ref_shift: float):
    gen = torch.Generator().manual_seed(7)
    lp = -torch.rand(2, 5, generator=gen, dtype=torch.float64) - 0.1
    ref = lp + ref_shift * torch.randn(2, 5, generator=gen, dtype=torch.float64)
    return lp.requires_grad_(), hand_micro(lp.clone(), ref)


def _settings(**over):
    return loss_settings(**over)


def test_kl_loss_is_added_with_the_global_normaliser_and_its_gradient_is_k3s():
    lp, micro = _micro(0.3)
    ent = torch.zeros_like(lp)
    base, _ = micro_batch_loss(lp, ent, micro, _settings())
    loss, stats = micro_batch_loss(lp, ent, micro, _settings(kl_loss_coef=0.25, kl_type="low_var_kl"))
    keep = micro.loss_mask
    d = (micro.ref_logprobs - lp.detach())[keep]  # k3 = exp(ref - lp) - (ref - lp) - 1
    k3 = torch.exp(d) - d - 1
    assert float(stats[STAT_NAMES.index("kl_loss")]) == pytest.approx(float(k3.sum() / 10.0), rel=1e-12)
    # the metric is a float32 mean (algo.kl_loss)
    assert float(stats[STAT_NAMES.index("ref_kl")]) == pytest.approx(float(k3.sum()), rel=1e-6)
    assert float(stats[STAT_NAMES.index("ref_tokens")]) == float(keep.sum())
    assert float(loss.detach()) == pytest.approx(
        float(base.detach()) + 0.25 * float(k3.sum() / 10.0), rel=1e-12
    )
    # d k3 / d lp = 1 - exp(ref - lp), times coef / N
    (grad,) = torch.autograd.grad(loss - base, lp)
    want = torch.zeros_like(lp)
    want[keep] = 0.25 / 10.0 * (1 - torch.exp(d))
    assert torch.allclose(grad, want, rtol=1e-10, atol=1e-14)


def test_reference_without_kl_loss_reports_ref_kl_only():
    lp, micro = _micro(0.3)
    base_micro = MicroBatch(**{**micro.__dict__, "ref_logprobs": None})
    base, base_stats = micro_batch_loss(lp, torch.zeros_like(lp), base_micro, _settings())
    loss, stats = micro_batch_loss(lp, torch.zeros_like(lp), micro, _settings(kl_type="kl"))
    assert float(loss.detach()) == float(base.detach())
    assert float(stats[STAT_NAMES.index("kl_loss")]) == 0.0
    d = (lp.detach() - micro.ref_logprobs)[micro.loss_mask]  # k1
    assert float(stats[STAT_NAMES.index("ref_kl")]) == pytest.approx(float(d.sum()), rel=1e-6)
    assert float(base_stats[STAT_NAMES.index("ref_tokens")]) == 0.0


def _cfg(**over):
    # a step of 2 prompts x 2 responses, as _batch: the adaptive controller's horizon is checked
    # against the responses per step
    step = [
        "trainer.train_batch_size=2",
        "rollout.gen_batch_size=2",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=2",
    ]
    return _load(
        *step, "algorithm.use_kl_in_reward=true", *[f"algorithm.{k}={v}" for k, v in over.items()]
    ).algorithm


def _batch():
    # two groups of two; responses of 2, 3, 1 and 2 tokens
    batch = make_actor_batch(
        [[1, 2], [1, 2], [3], [3]],
        [[4, 5], [6, 7, 8], [9], [4, 4]],
        advantages=torch.zeros(4),
        group_index=[0, 0, 1, 1],
    )
    return replace(batch, scores=torch.tensor([1.0, 0.0, 1.0, 1.0]))


def test_kl_in_reward_by_hand_then_the_adaptive_controller_moves():
    batch = _batch()
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0], [-0.5, 0.0, 0.0], [-2.0, -2.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-1.0, -0.5, -1.5], [-0.5, 0.0, 0.0], [-1.0, -1.0, 0.0]])
    kl = KLInReward(
        _cfg(
            kl_penalty="kl",
            **{
                "kl_ctrl.type": "adaptive",
                "kl_ctrl.kl_coef": 0.5,
                "kl_ctrl.target_kl": 0.1,
                "kl_ctrl.horizon": 8,
            },
        )
    )
    out, metrics = kl.apply(batch, old, ref)
    # k1 summed over each response: 0.5, -0.5 + 0.5 = 0, 0, -1 - 1 = -2
    per_seq = [0.5, 0.0, 0.0, -2.0]
    scores = [s - 0.5 * k for s, k in zip([1.0, 0.0, 1.0, 1.0], per_seq)]
    assert out.scores.tolist() == pytest.approx(scores)
    # grpo on the penalised scores: group 0 [0.75, 0], group 1 [1, 2]; (x - mean) / (std + 1e-6)
    std = math.sqrt(2 * 0.375**2)
    assert out.advantages.tolist() == pytest.approx(
        [
            0.375 / (std + 1e-6),
            -0.375 / (std + 1e-6),
            -0.5 / (math.sqrt(0.5) + 1e-6),
            0.5 / (math.sqrt(0.5) + 1e-6),
        ]
    )
    assert torch.equal(out.old_logprobs, old) and torch.equal(out.ref_logprobs, ref)
    # the batch mean of each response's mean KL: (0.25 + 0 + 0 - 1) / 4
    current = (0.25 + 0.0 + 0.0 - 1.0) / 4
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    # below the target by far: error clipped to -0.2; coef *= 1 - 0.2 * 4 / 8
    assert kl.state_dict() == {"type": "adaptive", "value": pytest.approx(0.5 * 0.9)}
    _, again = kl.apply(batch, old, ref)
    assert again["actor/reward_kl_penalty_coeff"] == pytest.approx(0.45)


def test_the_controller_state_resumes_and_refuses_another_type():
    adaptive = KLInReward(_cfg(**{"kl_ctrl.type": "adaptive"}))
    adaptive.load_state_dict({"type": "adaptive", "value": 0.0123})
    assert adaptive.controller.value == 0.0123
    fixed = KLInReward(_cfg())
    with pytest.raises(
        ValueError,
        match="the checkpoint's KL controller is 'adaptive' but this run's kl_ctrl.type is 'fixed'",
    ):
        fixed.load_state_dict({"type": "adaptive", "value": 0.0123})
