"""policy_loss / agg_loss against hand-computed values, plus split-invariance properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dapo.algo import LOSS_AGG_MODES, Aggregation, agg_loss, policy_loss, sequence_weights

# Hand example. Ratios per token r; row 0 has A=+1, row 1 A=-1, row 2 is fully masked.
#   A=+1: r=1 -> -1; r=1.5 -> max(-1.5, -1.28) = -1.28 (clipped high); r=0.5 -> -0.5; r=4 masked
#   A=-1: r=1 -> 1;  r=1.5 -> 1.5;  r=0.5 -> max(0.5, 0.8) = 0.8 (clipped low);  r=4 -> 4 (3 with c=3)
RATIOS = [1.0, 1.5, 0.5, 4.0]
ROW0 = [-1.0, -1.28, -0.5]
ROW1 = [1.0, 1.5, 0.8, 4.0]
ROW1_DUAL = [1.0, 1.5, 0.8, 3.0]


def hand_batch(dtype=torch.float64):
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]] * 3, dtype=dtype)
    logr = torch.log(torch.tensor([RATIOS] * 3, dtype=torch.float64)).to(dtype)
    new = (old + logr).clone()
    new[2] = float("inf")  # garbage in a fully masked row must not matter
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=dtype)
    return new.requires_grad_(True), old, adv, mask


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (sum(ROW0) + sum(ROW1)) / 7),
        ("seq-mean-token-sum", (sum(ROW0) + sum(ROW1)) / 2),
        ("seq-mean-token-mean", (sum(ROW0) / 3 + sum(ROW1) / 4) / 2),
        # Dr. GRPO: each row's token sum over the constant norm_len (here T=4), averaged over rows
        ("seq-mean-token-sum-norm", (sum(ROW0) / 4 + sum(ROW1) / 4) / 2),
    ],
)
def test_hand_values_each_mode(mode, expected):
    new, old, adv, mask = hand_batch()
    loss, m = policy_loss(new, old, adv, mask, loss_agg_mode=mode)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["clipfrac"].item() == pytest.approx(2 / 7)
    assert m["clipfrac_high"].item() == pytest.approx(1 / 7)
    assert m["clipfrac_low"].item() == pytest.approx(1 / 7)
    assert m["clipfrac_lower"].item() == 0.0
    assert m["ppo_kl"].item() == pytest.approx(-2 * math.log(1.5) / 7, rel=1e-6)
    assert m["num_tokens"].item() == 7 and m["num_seqs"].item() == 2
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())


def test_norm_len_constant():
    new, old, adv, mask = hand_batch()
    loss, _ = policy_loss(new, old, adv, mask, loss_agg_mode="seq-mean-token-sum-norm", norm_len=10)
    assert loss.item() == pytest.approx((sum(ROW0) + sum(ROW1)) / 10 / 2, rel=1e-12)


def test_dual_clip_and_gradient():
    new, old, adv, mask = hand_batch()
    loss, m = policy_loss(new, old, adv, mask, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((sum(ROW0) + sum(ROW1_DUAL)) / 7, rel=1e-12)
    assert m["clipfrac_lower"].item() == pytest.approx(1 / 7)
    loss.backward()
    # d(-A r)/d logp = -A r on unclipped tokens, 0 where a clip (or the dual clip) is active
    expected = torch.tensor(
        [[-1.0, 0.0, -0.5, 0.0], [1.0, 1.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(new.grad, expected / 7, rtol=1e-12, atol=1e-15)


def test_per_token_advantages_match_per_sample_and_hand_value():
    new, old, adv, mask = hand_batch()
    per_sample, _ = policy_loss(new, old, adv, mask)
    per_token, _ = policy_loss(new, old, adv[:, None].expand(3, 4).clone(), mask)
    assert per_token.item() == pytest.approx(per_sample.item(), rel=1e-12)
    # flip the sign of one token's advantage: row 0, r=0.5, A=-1 -> max(0.5, 0.8) = 0.8
    adv_tok = adv[:, None].expand(3, 4).clone()
    adv_tok[0, 2] = -1.0
    loss, _ = policy_loss(new, old, adv_tok, mask)
    assert loss.item() == pytest.approx((-1.0 - 1.28 + 0.8 + sum(ROW1)) / 7, rel=1e-12)


def test_extreme_ratios_are_clamped_and_finite():
    old = torch.zeros(1, 4, dtype=torch.float64)
    new = torch.tensor([[50.0, 50.0, -50.0, -50.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    # log-ratio clamped to +-20: A=+1 r=e^20 -> -1.28; A=-1 r=e^20 -> e^20;
    # A=+1 r=e^-20 -> -e^-20; A=-1 r=e^-20 -> 0.8
    loss, m = policy_loss(new, old, adv, mask)
    expected = (-1.28 + math.exp(20) - math.exp(-20) + 0.8) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["ppo_kl"].item() == pytest.approx(0.0, abs=1e-6)
    dual, _ = policy_loss(new, old, adv, mask, clip_ratio_c=10.0)
    assert dual.item() == pytest.approx((-1.28 + 10 - math.exp(-20) + 0.8) / 4, rel=1e-12)
    dual.backward()
    assert torch.isfinite(new.grad).all()


def test_bf16_inputs_compute_in_float32():
    new, old, adv, mask = hand_batch(torch.bfloat16)
    loss, m = policy_loss(new, old, adv, mask)
    assert loss.dtype == torch.float32 and m["clipfrac"].dtype == torch.float32
    ref, _ = policy_loss(new.detach().float(), old.float(), adv.float(), mask)
    assert loss.item() == ref.item()
    # bf16 rounding of the log-probs moves the ratios slightly; the hand value still holds to ~1%
    assert loss.item() == pytest.approx((sum(ROW0) + sum(ROW1)) / 7, rel=2e-2)
    loss.backward()
    assert new.grad.dtype == torch.bfloat16


def test_tis_weights():
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.zeros(1, 3, dtype=torch.float64)  # ratio 1 everywhere: per-token loss = -A = -1
    rollout = torch.tensor([[0.0, -math.log(3.0), math.log(2.0)]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = policy_loss(
        new, old, torch.ones(1, dtype=torch.float64), mask, rollout_logprobs=rollout, tis_cap=2.0
    )
    # weights min(exp(old - rollout), 2) = 1, min(3, 2) = 2, 0.5
    assert loss.item() == pytest.approx(-(1 + 2 + 0.5) / 3, rel=1e-12)
    assert m["tis_mean"].item() == pytest.approx(3.5 / 3)
    assert m["tis_clipfrac"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="both rollout_logprobs and tis_cap"):
        policy_loss(new, old, torch.ones(1), mask, rollout_logprobs=rollout)


def test_fully_masked_batch_gives_zero_not_nan():
    new = torch.full((2, 3), float("nan"), requires_grad=True)
    loss, m = policy_loss(new, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))
    assert loss.item() == 0.0 and m["clipfrac"].item() == 0.0 and m["num_tokens"].item() == 0
    loss.backward()
    assert torch.equal(new.grad, torch.zeros(2, 3))


def test_argument_errors():
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(x, x, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="old_logprobs must have the shape"):
        policy_loss(x, torch.zeros(2, 4), torch.zeros(2), mask)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(x, x, torch.zeros(2), mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        policy_loss(x, x, torch.zeros(2), mask, loss_agg_mode="mean")


@st.composite
def split_batches(draw):
    b = draw(st.integers(2, 8))
    t = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    k = draw(st.integers(2, b))
    cuts = sorted(draw(st.lists(st.integers(1, b - 1), min_size=k - 1, max_size=k - 1, unique=True)))
    return b, t, seed, [0, *cuts, b]


@settings(max_examples=60, deadline=None)
@given(split_batches(), st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]))
def test_split_with_global_normaliser_sums_to_unsplit(batch, mode):
    b, t, seed, bounds = batch
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    new = old + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.3
    full, _ = policy_loss(new, old, adv, mask, loss_agg_mode=mode, clip_ratio_c=3.0)
    n_tok = int(mask.sum())
    n_seq = int((mask.sum(-1) > 0).sum())
    pieces = [
        policy_loss(
            new[lo:hi],
            old[lo:hi],
            adv[lo:hi],
            mask[lo:hi],
            loss_agg_mode=mode,
            clip_ratio_c=3.0,
            num_tokens=n_tok,
            num_seqs=n_seq,
        )[0]
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]
    assert abs(sum(p.item() for p in pieces) - full.item()) <= 1e-12


@settings(max_examples=30, deadline=None)
@given(split_batches())
def test_sum_norm_split_sums_to_unsplit(batch):
    b, t, seed, bounds = batch
    g = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.3
    full = agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", norm_len=t)
    n_seq = int((mask.sum(-1) > 0).sum())
    parts = sum(
        agg_loss(loss_mat[lo:hi], mask[lo:hi], "seq-mean-token-sum-norm", num_seqs=n_seq, norm_len=t).item()
        for lo, hi in zip(bounds[:-1], bounds[1:])
    )
    assert abs(parts - full.item()) <= 1e-12


def test_agg_loss_explicit_normalisers():
    loss_mat = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0], [1, 1]])
    assert agg_loss(loss_mat, mask, "token-mean").item() == pytest.approx(8 / 3)
    assert agg_loss(loss_mat, mask, "token-mean", num_tokens=10).item() == pytest.approx(0.8)
    assert agg_loss(loss_mat, mask, "seq-mean-token-sum", num_seqs=4).item() == pytest.approx(8 / 4)
    assert agg_loss(loss_mat, mask, "seq-mean-token-mean", num_seqs=4).item() == pytest.approx((1 + 3.5) / 4)
    assert agg_loss(loss_mat, mask, "token-mean", num_tokens=torch.tensor(4)).item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        agg_loss(loss_mat, mask, "token-mean", num_tokens=-1)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_sequence_weights_aggregate_a_per_sequence_value_like_agg_loss(mode):
    """A per-sequence value (the MoE load-balancing loss) weighted by ``sequence_weights`` sums to
    what ``agg_loss`` gives with that value on every masked token of its row, with the same global
    normalisers; and hand values for the hand batch (rows of 3, 4 and 0 loss tokens)."""
    _, _, _, mask = hand_batch()
    x = torch.tensor([0.7, -1.3, 5.0], dtype=torch.float64)
    mat = x[:, None].expand(mask.shape)
    for kwargs in ({}, dict(num_tokens=11, num_seqs=5, norm_len=9)):
        w = sequence_weights(mask, Aggregation(mode, **kwargs))
        want = agg_loss(
            mat, mask, mode, kwargs.get("num_tokens"), kwargs.get("num_seqs"), norm_len=kwargs.get("norm_len")
        )
        assert (w * x).sum().item() == pytest.approx(want.item(), rel=1e-12)
    hand = {
        "token-mean": [3 / 7, 4 / 7, 0],
        "seq-mean-token-sum": [3 / 2, 4 / 2, 0],
        "seq-mean-token-mean": [1 / 2, 1 / 2, 0],
        "seq-mean-token-sum-norm": [3 / 4 / 2, 4 / 4 / 2, 0],
    }[mode]
    assert sequence_weights(mask, Aggregation(mode)).tolist() == pytest.approx(hand, rel=1e-12)
