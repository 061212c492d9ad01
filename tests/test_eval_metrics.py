"""avg@k / pass@k / maj@k against hand-computed values."""

from math import comb

import pytest

from megatron_dapo.eval import ProblemSamples, aggregate, avg_at_k, maj_at_k, pass_at_k


def test_pass_at_k_matches_the_combinatorial_definition():
    correct = [True, False, False, True, False]  # n=5, c=2
    assert pass_at_k(correct, 1) == pytest.approx(2 / 5)
    assert pass_at_k(correct, 2) == pytest.approx(1 - comb(3, 2) / comb(5, 2))  # 1 - 3/10
    assert pass_at_k(correct, 4) == 1.0  # n - c = 3 < 4
    assert pass_at_k([False] * 4, 4) == 0.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(correct, 6)


def test_maj_at_k_votes_on_extracted_answers():
    preds = ["7", "8", "8", "7", "9"]
    correct = [True, False, False, True, False]
    assert maj_at_k(correct, preds, 3) == 0.0  # "8" wins 2-1
    assert maj_at_k(correct, preds, 4) == 1.0  # 2-2 tie, "7" seen first
    assert maj_at_k(correct, preds, 1) == 1.0


def test_aggregate_averages_over_problems():
    a = ProblemSamples("a", [True, True, False, False], ["1", "1", "2", "2"], [3, 4, 5, 6], [False] * 4)
    b = ProblemSamples(
        "b", [False, False, False, True], ["x", "y", "x", "z"], [1, 1, 1, 1], [True, False, False, False]
    )
    m = aggregate([a, b], ks=(1, 2))
    assert m["avg@4"] == pytest.approx((0.5 + 0.25) / 2)
    assert m["pass@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert m["pass@2"] == pytest.approx(((1 - comb(2, 2) / comb(4, 2)) + (1 - comb(3, 2) / comb(4, 2))) / 2)
    assert m["maj@4"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["response_length/mean"] == pytest.approx(22 / 8)
    assert m["truncated_ratio"] == pytest.approx(1 / 8)
    assert avg_at_k([True]) == 1.0
