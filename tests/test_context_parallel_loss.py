"""The whole-sequence loss quantities under context parallelism, in process: every row is cut
into CP shares (``cp_split``, as the actor does) and each share's loss is computed by a stand-in
CP rank (a thread) whose ``row_sum`` adds the per-row sums of all shares, as the all-reduce over
the CP group does. The shares' losses, summed, and their gradients, put back in place, must equal
the loss and gradient of the whole rows (the CP=1 computation), for every aggregation mode and
every rollout-correction level; without ``row_sum`` the sequence-level ones differ."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_dapo.actor.context_parallel import cp_split, cp_unsplit
from megatron_dapo.algo import LOSS_AGG_MODES, RolloutCorrection, policy_loss


class _StandInGroup:
    """``row_sum`` for ``cp`` threads: each call contributes its tensor and returns the sum of
    every thread's (the threads call it in the same order, as CP ranks do)."""

    def __init__(self, cp: int):
        self.cp = cp
        self.slots: list[torch.Tensor | None] = [None] * cp
        self.barrier = threading.Barrier(cp, timeout=60)

    def row_sum_for(self, rank: int):
        def row_sum(x: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = x.detach().clone()
            self.barrier.wait()
            total = torch.stack(self.slots).sum(0)
            self.barrier.wait()  # nobody overwrites a slot before all have summed
            return total

        return row_sum


def _batch(seed: int = 3, rows: int = 6, length: int = 16):
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, length, generator=gen, dtype=torch.float64) * 3
    old = lp + 0.3 * torch.randn(rows, length, generator=gen, dtype=torch.float64)
    rollout = lp + 0.3 * torch.randn(rows, length, generator=gen, dtype=torch.float64)
    adv = torch.randn(rows, generator=gen, dtype=torch.float64)
    # ragged masks: a row whose loss tokens all sit in one CP rank's chunks, an empty row, a full one
    lens = torch.tensor([16, 3, 0, 11, 7, 14])[:rows]
    mask = torch.arange(length)[None, :] < lens[:, None]
    mask[4, :2] = False  # a prompt-like hole at the start
    return lp, old, rollout, adv, mask


CASES = (
    [(mode, None) for mode in LOSS_AGG_MODES]
    + [
        ("seq-mean-token-mean", RolloutCorrection(mode="tis", level=level, threshold=1.2))
        for level in ("token", "sequence", "geometric")
    ]
    + [
        ("token-mean", RolloutCorrection(mode="mask", level=level, threshold=1.5))
        for level in ("sequence", "geometric")
    ]
)


def _loss(lp, old, rollout, adv, mask, mode, rc, row_sum=None, whole_mask=None):
    whole_mask = mask if whole_mask is None else whole_mask
    return policy_loss(
        lp,
        old,
        adv,
        mask,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=mode,
        # global normalisers, as the actor passes them (whole rows over DP)
        num_tokens=float(whole_mask.sum()),
        num_seqs=float((whole_mask.sum(-1) > 0).sum()),
        norm_len=16.0,
        rollout_logprobs=rollout if rc is not None else None,
        rollout_correction=rc,
        row_sum=row_sum,
    )


def _sharded(cp, lp, old, rollout, adv, mask, mode, rc, use_row_sum=True):
    """Sum of the CP shares' losses and the gradient w.r.t. the whole ``lp``, with stand-in ranks."""
    group = _StandInGroup(cp)
    leaves = [cp_split(lp, cp, r, dim=1).clone().requires_grad_(True) for r in range(cp)]
    losses: list[torch.Tensor | None] = [None] * cp
    metrics: list[dict | None] = [None] * cp
    errors: list[BaseException] = []

    def rank(r):
        try:
            cut = [cp_split(t, cp, r, dim=1) for t in (old, rollout, mask)]
            losses[r], metrics[r] = _loss(
                leaves[r],
                *cut[:2],
                adv,
                cut[2],
                mode,
                rc,
                group.row_sum_for(r) if use_row_sum else None,
                whole_mask=mask,
            )
            losses[r].backward()
        except BaseException as exc:  # surfaced below, not swallowed by the thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    grad = cp_unsplit([leaf.grad for leaf in leaves], dim=1)
    return sum(x.detach() for x in losses), grad, metrics


@pytest.mark.parametrize("mode,rc", CASES, ids=lambda v: getattr(v, "level", v))
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_shares_add_up_to_whole_rows(cp, mode, rc):
    lp, old, rollout, adv, mask = _batch()
    whole = lp.clone().requires_grad_(True)
    ref, ref_metrics = _loss(whole, old, rollout, adv, mask, mode, rc)
    ref.backward()
    got, grad, metrics = _sharded(cp, lp, old, rollout, adv, mask, mode, rc)
    assert torch.allclose(got, ref.detach(), rtol=1e-12, atol=1e-14), (float(got), float(ref))
    assert torch.allclose(grad, whole.grad, rtol=1e-12, atol=1e-14)
    if rc is not None:
        # token-weighted means of the per-token weights are those of the whole rows
        n = [float(m["num_tokens"]) for m in metrics]
        mean = sum(float(m["rc_weight_mean"]) * k for m, k in zip(metrics, n)) / sum(n)
        assert abs(mean - float(ref_metrics["rc_weight_mean"])) < 1e-6
        assert max(float(m["rc_weight_max"]) for m in metrics) == pytest.approx(
            float(ref_metrics["rc_weight_max"])
        )


@pytest.mark.parametrize(
    "mode,rc",
    [
        ("seq-mean-token-mean", None),
        ("token-mean", RolloutCorrection(mode="tis", level="sequence", threshold=1.2)),
        ("token-mean", RolloutCorrection(mode="tis", level="geometric", threshold=1.2)),
    ],
    ids=["seq-mean-token-mean", "sequence", "geometric"],
)
def test_without_row_sum_the_shares_are_wrong(mode, rc):
    """The check above has teeth: a rank's own counts and log-ratio sums give another loss."""
    lp, old, rollout, adv, mask = _batch()
    ref, _ = _loss(lp, old, rollout, adv, mask, mode, rc)
    got, _, _ = _sharded(2, lp, old, rollout, adv, mask, mode, rc, use_row_sum=False)
    assert abs(float(got) - float(ref)) > 1e-3 * abs(float(ref))
