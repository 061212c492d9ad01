"""Rollout correction (algorithm.rollout_correction): hand-computed weights, factors and losses;
mode=none or rho == 1 leaves the DAPO loss and its gradient bit for bit as today; the knobs are
validated with one line; the actor's micro-batch loss carries the correction and its metrics."""

import math

import pytest
import torch
from helpers import loss_settings

from megatron_dapo.actor.micro_batches import MicroBatch
from megatron_dapo.actor.train_step import (
    STAT_NAMES,
    combine_stats,
    empty_stats,
    finish_stats,
    micro_batch_loss,
)
from megatron_dapo.algo import RolloutCorrection, correction_terms, policy_loss
from megatron_dapo.algo.rollout_correction import importance_weights
from megatron_dapo.config import ConfigError, load_config

# Two sequences; the second has a padded last position holding garbage.
# rho per loss token: row 0 = [3, 0.25, 1], row 1 = [1.5, 1].
RHO = [[3.0, 0.25, 1.0], [1.5, 1.0, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def _inputs():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, float("nan")]], dtype=torch.float64)
    log_rho = torch.tensor(RHO, dtype=torch.float64).log()
    rollout = old - log_rho
    rollout[1, 2] = float("inf")
    return old, rollout


def _close(t, values):
    assert torch.allclose(t.double(), torch.tensor(values, dtype=torch.float64), atol=1e-6), t


def test_token_level_weights_and_tis_factor_by_hand():
    old, rollout = _inputs()
    _close(importance_weights(old, rollout, MASK, "token"), [[3, 0.25, 1], [1.5, 1, 1]])
    t = correction_terms(old, rollout, MASK, RolloutCorrection("tis", "token", 2.0))
    _close(t.factor[MASK], [2, 0.25, 1, 1.5, 1])
    _close(t.metrics["rc_weight_mean"], 6.75 / 5)
    _close(t.metrics["rc_weight_max"], 3.0)
    _close(t.metrics["rc_weight_min"], 0.25)
    _close(t.metrics["rc_fraction"], 1 / 5)  # only the 3 is truncated


def test_token_level_mask_by_hand():
    old, rollout = _inputs()
    # Bounds [1/2, 2]: 3 and 0.25 are rejected.
    t = correction_terms(old, rollout, MASK, RolloutCorrection("mask", "token", 2.0))
    _close(t.factor[MASK], [0, 0, 1, 1, 1])
    _close(t.metrics["rc_fraction"], 2 / 5)
    # An explicit lower bound below 0.25 keeps it.
    t = correction_terms(old, rollout, MASK, RolloutCorrection("mask", "token", 2.0, 0.2))
    _close(t.factor[MASK], [0, 1, 1, 1, 1])


def test_sequence_levels_by_hand():
    old, rollout = _inputs()
    # Products: row 0 = 3 * 0.25 * 1 = 0.75, row 1 = 1.5; geometric means 0.75**(1/3), 1.5**(1/2).
    _close(importance_weights(old, rollout, MASK, "sequence")[MASK], [0.75] * 3 + [1.5] * 2)
    g0, g1 = 0.75 ** (1 / 3), math.sqrt(1.5)
    _close(importance_weights(old, rollout, MASK, "geometric")[MASK], [g0] * 3 + [g1] * 2)
    # TIS at cap 1.2 truncates the whole of row 1.
    t = correction_terms(old, rollout, MASK, RolloutCorrection("tis", "sequence", 1.2))
    _close(t.factor[MASK], [0.75] * 3 + [1.2] * 2)
    _close(t.metrics["rc_fraction"], 2 / 5)
    # Masking in [0.7, 1.2]: the product rejects row 1; in [0.95, 1.2] the geometric mean rejects both.
    t = correction_terms(old, rollout, MASK, RolloutCorrection("mask", "sequence", 1.2, 0.7))
    _close(t.factor[MASK], [1, 1, 1, 0, 0])
    t = correction_terms(old, rollout, MASK, RolloutCorrection("mask", "geometric", 1.2, 0.95))
    _close(t.factor[MASK], [0, 0, 0, 0, 0])
    _close(t.metrics["rc_fraction"], 1.0)


def test_loss_and_gradient_by_hand_with_the_global_normaliser():
    old, rollout = _inputs()
    lp = old.clone().nan_to_num(0.0).requires_grad_(True)  # ratio 1 on every loss token
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    # Per-token clipped loss at ratio 1 is -A: [-1, -1, -1], [2, 2]. TIS factors [2, .25, 1], [1.5, 1].
    loss, m = policy_loss(
        lp,
        old,
        adv,
        MASK,
        rollout_logprobs=rollout,
        rollout_correction=RolloutCorrection("tis", "token", 2.0),
    )
    assert loss.item() == pytest.approx((-2 - 0.25 - 1 + 3 + 2) / 5)
    loss.backward()
    # d/dlp of -A * r * w at r = 1 is -A * w, over the 5 tokens.
    _close(lp.grad, [[-2 / 5, -0.25 / 5, -1 / 5], [3 / 5, 2 / 5, 0]])
    assert m["rc_fraction"].item() == pytest.approx(0.2)
    # Masking keeps the normaliser: 2 rejected tokens still count in the token-mean (and in a
    # global num_tokens given by the caller).
    loss, _ = policy_loss(
        lp,
        old,
        adv,
        MASK,
        rollout_logprobs=rollout,
        rollout_correction=RolloutCorrection("mask", "token", 2.0),
    )
    assert loss.item() == pytest.approx((-1 + 2 + 2) / 5)
    loss, _ = policy_loss(
        lp,
        old,
        adv,
        MASK,
        num_tokens=10,
        rollout_logprobs=rollout,
        rollout_correction=RolloutCorrection("mask", "token", 2.0),
    )
    assert loss.item() == pytest.approx((-1 + 2 + 2) / 10)


def _random_batch(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    b, t = 4, 7
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    lp = old + 0.3 * torch.randn(b, t, generator=g, dtype=dtype)
    adv = torch.randn(b, generator=g, dtype=dtype)
    mask = torch.rand(b, t, generator=g) > 0.25
    return lp, old, adv, mask


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize(
    "rc",
    [
        None,
        RolloutCorrection("none"),
        *(
            RolloutCorrection(m, lv, 2.0)
            for m in ("tis", "mask")
            for lv in ("token", "sequence", "geometric")
        ),
    ],
    ids=str,
)
def test_none_or_rho_one_is_bitwise_todays_loss(agg, rc):
    lp, old, adv, mask = _random_batch(0)
    ref_lp = lp.clone().requires_grad_(True)
    ref, ref_m = policy_loss(ref_lp, old, adv, mask, clip_ratio_c=3.0, loss_agg_mode=agg, num_tokens=40)
    ref.backward()
    x = lp.clone().requires_grad_(True)
    active = rc is not None and rc.active
    got, m = policy_loss(
        x,
        old,
        adv,
        mask,
        clip_ratio_c=3.0,
        loss_agg_mode=agg,
        num_tokens=40,
        rollout_logprobs=old.clone() if active else None,  # rho == 1 everywhere
        rollout_correction=rc,
    )
    got.backward()
    assert torch.equal(got, ref) and torch.equal(x.grad, ref_lp.grad)
    for k in ref_m:
        assert torch.equal(m[k], ref_m[k]), k
    if active:
        assert m["rc_weight_mean"].item() == 1.0 and m["rc_fraction"].item() == 0.0


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"mode": "clip"}, "algorithm.rollout_correction.mode='clip' is not one of none, tis, mask"),
        (
            {"level": "seq"},
            "algorithm.rollout_correction.level='seq' is not one of token, sequence, geometric",
        ),
        ({"threshold": 0.0}, "algorithm.rollout_correction.threshold=0.0 must be > 0"),
        ({"mode": "mask", "threshold_lower": 3.0}, "threshold_lower=3.0 must be in \\[0, threshold=2.0\\)"),
        ({"mode": "tis", "threshold_lower": 0.5}, "threshold_lower only applies to mode=mask"),
    ],
)
def test_bad_settings_are_one_line_errors(kwargs, expected):
    with pytest.raises(ValueError, match=expected) as e:
        RolloutCorrection(**kwargs)
    assert "\n" not in str(e.value)
    overrides = [f"algorithm.rollout_correction.{k}={'null' if v is None else v}" for k, v in kwargs.items()]
    with pytest.raises(ConfigError, match=expected):
        load_config(None, ["model.path=/nonexistent", *overrides])


def test_config_defaults_and_refusals():
    cfg = load_config(None, ["model.path=/nonexistent"])
    rc = cfg.algorithm.rollout_correction
    assert (rc.mode, rc.level, rc.threshold, rc.threshold_lower) == ("none", "token", 2.0, None)
    assert cfg.trainer.mode == "sync"
    load_config(
        None,
        [
            "model.path=/nonexistent",
            "algorithm.rollout_correction.mode=mask",
            "algorithm.rollout_correction.level=geometric",
        ],
    )
    with pytest.raises(ConfigError, match="use rollout_correction.mode=tis and tis.enable=false"):
        load_config(
            None,
            ["model.path=/nonexistent", "algorithm.tis.enable=true", "algorithm.rollout_correction.mode=tis"],
        )
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(None, ["model.path=/nonexistent", "rollout.partial_rollout=true"])


def _micro(seed: int, rollout_shift: float | None):
    lp, old, adv, mask = _random_batch(seed)
    b, t = lp.shape
    return lp, MicroBatch(
        sample_index=torch.arange(b),
        tokens=torch.zeros(b, t, dtype=torch.long),
        position_ids=torch.arange(t).repeat(b, 1),
        labels=torch.zeros(b, t, dtype=torch.long),
        loss_mask=mask,
        score_mask=mask,
        advantages=adv,
        old_logprobs=old,
        rollout_logprobs=None if rollout_shift is None else old - rollout_shift,
    )


def _settings(rc):
    return loss_settings(num_tokens=30.0, num_seqs=4.0, norm_len=7.0, rollout_correction=rc)


def test_actor_micro_batch_loss_mode_none_is_bitwise_and_tis_applies():
    """The actor's loss (actor/train_step.py) with mode=none is today's, gradient included; with
    rho = exp(0.5) everywhere, TIS at cap 1.5 scales every token's loss by 1.5 and reports it."""
    lp, micro = _micro(1, rollout_shift=0.5)
    ent = torch.zeros_like(lp)
    today = _settings(None)
    a = lp.clone().requires_grad_(True)
    ref, ref_stats = micro_batch_loss(a, ent, micro, today)
    ref.backward()
    b = lp.clone().requires_grad_(True)
    got, stats = micro_batch_loss(b, ent, micro, _settings(RolloutCorrection("none")))
    got.backward()
    assert torch.equal(got, ref) and torch.equal(b.grad, a.grad) and torch.equal(stats, ref_stats)

    c = lp.clone().requires_grad_(True)
    tis, tis_stats = micro_batch_loss(c, ent, micro, _settings(RolloutCorrection("tis", "token", 1.5)))
    tis.backward()
    assert torch.allclose(tis, 1.5 * ref) and torch.allclose(c.grad, 1.5 * a.grad)
    out = finish_stats(tis_stats)
    assert out["rc_weight_mean"] == pytest.approx(math.exp(0.5))
    assert out["rc_fraction"] == pytest.approx(1.0)
    assert "rc_weight_mean" not in finish_stats(ref_stats)
    assert out["rc_weight_max"] == pytest.approx(math.exp(0.5)) and out["rc_weight_min"] == pytest.approx(
        math.exp(0.5)
    )
    assert "rc_weight_max" not in finish_stats(ref_stats)


def test_extremes_combine_by_max_and_sums_by_sum():
    """Micro-batches, mini-batches and ranks combine the weight's max/min as max/min, not sums."""
    _, micro_a = _micro(1, rollout_shift=0.5)
    _, micro_b = _micro(2, rollout_shift=-0.25)
    rc = _settings(RolloutCorrection("mask", "token", 10.0))
    stats = [
        micro_batch_loss(m.old_logprobs.clone(), torch.zeros_like(m.old_logprobs), m, rc)[1]
        for m in (micro_a, micro_b)
    ]
    total = combine_stats(combine_stats(empty_stats(), stats[0]), stats[1])
    out = finish_stats(total)
    assert out["rc_weight_max"] == pytest.approx(math.exp(0.5)) and out["rc_weight_min"] == pytest.approx(
        math.exp(-0.25)
    )
    n = STAT_NAMES.index("tokens")
    assert total[n] == stats[0][n] + stats[1][n]


def test_config_reaches_the_actor():
    from megatron_dapo.config import to_container
    from megatron_dapo.driver.actor_worker import actor_config_from

    keys = ["mode=mask", "level=sequence", "threshold=3.0", "threshold_lower=0.1"]
    cfg = load_config(None, ["model.path=/nonexistent", *(f"algorithm.rollout_correction.{k}" for k in keys)])
    assert actor_config_from(to_container(cfg)).rollout_correction == RolloutCorrection(
        "mask", "sequence", 3.0, 0.1
    )
    default = actor_config_from(to_container(load_config(None, ["model.path=/nonexistent"])))
    assert not default.rollout_correction.active and default.tis_cap is None


def test_the_metrics_are_logged():
    from megatron_dapo.driver.step import ACTOR_KEYS

    assert ACTOR_KEYS["rc_weight_mean"] == "actor/rollout_corr_weight_mean"
    assert ACTOR_KEYS["rc_fraction"] == "actor/rollout_corr_fraction"
    assert ACTOR_KEYS["rc_weight_max"] == "actor/rollout_corr_weight_max"
    assert ACTOR_KEYS["rc_weight_min"] == "actor/rollout_corr_weight_min"
