"""Issue 13: the async mode's pieces, each tested against an independent reference."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_dapo.algo import RolloutCorrection, policy_loss
from megatron_dapo.config import load_config


def test_algorithm_tis_is_deprecated_for_rollout_correction_tis():
    """tis.enable warns once, in one line naming the replacement; the replacement is the same
    loss and gradient, bit for bit, on realistic log-prob gaps (|log rho| well below the clamp)."""
    with pytest.warns(FutureWarning, match=r"algorithm\.rollout_correction\.mode=tis") as rec:
        load_config(None, ["model.path=/nonexistent", "algorithm.tis.enable=true", "algorithm.tis.cap=1.5"])
    assert len(rec) == 1 and "\n" not in str(rec[0].message)
    assert "threshold=1.5" in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["model.path=/nonexistent", "algorithm.rollout_correction.mode=tis"])

    g = torch.Generator().manual_seed(0)
    shape = (4, 9)
    lp = (-torch.rand(shape, generator=g) * 3).requires_grad_(True)
    old = lp.detach() + 0.3 * torch.randn(shape, generator=g)
    rollout = old + 0.8 * torch.randn(shape, generator=g)  # some weights above the cap
    adv = torch.randn(shape[0], generator=g)
    mask = torch.rand(shape, generator=g) > 0.2
    common = dict(
        clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean", rollout_logprobs=rollout
    )
    loss_a, m_a = policy_loss(lp, old, adv, mask, tis_cap=1.5, **common)
    (grad_a,) = torch.autograd.grad(loss_a, lp)
    rc = RolloutCorrection(mode="tis", level="token", threshold=1.5)
    loss_b, m_b = policy_loss(lp, old, adv, mask, rollout_correction=rc, **common)
    (grad_b,) = torch.autograd.grad(loss_b, lp)
    assert float(m_a["tis_clipfrac"]) > 0  # the cap is hit, so the comparison covers truncation
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert torch.equal(m_a["tis_clipfrac"], m_b["rc_fraction"])
