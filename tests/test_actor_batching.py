"""ActorBatch validation, DP split, token-budget packing and collation (pure, no Megatron)."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.batch import ActorBatch, BatchError, make_actor_batch
from megatron_dapo.actor.micro_batches import (
    collate,
    pack_by_token_budget,
    positions_to_response,
    split_over_ranks,
)


def _batch(**kw):
    args = dict(
        prompts=[[1, 2, 3], [4, 5], [6]],
        responses=[[7, 8], [9, 10, 11], [12]],
        advantages=[0.5, -1.0, 2.0],
        group_index=[0, 0, 1],
        rollout_logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5], [-0.6]],
    )
    args.update(kw)
    return make_actor_batch(**args)


def test_make_actor_batch_layout():
    b = _batch(loss_mask=[True, False, True])
    assert b.prompt_lens.tolist() == [3, 2, 1] and b.response_lens.tolist() == [2, 3, 1]
    assert b.response_mask.tolist() == [[True, True, False], [False, False, False], [True, False, False]]
    assert b.rollout_logprobs[1].tolist() == pytest.approx([-0.3, -0.4, -0.5])
    assert b.num_loss_tokens() == 3 and b.seq_lens.tolist() == [5, 5, 2]


def test_select_cuts_to_longest_response():
    s = _batch().select([2, 0])
    assert [t.tolist() for t in s.input_ids] == [[6, 12], [1, 2, 3, 7, 8]]
    assert s.response_mask.shape == (2, 2) and s.advantages.tolist() == [2.0, 0.5]


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(prompt_lens=torch.tensor([3, 2, 0])), r"prompt_lens\[2\]"),
        (dict(advantages=torch.tensor([0.0, float("nan"), 1.0])), r"advantages\[1\]"),
        (dict(response_mask=torch.ones(3, 3, dtype=torch.bool)), "beyond the response length of sample 0"),
        (dict(old_logprobs=torch.zeros(3, 2)), "old_logprobs must be a float tensor of shape"),
        (dict(response_lens=torch.tensor([2, 3, 2])), r"input_ids\[2\] has 2 tokens"),
    ],
)
def test_validation_names_the_field(change, match):
    b = _batch()
    fields = dict(b.__dict__)
    fields.update(change)
    with pytest.raises(BatchError, match=match):
        ActorBatch(**fields)


def test_split_over_ranks_balances_tokens_deterministically():
    lengths = [10, 9, 8, 7, 3, 2, 1, 1]
    parts = split_over_ranks(lengths, list(range(8)), 2)
    # LPT by hand: 10->r0, 9->r1, 8->r1 (17), 7->r0 (17), 3->r0 (tie: lower rank), 2->r1, 1->r1, 1->r0
    assert parts == [[0, 3, 4, 7], [1, 2, 5, 6]]
    assert sorted(i for p in parts for i in p) == list(range(8))
    with pytest.raises(BatchError, match="cannot feed 4 data-parallel ranks"):
        split_over_ranks(lengths[:3], [0, 1, 2], 4)


def test_pack_respects_budget_and_multiple():
    lengths = [12, 12, 9, 9, 8, 7, 7, 4]
    groups = pack_by_token_budget(lengths, list(range(8)), 24)
    assert groups == [[0, 1], [2, 3], [4, 5, 6], [7]]
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 24
    assert len(pack_by_token_budget(lengths, list(range(8)), 24, multiple_of=3)) % 3 == 0
    with pytest.raises(BatchError, match="sample 0 has 12 tokens"):
        pack_by_token_budget(lengths, list(range(8)), 11)


def test_collate_aligns_labels_and_masks_with_response_tokens():
    b = _batch(loss_mask=[True, False, True])
    m = collate(b, [0, 2], pad_id=0, pad_to_multiple_of=4)
    assert m.tokens.tolist() == [[1, 2, 3, 7, 8, 0, 0, 0], [6, 12, 0, 0, 0, 0, 0, 0]]
    assert m.labels.tolist() == [[2, 3, 7, 8, 0, 0, 0, 0], [12, 0, 0, 0, 0, 0, 0, 0]]
    # position t predicts labels[t]; response tokens 7, 8 of sample 0 are predicted at 2 and 3
    assert m.loss_mask.tolist()[0] == [False, False, True, True, False, False, False, False]
    assert m.loss_mask.tolist()[1] == [True] + [False] * 7
    assert m.rollout_logprobs[0, 2:4].tolist() == pytest.approx([-0.1, -0.2])
    out = torch.zeros(3, 3)
    positions_to_response(torch.arange(16.0).reshape(2, 8), m, b, out)
    assert out.tolist() == [[2.0, 3.0, 0.0], [0.0, 0.0, 0.0], [8.0, 0.0, 0.0]]


def test_split_to_count_halves_the_biggest_group_until_the_count_is_reached():
    from megatron_dapo.actor.micro_batches import split_to_count

    # by hand: [0,1,2] is the biggest -> [0,1],[2]; then [0,1] (first of the biggest) -> [0],[1]
    assert split_to_count([[0, 1, 2], [3]], 3) == [[0, 1], [2], [3]]
    assert split_to_count([[0, 1, 2], [3]], 4) == [[0], [1], [2], [3]]
    assert split_to_count([[0, 1], [2]], 2) == [[0, 1], [2]]  # already there: unchanged
    with pytest.raises(BatchError, match="4 samples cannot form 5 micro-batches"):
        split_to_count([[0, 1, 2], [3]], 5)
