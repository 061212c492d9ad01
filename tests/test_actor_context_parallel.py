"""Context parallelism's pure pieces (actor/context_parallel.py) against hand-built references:
the load-balanced 2*CP chunk split, its inverse, labels/positions taken before the cut, and the
token-mean normaliser over CP ranks."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.context_parallel import (
    cp_chunk_ids,
    cp_pad_multiple,
    cp_split,
    cp_split_inputs,
    cp_token_mean,
    cp_unsplit,
)


def test_split_is_megatrons_load_balanced_layout():
    x = torch.arange(16)  # cp=2: 4 chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_split(x, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_split(x, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert [cp_chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


def test_causal_attention_work_is_balanced():
    # With a causal mask, token t attends to t+1 keys: each rank's share is within one chunk's
    # worth of the mean (a contiguous split would give the last rank ~ (2cp-1)x the first's).
    cp, s = 4, 64
    work = [int((cp_split(torch.arange(s), cp, r) + 1).sum()) for r in range(cp)]
    assert max(work) == min(work)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_unsplit_inverts_split(cp):
    x = torch.randn(3, 2 * cp * 5, 7)
    shares = [cp_split(x, cp, r, dim=1) for r in range(cp)]
    assert torch.equal(cp_unsplit(shares, dim=1), x)


def test_labels_and_positions_come_from_the_full_row():
    tokens = torch.arange(100, 116).unsqueeze(0)
    parts = [cp_split_inputs(tokens, 2, r, pad_id=-1) for r in range(2)]
    for p in parts:
        pos = p["position_ids"][0]
        assert torch.equal(p["input_ids"][0], 100 + pos)
        # the label of position t is token t+1, also across a chunk boundary (e.g. t=3 -> 104)
        expect = torch.where(pos < 15, 101 + pos, torch.tensor(-1))
        assert torch.equal(p["labels"][0], expect)


def test_bad_lengths_and_multiples():
    with pytest.raises(ValueError, match="multiple of 2\\*cp=4"):
        cp_split(torch.arange(10), 2, 0)
    assert cp_pad_multiple(1) == 1 and cp_pad_multiple(2) == 4
    assert cp_pad_multiple(2, tp=4, sequence_parallel=True) == 16
    assert cp_pad_multiple(1, tp=4, sequence_parallel=True) == 4


@pytest.mark.parametrize(
    "cp,tp,sp,fp8,recipe,want",
    [
        # 2*CP chunks x a 16*TP-aligned chunk (a CP rank's SP shard of a chunk pair stays % 16)
        (2, 1, False, "hybrid", "delayed", 2 * 2 * 16),  # 64
        (2, 2, True, "hybrid", "delayed", 2 * 2 * 16 * 2),  # 128
        (4, 2, True, "e4m3", "tensorwise", 2 * 4 * 16 * 2),  # 256
        (2, 4, True, "e4m3", "mxfp8", 2 * 2 * 32 * 4),  # 512: MXFP8 blocks of 32
        (1, 2, True, "hybrid", "delayed", 16 * 2),  # no CP: the FP8/TP multiple alone
        (4, 2, True, None, "delayed", 2 * 4 * 2),  # no FP8: 2*CP x TP (sequence parallel)
    ],
)
def test_fp8_with_cp_pad_multiple(cp, tp, sp, fp8, recipe, want):
    m = cp_pad_multiple(cp, tp, sp, fp8, recipe)
    assert m == want
    # every CP rank's share of a padded row, split over TP, keeps FP8's alignment of 16 (32)
    if fp8 and cp > 1:
        share = (3 * m) // cp // tp
        assert share % (32 if recipe == "mxfp8" else 16) == 0


def test_token_mean_over_cp_equals_the_full_sequence_mean():
    gen = torch.Generator().manual_seed(0)
    cp, s = 2, 16
    logp = torch.randn(3, s, generator=gen)
    mask = torch.zeros(3, s)
    mask[:, 9:14] = 1  # loss tokens only in the response: unevenly spread over the CP ranks
    full = (logp * mask).sum() / mask.sum()
    sums = [(cp_split(logp, cp, r) * cp_split(mask, cp, r)).sum() for r in range(cp)]
    counts = [cp_split(mask, cp, r).sum() for r in range(cp)]
    assert torch.allclose(cp_token_mean(sums, counts), full, rtol=1e-6, atol=0)
    # a rank's own mean is a different number: the normaliser must be the global count
    own = torch.stack([s_ / c for s_, c in zip(sums, counts)]).mean()
    assert not torch.allclose(own, full)
