"""The DAPO math rule on hand-written responses (expected values worked out from the rule's text)."""

import pytest

from megatron_dapo.rewards.math_dapo import compute_score, normalize_final_answer

PAD = "x" * 400  # pushes earlier text out of the 300-character window

CASES = [
    # (response, ground truth, expected acc, expected pred)
    ("Answer: 42", "42", True, "42"),
    ("answer: $42$", "42", True, "42"),
    ("ANSWER:42", "42", True, "42"),
    ("Final Answer: 42", "42", True, "42"),
    ("Answer:\n42", "42", True, "42"),  # whitespace after the colon may include a newline
    ("Answer: 41\nsome more thinking\nAnswer: 42", "42", True, "42"),  # the last Answer line wins
    ("Answer: 42\nwait, no.\nAnswer: 41", "42", False, "41"),
    ("Answer: 42" + PAD, "42", False, "[INVALID]"),  # the Answer line lies outside the last 300 chars
    (PAD + "Answer: 42", "42", True, "42"),
    ("Answer: 1,000", "1000", True, "1000"),
    ("Answer: 1000", "1,000", True, "1000"),  # the ground truth is normalised too
    ("Answer: -1,000", "-1000", False, "-1,000"),  # commas go only when the rest is all digits
    ("Answer: -7", "-7", True, "-7"),
    ("Answer: $-7$", "-7", True, "-7"),
    ("Answer: 5 cm", "5", True, "5"),
    ("Answer: 12 inches", "12", True, "12"),
    ("Answer: 90^\\circ", "90", True, "90"),
    ("Answer: 30 degrees", "30", True, "30"),
    ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: $\\frac{3}{4}$", "\\frac{3}{4}", True, "\\frac{3}{4}"),
    ("Answer: \\sqrt2", "\\sqrt{2}", True, "\\sqrt{2}"),
    ("Answer: $x = 7$", "7", True, "7"),  # only the part after the last "=" counts
    ("Answer: \\boxed{12}", "12", True, "12"),
    ("Answer: \\text{(B)}", "(B)", True, "(B)"),
    ("Answer: \\$20", "20", True, "20"),
    ("Answer: 20 dollars", "20", True, "20"),
    ("Answer: $42$.", "42", True, "42"),
    ("Answer: the answer is 5 + 1", "6", False, "theansweris5+1"),
    # the release does not map \dfrac, drop \% or a bare trailing period, so neither do we
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", False, "\\dfrac{1}{2}"),
    ("Answer: 50\\%", "50", False, "50\\%"),
    ("Answer: 42.", "42", False, "42."),
    ("The result is \\boxed{42}.", "42", False, "[INVALID]"),  # \boxed alone: off by default
    ("", "42", False, "[INVALID]"),
    ("Answer: ", "42", False, ""),  # an Answer line with nothing but a space in it
]


@pytest.mark.parametrize("response, gt, acc, pred", CASES)
def test_rule(response, gt, acc, pred):
    out = compute_score(response, gt)
    assert out == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def test_boxed_fallback_is_opt_in():
    response = "so the total is \\boxed{\\frac{1}{2}}."
    assert compute_score(response, "\\frac{1}{2}")["acc"] is False
    out = compute_score(response, "\\frac{1}{2}", boxed_fallback=True)
    assert out == {"score": 1.0, "acc": True, "pred": "\\frac{1}{2}"}
    # an Answer line, when present, still wins over a box
    assert compute_score("\\boxed{3}\nAnswer: 4", "3", boxed_fallback=True)["acc"] is False
    # unbalanced box: nothing to fall back to
    assert compute_score("\\boxed{3", "3", boxed_fallback=True)["pred"] == "[INVALID]"


def test_strict_box_verify_compares_verbatim_within_last_100_chars():
    assert compute_score("... \\boxed{42}", "42", strict_box_verify=True)["acc"] is True
    assert compute_score("... \\boxed{42 }", "42", strict_box_verify=True)["acc"] is False
    assert compute_score("\\boxed{42}" + "y" * 100, "42", strict_box_verify=True)["pred"] == "[INVALID]"


def test_ground_truth_literal_invalid_does_not_match_a_missing_answer():
    assert compute_score("no answer here", "[INVALID]")["acc"] is False


@pytest.mark.parametrize(
    "raw, normal",
    [
        ("an apple", "apple"),
        ("5\\text{ m}", "5"),  # spaces go first, then \text{m} -> \text{} -> removed
        ("\\text{Monday}", "Monday"),
        ("\\overline{12}", "12"),
        ("\\textbf{7}", "7"),
        ("{,}1{,}000", "1000"),
        ('"yes"', "yes"),
        ("x \\text{and} y", "x,y"),
        ("1 \\text{and} 2", "12"),  # "1,2" is all digits once the comma goes
        ("\\frac{1}{2}", "\\frac{1}{2}"),
        ("  8  ", "8"),
    ],
)
def test_normalisation(raw, normal):
    assert normalize_final_answer(raw) == normal


def test_non_string_arguments_are_rejected():
    with pytest.raises(TypeError, match="ground_truth=int"):
        compute_score("Answer: 1", 1)
