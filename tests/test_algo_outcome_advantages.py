"""outcome_advantages (grpo, rloo, reinforce_plus_plus_baseline), KL in the reward and the KL
controllers, against hand values and loops written from the papers' formulas.

Checked against verl v0.9.0 (tag, commit 483b8a009ba3a97563edee3a19887e4862b8094a; the
release/v0.9.0 branch toward 0.9.1 does not change these files):
``compute_{grpo, rloo, reinforce_plus_plus_baseline}_outcome_advantage``, ``masked_whiten``
(verl/utils/torch_functional.py), ``FixedKLController`` / ``AdaptiveKLController`` and
``apply_kl_penalty`` (verl/trainer/ppo/ray_trainer.py).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megatron_dapo.algo import (
    ADV_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    group_advantages,
    kl_controller,
    kl_reward_penalty,
    outcome_advantages,
)


def _mask(lens, t=4):
    return torch.arange(t)[None, :] < torch.tensor(lens)[:, None]


def test_rloo_hand_values():
    # group a: 1, 0, 0, 1 -> each minus the mean of the other three: 1 - 1/3, 0 - 2/3, ...
    # group b alone: keeps its score, as verl
    scores = torch.tensor([1.0, 0.0, 0.7, 0.0, 1.0], dtype=torch.float64)
    mask = _mask([4, 2, 3, 0, 1])
    adv = outcome_advantages(scores, ["a", "a", "b", "a", "a"], mask, "rloo")
    per_response = [2 / 3, -2 / 3, 0.7, -2 / 3, 2 / 3]
    want = torch.tensor(per_response, dtype=torch.float64)[:, None] * mask
    torch.testing.assert_close(adv, want, rtol=1e-12, atol=0)


def test_rloo_is_leave_one_out_on_random_groups():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(12, generator=g, dtype=torch.float64)
    keys = [i % 4 for i in range(11)] + [99]  # groups of 3, 3, 3, 2 and a singleton
    mask = torch.ones(12, 3, dtype=torch.bool)
    adv = outcome_advantages(scores, keys, mask, "rloo")[:, 0]
    for i in range(12):
        others = [float(scores[j]) for j in range(12) if keys[j] == keys[i] and j != i]
        want = float(scores[i]) - (sum(others) / len(others) if others else 0.0)
        assert adv[i].item() == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_reinforce_plus_plus_baseline_hand_values():
    # group g: 1, 0 -> 0.5, -0.5; h alone: 2 (baseline 0). Whitened over the 6 response tokens.
    scores = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
    mask = _mask([2, 1, 3])
    adv = outcome_advantages(scores, ["g", "g", "h"], mask, "reinforce_plus_plus_baseline")
    tokens = [0.5, 0.5, -0.5, 2.0, 2.0, 2.0]
    m, v = statistics.fmean(tokens), statistics.variance(tokens)  # unbiased, as verl's masked_var
    want = torch.zeros(3, 4, dtype=torch.float64)
    want[mask] = torch.tensor([(x - m) / math.sqrt(v + 1e-8) for x in tokens], dtype=torch.float64)
    torch.testing.assert_close(adv, want, rtol=1e-12, atol=0)
    assert adv[mask].mean().item() == pytest.approx(0.0, abs=1e-12)


def test_reinforce_plus_plus_baseline_needs_two_tokens():
    with pytest.raises(ValueError, match="needs at least 2, got 1"):
        outcome_advantages(torch.tensor([1.0, 0.0]), [0, 0], _mask([1, 0]), "reinforce_plus_plus_baseline")


def test_equal_scores_give_zero_not_nan():
    for est in ADV_ESTIMATORS:
        adv = outcome_advantages(torch.full((4,), 0.5), [0, 0, 1, 1], _mask([4, 1, 2, 3]), est)
        assert torch.equal(adv, torch.zeros(4, 4)), est


def test_grpo_and_dr_grpo_are_group_advantages_on_the_tokens():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(6, generator=g)
    keys = [0, 1, 0, 1, 0, 1]
    mask = _mask([4, 0, 1, 2, 3, 4])
    for norm in (True, False):
        adv = outcome_advantages(scores, keys, mask, "grpo", norm_adv_by_std_in_grpo=norm)
        assert torch.equal(adv, torch.where(mask, group_advantages(scores, keys, norm)[:, None], 0.0))
    dr = outcome_advantages(
        torch.tensor([1.0, -1.0, -1.0, -1.0]), [0] * 4, _mask([1, 2, 3, 4]), "grpo", False
    )
    assert dr[:, 0].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])  # score - group mean


def test_outcome_advantages_errors():
    with pytest.raises(ValueError, match="unknown adv_estimator 'gae'; choose one of grpo, rloo"):
        outcome_advantages(torch.zeros(2), [0, 0], _mask([1, 1]), "gae")
    with pytest.raises(ValueError, match=r"mask must be \(B, T\) with B = 2"):
        outcome_advantages(torch.zeros(2), [0, 0], _mask([1, 1, 1]), "rloo")


def test_kl_reward_penalty_hand_values():
    # k1 per token = old - ref; row 0: 0.5 + 0.25 = 0.75 over 2 tokens; row 1: 1.0 over 1; row 2 none
    old = torch.tensor([[-1.0, -1.0, 9.0], [-2.0, 7.0, 7.0], [5.0, 5.0, 5.0]], dtype=torch.float64)
    ref = old - torch.tensor([[0.5, 0.25, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    out = kl_reward_penalty(torch.tensor([1.0, 0.0, 1.0]), old, ref, mask, kind="kl", coef=0.1)
    assert out.scores.tolist() == pytest.approx([1.0 - 0.075, -0.1, 1.0], rel=1e-12)
    assert out.current_kl == pytest.approx((0.75 / 2 + 1.0 / 1 + 0.0) / 3, rel=1e-12)


def test_adaptive_controller_hand_values_and_resume():
    ctl = kl_controller("adaptive", 0.001, target_kl=0.1, horizon=10000)
    ctl.update(current_kl=0.5, n_steps=256)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.001 * (1 + 0.2 * 256 / 10000), rel=1e-15)
    ctl.update(current_kl=0.09, n_steps=100)  # error -0.1
    want = 0.001 * (1 + 0.2 * 256 / 10000) * (1 - 0.1 * 100 / 10000)
    assert ctl.value == pytest.approx(want, rel=1e-15)
    resumed = AdaptiveKLController(0.001, 0.1, 10000)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == ctl.value
    fixed = FixedKLController(0.01)
    fixed.update(5.0, 1000)
    assert fixed.value == 0.01 and fixed.state_dict() == {"type": "fixed", "value": 0.01}
    with pytest.raises(ValueError, match="the checkpoint's KL controller is 'adaptive'"):
        fixed.load_state_dict(ctl.state_dict())


def test_kl_controller_errors():
    with pytest.raises(ValueError, match="kl_ctrl.type='pid' is not one of fixed, adaptive"):
        kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="kl_ctrl.horizon must be > 0"):
        kl_controller("adaptive", 0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="needs kl_ctrl.target_kl and kl_ctrl.horizon"):
        kl_controller("adaptive", 0.1)


def test_adaptive_controller_refuses_a_step_that_would_flip_its_sign():
    """horizon 10 with 512 responses: 1 - 0.2 * 512 / 10 = -9.24, the coefficient would go
    0.05 -> -0.462 and on to a growing KL bonus; the config refuses such a horizon, and the
    controller refuses the update rather than apply it."""
    ctl = kl_controller("adaptive", 0.05, target_kl=0.1, horizon=10)
    with pytest.raises(ValueError, match=r"kl_ctrl.horizon=10 with 512 responses would multiply .* by -9.24"):
        ctl.update(current_kl=0.0, n_steps=512)
    assert ctl.value == 0.05
