"""group_advantages, mixed_group_mask and overlong_penalty against hand-computed values."""

import math

import numpy as np
import pytest
import torch

from megatron_dapo.algo import group_advantages, mixed_group_mask, overlong_penalty

EPS = 1e-6


def test_group_of_three_unbiased_std():
    # scores 1, -1, 1: mean 1/3; squared deviations 4/9, 16/9, 4/9 -> unbiased var 12/9, std sqrt(4/3)
    adv = group_advantages(torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64), [7, 7, 7])
    std = math.sqrt(4 / 3)
    expected = [(2 / 3) / (std + EPS), (-4 / 3) / (std + EPS), (2 / 3) / (std + EPS)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-12)


def test_two_groups_non_contiguous_string_keys():
    scores = torch.tensor([1.0, 0.0, -1.0, 0.0, 1.0, 2.0], dtype=torch.float64)
    keys = ["a", "b", "a", "b", "a", "b"]
    adv = group_advantages(scores, keys)
    # group a: 1, -1, 1 (as above); group b: 0, 0, 2 -> mean 2/3, devs -2/3, -2/3, 4/3, var 12/9
    s = math.sqrt(4 / 3) + EPS
    expected = [(2 / 3) / s, (-2 / 3) / s, (-4 / 3) / s, (-2 / 3) / s, (2 / 3) / s, (4 / 3) / s]
    assert adv.tolist() == pytest.approx(expected, rel=1e-12)


def test_group_of_one_uses_mean_zero_std_one_like_verl():
    adv = group_advantages(torch.tensor([0.7, -1.0, 1.0], dtype=torch.float64), torch.tensor([0, 1, 1]))
    assert adv[0].item() == pytest.approx(0.7 / (1 + EPS), rel=1e-12)
    no_std = group_advantages(
        torch.tensor([0.7, -1.0, 1.0], dtype=torch.float64), [0, 1, 1], norm_by_std=False
    )
    assert no_std.tolist() == pytest.approx([0.7, -1.0, 1.0], rel=1e-12)


def test_all_equal_group_gets_zero_advantage():
    adv = group_advantages(torch.full((4,), -1.0), [3, 3, 3, 3])
    assert torch.equal(adv, torch.zeros(4))


def test_dr_grpo_no_std_normalisation():
    adv = group_advantages(torch.tensor([1.0, -1.0, -1.0, -1.0]), [0] * 4, norm_by_std=False)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])


def test_dtypes_and_errors():
    adv = group_advantages(torch.tensor([1.0, -1.0], dtype=torch.bfloat16), [0, 0])
    assert adv.dtype == torch.float32
    # std of (1, -1) = sqrt(2)
    assert adv.tolist() == pytest.approx([1 / (math.sqrt(2) + EPS), -1 / (math.sqrt(2) + EPS)], rel=1e-6)
    with pytest.raises(ValueError, match="group_index has 1 entries"):
        group_advantages(torch.zeros(2), [0])
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), [0, 0])


def test_mixed_group_mask_edge_cases():
    metric = torch.tensor([1, 1, 1, 0, 1, 0, 5])
    keys = [0, 0, 0, 1, 1, 2, 9]  # group 0 tied, group 1 mixed, groups 2 and 9 singletons
    assert mixed_group_mask(metric, keys).tolist() == [False, False, False, True, True, True, True]


def test_mixed_group_mask_non_contiguous_and_bool():
    metric = torch.tensor([True, False, True, True, False, False])
    keys = ["p", "q", "r", "p", "q", "r"]  # p: T,T tied; q: F,F tied; r: T,F mixed
    assert mixed_group_mask(metric, keys).tolist() == [False, False, True, False, False, True]


def test_mixed_group_mask_float_ties_not_kept_by_rounding():
    # np.std of three equal 0.1's is ~1.4e-17, not 0; the group is still tied.
    assert np.std([0.1] * 3) > 0
    metric = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)
    assert mixed_group_mask(metric, [0, 0, 0]).tolist() == [False, False, False]


def test_mixed_group_mask_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        mixed_group_mask(torch.tensor([float("nan"), 1.0]), [0, 0])


def test_overlong_penalty_hand_values():
    # L_max 20, buffer 8 -> expected length 12; lengths include the EOS token.
    lengths = torch.tensor([5, 12, 13, 16, 20])
    pen = overlong_penalty(lengths, 20, 8)
    assert pen.dtype == torch.float32
    assert pen.tolist() == pytest.approx([0.0, 0.0, -1 / 8, -0.5, -1.0])
    half = overlong_penalty(lengths, 20, 8, penalty_factor=0.5)
    assert half.tolist() == pytest.approx([0.0, 0.0, -1 / 16, -0.25, -0.5])


def test_overlong_penalty_counts_eos_from_response_mask():
    # a 12-token answer followed by EOS: 13 tokens in the response mask, one past the expected length
    response_mask = torch.zeros(1, 20, dtype=torch.bool)
    response_mask[0, :13] = True
    assert overlong_penalty(response_mask.sum(-1), 20, 8).item() == pytest.approx(-1 / 8)


def test_overlong_penalty_invalid_arguments():
    with pytest.raises(ValueError, match="overlong_buffer_len must be > 0"):
        overlong_penalty(torch.tensor([3]), 20, 0)
    with pytest.raises(ValueError, match="must be <= max_response_length"):
        overlong_penalty(torch.tensor([3]), 20, 21)
    with pytest.raises(ValueError, match="penalty_factor"):
        overlong_penalty(torch.tensor([3]), 20, 4, penalty_factor=-1.0)
