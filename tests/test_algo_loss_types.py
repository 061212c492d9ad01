"""The policy loss types (vanilla, gspo, cispo, sapo, gpg), the KL estimators and their
aggregation, against references written here from the papers' formulas, and hand values.

Formulas checked against verl v0.9.0's ``verl/trainer/ppo/core_algos.py`` and
``verl/workers/utils/losses.py`` (tag v0.9.0, commit 483b8a009ba3a97563edee3a19887e4862b8094a;
the release/v0.9.0 branch, head 885121936 on 2026-08-20, changes no file of these, and no v0.9.1
tag exists in github.com/verl-project/verl as mirrored): ``compute_policy_loss_{vanilla, gspo,
cispo, sapo, gpg}``, ``agg_loss`` (seq-mean-token-sum-norm divides by the sequence count and by
``loss_scale_factor``), ``kl_penalty`` / ``kl_penalty_forward`` and the actor's
``pg_loss - entropy_coeff * entropy_loss + kl_loss_coef * kl_loss``. Known differences, each
documented where it lives: verl aggregates gspo and sapo with seq-mean-token-mean whatever
``loss_agg_mode`` says (compare at that mode); verl's vanilla always dual-clips (pass
``clip_ratio_c``); seq-mean-token-mean divides by ``count + 1e-8`` in verl.

The references are element-by-element loops over Python lists of scalar tensors (autograd gives
their gradients), not the vectorised code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.algo import (
    KL_PENALTY_KINDS,
    LOSS_AGG_MODES,
    POLICY_LOSS_TYPES,
    Aggregation,
    RolloutCorrection,
    entropy_loss,
    kl_loss,
    kl_penalty,
    policy_loss,
)

LOW, HIGH, C, TAU_POS, TAU_NEG = 0.2, 0.28, 3.0, 1.0, 1.05
NORM_LEN = 9.0


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, t = 5, 6
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    lp = old + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    rollout = old + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lens = torch.tensor([6, 2, 0, 5, 4])
    mask = torch.arange(t)[None, :] < lens[:, None]
    mask[4, 0] = False  # a hole, as a prompt token inside a packed row
    lp[2] = float("nan")  # garbage in a fully masked row must not matter
    return lp, old, rollout, adv, mask


# ---------------------------------------------------------------- references from the papers


def _ref_row_losses(kind, lp, old, adv, mask):
    """Per row, the list of its loss tokens' losses (scalar tensors in lp's graph)."""
    rows = []
    for i in range(lp.shape[0]):
        idx = [t for t in range(lp.shape[1]) if mask[i, t]]
        a = [float(adv[i, t]) for t in idx]
        x = [lp[i, t] for t in idx]
        o = [float(old[i, t]) for t in idx]
        if kind == "gspo":
            # GSPO-token (Zheng et al. 2025): s_it = sg[s_i] * pi_it / sg[pi_it],
            # s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|)
            s_i = math.exp(sum(float(xt.detach()) - ot for xt, ot in zip(x, o)) / len(idx)) if idx else 1.0
            out = []
            for xt, at in zip(x, a):
                s = s_i * torch.exp(xt - xt.detach())
                out.append(torch.maximum(-at * s, -at * torch.clamp(s, 1 - LOW, 1 + HIGH)))
            rows.append(out)
            continue
        out = []
        for xt, ot, at in zip(x, o, a):
            r = torch.exp(xt - ot)
            if kind == "vanilla":  # PPO-clip (Schulman 2017) with DAPO's eps_low/high, dual clip (Ye 2019)
                l_ = torch.maximum(-at * r, -at * torch.clamp(r, 1 - LOW, 1 + HIGH))
                if at < 0:
                    l_ = torch.minimum(l_, torch.tensor(-at * C, dtype=torch.float64))
            elif kind == "cispo":  # CISPO (MiniMax-M1): sg(clip(r)) * A * log pi
                l_ = -float(torch.clamp(r.detach(), 1 - LOW, 1 + HIGH)) * at * xt
            elif kind == "sapo":  # SAPO: f(r) = sigmoid(tau (r - 1)) * 4 / tau
                tau = TAU_POS if at > 0 else TAU_NEG
                l_ = -at * torch.sigmoid(tau * (r - 1)) * 4 / tau
            elif kind == "gpg":  # plain policy gradient
                l_ = -at * xt
            out.append(l_)
        rows.append(out)
    return rows


def _ref_factors(old, rollout, mask, rc):
    """Per row, each loss token's rollout-correction factor."""
    out = []
    for i in range(old.shape[0]):
        idx = [t for t in range(old.shape[1]) if mask[i, t]]
        logs = [float(old[i, t] - rollout[i, t]) for t in idx]
        if rc is None:
            out.append([1.0] * len(idx))
            continue
        if rc.level == "token":
            rho = [math.exp(v) for v in logs]
        elif rc.level == "sequence":
            rho = [math.exp(sum(logs))] * len(idx)
        else:
            rho = [math.exp(sum(logs) / len(idx))] * len(idx) if idx else []
        if rc.mode == "tis":
            out.append([min(r, rc.threshold) for r in rho])
        else:
            out.append([1.0 if rc.lower <= r <= rc.threshold else 0.0 for r in rho])
    return out


def _ref_agg(rows, mode, norm_len):
    nonempty = [r for r in rows if r]
    g, n = len(nonempty), sum(len(r) for r in rows)
    if mode == "token-mean":
        return sum(sum(r) for r in nonempty) / n
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / g
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / g
    return sum(sum(r) / norm_len for r in nonempty) / g  # seq-mean-token-sum-norm (Dr. GRPO)


def _reference(kind, lp, old, rollout, adv, mask, mode, rc):
    x = torch.where(mask, lp, torch.zeros((), dtype=lp.dtype)).detach().requires_grad_(True)
    adv_t = adv[:, None].expand(mask.shape) if adv.dim() == 1 else adv
    rows = _ref_row_losses(kind, x, old, adv_t, mask)
    factors = _ref_factors(old, rollout, mask, rc)
    rows = [[lt * f for lt, f in zip(r, fr)] for r, fr in zip(rows, factors)]
    loss = _ref_agg(rows, mode, NORM_LEN)
    loss.backward()
    return loss.detach(), x.grad


CORRECTIONS = [
    None,
    RolloutCorrection("tis", "token", 1.3),
    RolloutCorrection("tis", "geometric", 1.1),
    RolloutCorrection("mask", "sequence", 1.5),
]


@pytest.mark.parametrize("rc", CORRECTIONS, ids=str)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("kind", POLICY_LOSS_TYPES)
def test_every_loss_type_every_mode_every_correction_equals_the_reference(kind, mode, rc):
    lp, old, rollout, adv, mask = _batch()
    want, want_grad = _reference(kind, lp, old, rollout, adv, mask, mode, rc)
    x = lp.clone().requires_grad_(True)
    got, m = policy_loss(
        x,
        old,
        adv,
        mask,
        loss_type=kind,
        clip_ratio_low=LOW,
        clip_ratio_high=HIGH,
        clip_ratio_c=C,
        tau_pos=TAU_POS,
        tau_neg=TAU_NEG,
        loss_agg_mode=mode,
        norm_len=NORM_LEN,
        rollout_logprobs=None if rc is None else rollout,
        rollout_correction=rc,
    )
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, x.grad, 0.0), want_grad, rtol=1e-12, atol=1e-14)
    assert torch.equal(x.grad[~mask], torch.zeros_like(x.grad[~mask]))
    assert set(m) >= {"clipfrac", "clipfrac_high", "clipfrac_low", "clipfrac_lower", "ppo_kl", "num_tokens"}
    assert all(torch.isfinite(v) for v in m.values())


@pytest.mark.parametrize("kind", POLICY_LOSS_TYPES)
def test_per_token_advantages_and_legacy_tis(kind):
    """(B, T) advantages that change sign inside a row, and the legacy tis_cap path."""
    lp, old, rollout, adv, mask = _batch(1)
    g = torch.Generator().manual_seed(7)
    adv_tok = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    want, want_grad = _reference(
        kind, lp, old, rollout, adv_tok, mask, "token-mean", RolloutCorrection("tis", "token", 1.3)
    )
    x = lp.clone().requires_grad_(True)
    kw = dict(
        loss_type=kind,
        clip_ratio_low=LOW,
        clip_ratio_high=HIGH,
        clip_ratio_c=C,
        tau_pos=TAU_POS,
        tau_neg=TAU_NEG,
    )
    got, m = policy_loss(x, old, adv_tok, mask, rollout_logprobs=rollout, tis_cap=1.3, **kw)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, x.grad, 0.0), want_grad, rtol=1e-12, atol=1e-14)
    assert "tis_mean" in m


def test_vanilla_is_the_default_bit_for_bit():
    lp, old, rollout, adv, mask = _batch(2)
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    la, ma = policy_loss(a, old, adv, mask, clip_ratio_c=C)
    lb, mb = policy_loss(b, old, adv, mask, clip_ratio_c=C, loss_type="vanilla", tau_pos=3.0, tau_neg=4.0)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb) and torch.equal(a.grad, b.grad)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


# ---------------------------------------------------------------- hand values

ONE = torch.ones(1, 2, dtype=torch.bool)


def _two_tokens(log_ratios, adv, lp0=(-1.0, -2.0)):
    old = torch.tensor([lp0], dtype=torch.float64)
    lp = (old + torch.tensor([log_ratios], dtype=torch.float64)).requires_grad_(True)
    return lp, old, torch.tensor([adv], dtype=torch.float64)


def test_gspo_hand_values():
    # log-ratios ln 2 and 0: s = exp(ln 2 / 2) = sqrt 2 on both tokens
    s = math.sqrt(2)
    lp, old, adv = _two_tokens([math.log(2), 0.0], 1.0)
    loss, m = policy_loss(lp, old, adv, ONE, loss_type="gspo", loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-1.28, rel=1e-12)  # A > 0, s > 1.28: clipped, no gradient
    loss.backward()
    assert lp.grad.tolist() == [[0.0, 0.0]]
    assert m["clipfrac"].item() == 1.0 and m["clipfrac_high"].item() == 1.0
    assert m["ppo_kl"].item() == pytest.approx(-math.log(2) / 2, rel=1e-6)  # metrics are float32
    lp, old, adv = _two_tokens([math.log(2), 0.0], -1.0)
    loss, m = policy_loss(lp, old, adv, ONE, loss_type="gspo", loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(s, rel=1e-12)  # A < 0: max(s, 1.28) = s
    loss.backward()
    # d/d lp_t of (1/2) sum_t -A s_it = -A s / 2 on each token: the sequence ratio's gradient
    assert lp.grad[0].tolist() == pytest.approx([s / 2, s / 2], rel=1e-12)
    assert m["clipfrac"].item() == 0.0


def test_gspo_log_ratio_clamp_at_10():
    lp, old, adv = _two_tokens([30.0, 0.0], -1.0)  # mean log-ratio 15 -> clamped to 10
    loss, _ = policy_loss(lp, old, adv, ONE, loss_type="gspo", loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(math.exp(10), rel=1e-12)
    loss.backward()
    assert lp.grad.tolist() == [[0.0, 0.0]]


def test_cispo_hand_values():
    old = torch.zeros(1, 3, dtype=torch.float64)
    lp = torch.log(torch.tensor([[2.0, 0.5, 1.0]], dtype=torch.float64)).requires_grad_(True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = policy_loss(lp, old, torch.ones(1, dtype=torch.float64), mask, loss_type="cispo")
    # weights clip(2) = 1.28, clip(0.5) = 0.8, 1; loss -w * A * log pi
    w = [1.28, 0.8, 1.0]
    want = -sum(wi * math.log(r) for wi, r in zip(w, [2.0, 0.5, 1.0])) / 3
    assert loss.item() == pytest.approx(want, rel=1e-12)
    loss.backward()
    # clipped tokens keep a gradient, scaled by their clipped weight
    assert lp.grad[0].tolist() == pytest.approx([-1.28 / 3, -0.8 / 3, -1 / 3], rel=1e-12)
    assert m["clipfrac"].item() == pytest.approx(2 / 3)
    assert m["clipfrac_high"].item() == pytest.approx(1 / 3) and m["clipfrac_low"].item() == pytest.approx(
        1 / 3
    )
    # CISPO's paper removes the lower bound: clip_ratio_low=1
    loss, _ = policy_loss(
        lp.detach(), old, torch.ones(1, dtype=torch.float64), mask, loss_type="cispo", clip_ratio_low=1.0
    )
    assert loss.item() == pytest.approx(-(1.28 * math.log(2) + 0.5 * math.log(0.5)) / 3, rel=1e-12)


def test_sapo_hand_values():
    lp, old, adv = _two_tokens([0.0, math.log(2)], 1.0)
    loss, m = policy_loss(lp, old, adv, ONE, loss_type="sapo", tau_pos=1.0, tau_neg=1.05)
    sig = 1 / (1 + math.exp(-1.0))  # r = 2, tau 1: sigmoid(1)
    assert loss.item() == pytest.approx(-(0.5 * 4 + sig * 4) / 2, rel=1e-12)
    loss.backward()
    # d/d log r of 4/tau sigmoid(tau (r - 1)) = 4 sigmoid' r: at r = 1, 1 (vanilla's); at r = 2, 8 s (1 - s)
    assert lp.grad[0].tolist() == pytest.approx([-1 / 2, -8 * sig * (1 - sig) / 2], rel=1e-12)
    assert m["clipfrac"].item() == 0.0
    lp, old, adv = _two_tokens([0.0, 0.0], -2.0)
    loss, _ = policy_loss(lp, old, adv, ONE, loss_type="sapo", tau_pos=1.0, tau_neg=1.05)
    assert loss.item() == pytest.approx(2.0 * 0.5 * 4 / 1.05, rel=1e-12)  # negative A uses tau_neg


def test_gpg_hand_values():
    lp, old, adv = _two_tokens([0.3, -0.1], 2.0, lp0=(-1.0, -2.0))
    loss, _ = policy_loss(lp, old, adv, ONE, loss_type="gpg")
    assert loss.item() == pytest.approx(-2.0 * ((-1.0 + 0.3) + (-2.0 - 0.1)) / 2, rel=1e-12)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-1.0, -1.0], rel=1e-12)


def test_loss_type_and_param_errors():
    x, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(
        ValueError, match="unknown loss_type 'ppo'; choose one of vanilla, gspo, cispo, sapo, gpg"
    ):
        policy_loss(x, x, torch.zeros(2), mask, loss_type="ppo")
    with pytest.raises(ValueError, match="tau_neg must be > 0"):
        policy_loss(x, x, torch.zeros(2), mask, loss_type="sapo", tau_neg=0.0)
    with pytest.raises(ValueError, match=r"clip_ratio_low must be in \[0, 1\]"):
        policy_loss(x, x, torch.zeros(2), mask, clip_ratio_low=1.5)


# ---------------------------------------------------------------- KL estimators

D = math.log(2)  # logprobs - ref_logprobs
KL_HAND = {
    # kind: (value, d value / d logprobs)
    "kl": (D, 1.0),
    "abs": (D, 1.0),
    "mse": (D * D / 2, D),
    "low_var_kl": (0.5 + D - 1, 1 - 0.5),  # exp(-d) + d - 1; gradient 1 - exp(-d)
}
ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}


@pytest.mark.parametrize("kind", KL_PENALTY_KINDS)
def test_kl_estimators_hand_values_and_straight_through_gradients(kind):
    base = kind.rstrip("+")
    value, grad = KL_HAND[ALIASES.get(base, base)]
    if kind.endswith("+"):
        grad = D  # k2's gradient whatever the value
    for sign in (1.0, -1.0):
        lp = torch.tensor([-1.0 + sign * D], dtype=torch.float64, requires_grad=True)
        ref = torch.tensor([-1.0], dtype=torch.float64)
        k = kl_penalty(lp, ref, kind)
        k.sum().backward()
        if sign > 0:
            assert k.item() == pytest.approx(value, rel=1e-12)
            assert lp.grad.item() == pytest.approx(grad, rel=1e-12)
        else:  # d = -ln 2: k1 = -ln 2, |d| = ln 2, k2 = ln2^2/2, k3 = 2 - ln 2 - 1
            want = {"kl": -D, "abs": D, "mse": D * D / 2, "low_var_kl": 1 - D}[ALIASES.get(base, base)]
            assert k.item() == pytest.approx(want, rel=1e-12)


def test_k3_clamps_like_verl():
    lp = torch.tensor([-40.0, 15.0], dtype=torch.float64, requires_grad=True)
    k = kl_penalty(lp, torch.zeros(2, dtype=torch.float64), "k3")
    # d = -40: -d clamped to 20, exp(20) - 20 - 1 clamped to 10; d = 15: exp(-15) + 15 - 1 -> 10
    assert k.tolist() == [10.0, 10.0]
    k.sum().backward()
    assert lp.grad.tolist() == [0.0, 0.0]


def test_unknown_kl_kind():
    with pytest.raises(ValueError, match="unknown KL estimator 'full'; choose one of kl, k1"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "full")


def _ref_agg_fixed(rows, mode, num_tokens, num_seqs):
    """verl's agg_loss with the global normalisers given (batch_num_tokens, global_batch_size)."""
    nonempty = [r for r in rows if r]
    return {
        "token-mean": lambda: sum(sum(r) for r in nonempty) / num_tokens,
        "seq-mean-token-sum": lambda: sum(sum(r) for r in nonempty) / num_seqs,
        "seq-mean-token-mean": lambda: sum(sum(r) / len(r) for r in nonempty) / num_seqs,
        "seq-mean-token-sum-norm": lambda: sum(sum(r) / NORM_LEN for r in nonempty) / num_seqs,
    }[mode]()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_kl_and_entropy_terms_aggregate_like_the_policy_loss(mode):
    """verl's actor: pg_loss - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl), both
    aggregated with the policy loss's mode and its global normalisers."""
    lp, old, _, _, mask = _batch(3)
    ref = old - 0.1  # a reference policy a little off pi_old
    agg = Aggregation(mode, num_tokens=30, num_seqs=7, norm_len=NORM_LEN)
    x = lp.clone().requires_grad_(True)
    got, m = kl_loss(x, ref, mask, kind="low_var_kl", agg=agg)
    got.backward()
    y = torch.where(mask, lp, 0.0).detach().requires_grad_(True)
    # k3 (Schulman 2020): with log rho = log pi_ref - log pi, rho - 1 - log rho
    rows = [
        [torch.exp(ref[i, t] - y[i, t]) - 1 - (ref[i, t] - y[i, t]) for t in range(6) if mask[i, t]]
        for i in range(5)
    ]
    want = _ref_agg_fixed(rows, mode, 30, 7)
    want.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.where(mask, x.grad, 0.0), y.grad, rtol=1e-12, atol=1e-14)
    mean_k3 = sum(float(v.detach()) for r in rows for v in r) / int(mask.sum())
    assert m["ref_kl"].item() == pytest.approx(mean_k3, rel=1e-6)

    ent = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ent[~mask] = float("inf")  # padding garbage
    e = ent.clone().requires_grad_(True)
    got = entropy_loss(e, mask, agg=agg)
    want = _ref_agg_fixed([[ent[i, t] for t in range(6) if mask[i, t]] for i in range(5)], mode, 30, 7)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    got.backward()
    assert torch.equal(e.grad[~mask], torch.zeros_like(e.grad[~mask]))
