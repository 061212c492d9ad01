"""Virtual-pipeline micro-batches (defect 4): one shape rows x L with L the longest sequence and
rows = budget // L, so one long response no longer makes every micro-batch (most rows) x (L)."""

from __future__ import annotations

import pytest

from megatron_dapo.actor.batch import BatchError
from megatron_dapo.actor.micro_batches import pack_fixed_shape


def test_one_long_response_does_not_blow_up_every_micro_batch():
    lengths = [22000] + [500] * 15
    groups, rows, length = pack_fixed_shape(lengths, list(range(16)), 32768, multiple_of=2)
    # Before: the budget packing put the 15 short samples in one micro-batch, then every
    # micro-batch was padded to 15 rows x 22000 tokens = 330000 tokens, 10x the budget.
    assert (rows, length) == (1, 22000)
    assert rows * length <= 32768
    assert len(groups) == 16 and sorted(i for g in groups for i in g) == list(range(16))


def test_rows_fill_the_budget_and_count_is_a_multiple():
    lengths = [100, 90, 80, 70, 60, 50, 40]
    groups, rows, length = pack_fixed_shape(lengths, list(range(7)), 450, multiple_of=2, pad_multiple=16)
    assert length == 112 and rows == 4  # 450 // 112
    assert len(groups) % 2 == 0 and all(len(g) <= rows for g in groups)
    assert sorted(i for g in groups for i in g) == list(range(7))


def test_sample_over_budget_named():
    with pytest.raises(BatchError, match="micro_batch_max_tokens"):
        pack_fixed_shape([10, 600], [0, 1], 500)


def test_packed_virtual_pipeline_micro_batches_hold_real_tokens():
    """Packed, the one shape is ``1 x length`` with ``length`` the longest packed row: the same
    samples cost two rows of 25,500 positions instead of 16 rows of 22,000."""
    from megatron_dapo.actor.micro_batches import pack_by_real_tokens, packed_length

    lengths = [22000] + [500] * 15
    groups = pack_by_real_tokens(lengths, list(range(16)), 32768, multiple_of=2)
    assert len(groups) == 2 and sorted(i for g in groups for i in g) == list(range(16))
    assert all(sum(lengths[i] for i in g) <= 32768 for g in groups)
    length = max(packed_length([lengths[i] for i in g]) for g in groups)
    assert length * len(groups) == 51000 < 16 * 22000
