"""GSPO's sequence ratio spans the whole response: with the response cut into chunks (as context
parallelism cuts it across ranks, or a row split over micro-batches would), the chunks' losses,
each computed with the whole rows' SequencePieces (the chunks' pieces summed) and the global
normalisers, add up to the unsplit loss, and their gradients, put side by side, are the unsplit
gradient. Without the summed pieces GSPO's loss differs. Every loss type and aggregation mode is
checked, both ways the pieces can be summed: beforehand (``seq_pieces``) and by ``row_sum``, the
callable a CP rank passes (here two threads stand in for the ranks)."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_dapo.algo import (
    LOSS_AGG_MODES,
    POLICY_LOSS_TYPES,
    RolloutCorrection,
    policy_loss,
    sequence_pieces,
)


def _batch():
    g = torch.Generator().manual_seed(11)
    b, t = 5, 12
    # log-probs on a 2^-10 grid: the chunks' log-ratio sums add exactly, so the sequence ratios
    # (and hence every token's gradient) are bit-identical to the unsplit ones
    old = -torch.randint(0, 3 * 1024, (b, t), generator=g).double() / 1024
    lp = old + torch.randint(-300, 300, (b, t), generator=g).double() / 1024
    rollout = old + torch.randint(-300, 300, (b, t), generator=g).double() / 1024
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lens = torch.tensor([12, 4, 0, 9, 7])  # row 1's tokens all in the first chunk, row 2 empty
    mask = torch.arange(t)[None, :] < lens[:, None]
    mask[4, :2] = False
    return lp, old, rollout, adv, mask


CUT = 5  # columns [0, 5) and [5, 12)


def _kwargs(kind, mode, mask, rc, rollout):
    return dict(
        loss_type=kind,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode=mode,
        num_tokens=float(mask.sum()),  # the global normalisers, as the actor passes them
        num_seqs=float((mask.sum(-1) > 0).sum()),
        norm_len=12.0,
        rollout_correction=rc,
        rollout_logprobs=None if rc is None else rollout,
    )


def _whole(kind, mode, rc=None):
    lp, old, rollout, adv, mask = _batch()
    x = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(x, old, adv, mask, **_kwargs(kind, mode, mask, rc, rollout))
    loss.backward()
    return loss.detach(), x.grad


def _chunks(lp, old, rollout, adv, mask):
    return [
        (lp[:, sl].clone().requires_grad_(True), old[:, sl], rollout[:, sl], adv, mask[:, sl])
        for sl in (slice(0, CUT), slice(CUT, None))
    ]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("kind", POLICY_LOSS_TYPES)
def test_chunks_with_summed_pieces_give_the_unsplit_loss_and_gradient(kind, mode):
    want, want_grad = _whole(kind, mode)
    lp, old, rollout, adv, mask = _batch()
    parts = _chunks(lp, old, rollout, adv, mask)
    pieces = [sequence_pieces(c_lp, c_old, c_mask) for c_lp, c_old, _, _, c_mask in parts]
    total = pieces[0] + pieces[1]
    assert torch.equal(total.log_ratio_sum, sequence_pieces(lp, old, mask).log_ratio_sum)
    got = 0.0
    for c_lp, c_old, _, c_adv, c_mask in parts:
        loss, _ = policy_loss(
            c_lp, c_old, c_adv, c_mask, seq_pieces=total, **_kwargs(kind, mode, mask, None, None)
        )
        loss.backward()
        got = got + loss.detach()
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
    assert torch.equal(torch.cat([parts[0][0].grad, parts[1][0].grad], dim=1), want_grad)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_gspo_chunks_without_the_whole_pieces_differ(mode):
    want, _ = _whole("gspo", mode)
    lp, old, rollout, adv, mask = _batch()
    got = sum(
        policy_loss(c_lp, c_old, c_adv, c_mask, **_kwargs("gspo", mode, mask, None, None))[0].item()
        for c_lp, c_old, _, c_adv, c_mask in _chunks(lp, old, rollout, adv, mask)
    )
    assert abs(got - want.item()) > 1e-6  # far beyond rounding (1e-16)


class _TwoRanks:
    """``row_sum`` for two threads standing in for two CP ranks: each call returns the sum of
    both threads' tensors (they call it in the same order, as ranks do)."""

    def __init__(self):
        self.slots: list[torch.Tensor | None] = [None, None]
        self.calls = [0, 0]
        self.barrier = threading.Barrier(2, timeout=60)

    def row_sum_for(self, rank: int):
        def row_sum(x: torch.Tensor) -> torch.Tensor:
            self.calls[rank] += 1
            self.slots[rank] = x.detach().clone()
            self.barrier.wait()
            total = self.slots[0] + self.slots[1]
            self.barrier.wait()
            return total

        return row_sum


@pytest.mark.parametrize(
    "rc",
    [None, RolloutCorrection("tis", "geometric", 1.1), RolloutCorrection("mask", "sequence", 1.5)],
    ids=str,
)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("kind", POLICY_LOSS_TYPES)
def test_chunks_on_two_ranks_with_row_sum_give_the_unsplit_loss_and_gradient(kind, mode, rc):
    want, want_grad = _whole(kind, mode, rc)
    lp, old, rollout, adv, mask = _batch()
    parts = _chunks(lp, old, rollout, adv, mask)
    group = _TwoRanks()
    losses: list[torch.Tensor | None] = [None, None]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            c_lp, c_old, c_roll, c_adv, c_mask = parts[r]
            kw = _kwargs(kind, mode, mask, rc, None)
            kw["rollout_logprobs"] = None if rc is None else c_roll
            loss, _ = policy_loss(c_lp, c_old, c_adv, c_mask, row_sum=group.row_sum_for(r), **kw)
            loss.backward()
            losses[r] = loss.detach()
        except BaseException as e:  # surfaced below, with the barrier broken for the other rank
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    torch.testing.assert_close(losses[0] + losses[1], want, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(
        torch.cat([parts[0][0].grad, parts[1][0].grad], dim=1), want_grad, rtol=1e-14, atol=0
    )
    assert group.calls[0] == group.calls[1]
