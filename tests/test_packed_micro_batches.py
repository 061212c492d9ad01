"""Packed micro-batches (actor/micro_batches.py), in process: the budget counts real tokens, a
packed row holds each sample's fields exactly where the padded layout has them relative to the
sample's start, the loss's row view of a packed row (whole, or one context-parallel rank's share
of it) is the padded layout, and context-parallel cuts and gathers of a packed row invert each
other."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.batch import BatchError, make_actor_batch
from megatron_dapo.actor.context_parallel import cp_positions, cp_split, cp_split_micro, cp_unsplit_packed
from megatron_dapo.actor.micro_batches import (
    as_rows,
    collate,
    collate_packed,
    pack_by_real_tokens,
    packed_length,
    padding_positions,
    positions_to_response,
    row_view,
)


def _batch(with_experts=False):
    gen = torch.Generator().manual_seed(3)
    p_lens, r_lens = [3, 5, 4, 6, 2], [6, 2, 8, 3, 5]
    prompts = [torch.randint(1, 99, (k,), generator=gen).tolist() for k in p_lens]
    responses = [torch.randint(1, 99, (k,), generator=gen).tolist() for k in r_lens]
    rollout = [torch.randn(k, generator=gen).tolist() for k in r_lens]
    experts = None
    if with_experts:
        experts = [
            torch.randint(0, 8, (p + r - 1, 2, 2), generator=gen, dtype=torch.int32)
            for p, r in zip(p_lens, r_lens)
        ]
    batch = make_actor_batch(
        prompts,
        responses,
        advantages=torch.randn(5, generator=gen),
        group_index=[0, 0, 1, 1, 2],
        rollout_logprobs=rollout,
        loss_mask=[True, True, False, True, True],
        routed_experts=experts,
    )
    return batch.with_old_logprobs(torch.randn(5, batch.max_response_len, generator=gen))


def test_budget_counts_real_tokens_first_fit_decreasing():
    lengths = [9, 7, 12, 9, 7]
    groups = pack_by_real_tokens(lengths, list(range(5)), 20)
    # longest first into the first group with room: 12+7, 9+9, 7 -> no group over 20 real tokens
    assert groups == [[1, 2], [0, 3], [4]]
    assert all(sum(lengths[i] for i in g) <= 20 for g in groups)
    # the padded budget would need rows x longest <= 20: five micro-batches
    assert len(pack_by_real_tokens(lengths, list(range(5)), 44)) == 1
    assert len(pack_by_real_tokens(lengths, list(range(5)), 20, multiple_of=4)) == 4
    with pytest.raises(BatchError, match="micro_batch_max_tokens"):
        pack_by_real_tokens(lengths, list(range(5)), 10)


def test_packed_row_holds_each_sample_as_the_padded_row_does():
    batch = _batch(with_experts=True)
    indices = [0, 2, 4]
    padded = collate(batch, indices)
    packed = collate_packed(batch, indices, seq_multiple=4, row_multiple=8)
    lens = [9, 12, 7]
    spans = [12, 12, 8]  # each sample to a multiple of 4; the row (32) is already a multiple of 8
    assert packed.tokens.shape == (1, packed_length(lens, 4, 8)) == (1, 32)
    assert packed.cu_seqlens.tolist() == [0, 12, 24, 32]
    assert packed.seq_lens.tolist() == lens and packed.num_real_tokens == sum(lens)
    for row, (start, span, n) in enumerate(zip([0, 12, 24], spans, lens)):
        for key in ("tokens", "labels", "loss_mask", "score_mask", "old_logprobs", "rollout_logprobs"):
            got = getattr(packed, key)[0, start : start + n]
            assert torch.equal(got, getattr(padded, key)[row, :n]), (key, row)
        assert not packed.loss_mask[0, start + n : start + span].any()
        assert packed.labels[0, start + n - 1] == 0  # a sample's last token predicts nothing of the next
        assert torch.equal(packed.position_ids[0, start : start + span], torch.arange(span))
        assert (packed.seq_ids[0, start : start + n] == row).all()
        assert (packed.seq_ids[0, start + n : start + span] == -1).all()
        assert torch.equal(
            packed.routed_experts[0, start : start + n - 1], padded.routed_experts[row, : n - 1]
        )
    assert torch.equal(packed.advantages, padded.advantages)
    # the row's end padding goes to the last sample; a fixed length (virtual pipeline) likewise
    fixed = collate_packed(batch, indices, seq_multiple=4, row_multiple=8, length=40)
    assert fixed.cu_seqlens.tolist() == [0, 12, 24, 40]
    with pytest.raises(ValueError, match="cannot be padded"):
        collate_packed(batch, indices, seq_multiple=4, length=30)


def test_row_view_is_the_padded_layout():
    batch = _batch()
    indices = [1, 3, 4]
    padded, packed = collate(batch, indices), collate_packed(batch, indices)
    view = row_view(packed)
    rows = as_rows(packed, view)
    width = padded.tokens.shape[1]
    for key in ("tokens", "labels", "loss_mask", "score_mask", "old_logprobs", "rollout_logprobs", "seq_ids"):
        assert torch.equal(getattr(rows, key)[:, :width], getattr(padded, key)), key
    values = torch.randn(1, packed.tokens.shape[1], requires_grad=True)
    rows_of = view.rows(values)
    rows_of.sum().backward()  # every packed position reaches exactly one row entry
    assert torch.equal(values.grad, torch.ones_like(values))


def test_response_layout_of_packed_equals_padded():
    batch = _batch()
    indices = [0, 1, 2, 3, 4]
    padded, packed = collate(batch, indices), collate_packed(batch, indices)
    values = torch.randn(padded.tokens.shape)
    packed_values = torch.zeros(packed.tokens.shape)
    for row, start in enumerate(packed.cu_seqlens[:-1].tolist()):
        n = int(packed.seq_lens[row])
        packed_values[0, start : start + n] = values[row, :n]
    want, got = torch.zeros(5, batch.max_response_len), torch.zeros(5, batch.max_response_len)
    positions_to_response(values, padded, batch, want)
    positions_to_response(packed_values, packed, batch, got)
    assert torch.equal(got, want)
    pad, total = padding_positions([padded, packed])
    assert total == padded.num_tokens + packed.num_tokens and pad == total - 2 * int(batch.seq_lens.sum())


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_cut_of_a_packed_row(cp):
    batch = _batch()
    packed = collate_packed(batch, [0, 1, 2, 3, 4], seq_multiple=2 * cp)
    cu = packed.cu_seqlens.tolist()
    length = packed.tokens.shape[1]
    shares = [cp_split_micro(packed, cp, r) for r in range(cp)]
    # each sample cut on its own into 2 * cp chunks: rank r holds chunks r and 2cp-1-r of each
    for r, share in enumerate(shares):
        want = torch.cat(
            [cp_split(packed.tokens[:, lo:hi], cp, r, dim=1) for lo, hi in zip(cu[:-1], cu[1:])], dim=1
        )
        assert torch.equal(share.tokens, want)
        assert share.cu_seqlens.tolist() == cu  # the whole row's, as megatron's THD RoPE takes them
    assert torch.equal(cp_unsplit_packed([s.labels for s in shares], cu, dim=1), packed.labels)
    everything = torch.cat([cp_positions(cp, r, length, cu) for r in range(cp)]).sort().values
    assert torch.equal(everything, torch.arange(length))
    # the loss's row view of a share holds the share of each sample: the loss tokens add up
    whole = as_rows(packed, row_view(packed))
    parts = [as_rows(s, row_view(s, cp)) for s in shares]
    assert torch.equal(sum(p.loss_mask.sum(1) for p in parts), whole.loss_mask.sum(1))
    for p in parts:
        assert torch.equal(p.advantages, whole.advantages)
