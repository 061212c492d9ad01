"""The judge's verdict parsers and prompt by hand values, ``reward.combine``, and the outcome's
invariant (a score or a reason, never both, never neither)."""

from __future__ import annotations

import pytest

from megatron_dapo.rewards.served import (
    DEFAULT_PROMPT_TEMPLATE,
    Combiner,
    RewardModelError,
    RewardSample,
    ScoreOutcome,
    parse_boxed_score,
    parse_yes_no,
)
from megatron_dapo.rewards.served.judge import load_parser, render_prompt


@pytest.mark.parametrize(
    "verdict, expected",
    [
        ("yes", 1.0),
        ("No", -1.0),
        ("YES.", 1.0),
        ("The answers differ, so: no", -1.0),
        ("Yes.\n\nNo further comment.", 1.0),  # the verdict first, then commentary
        ("**No**, the answers differ; yes, both are integers.", -1.0),
        ("The response says 5.\nVerdict: **YES**\nNo other issue.", 1.0),  # the line that opens with it
        ("Final answer: no.\nyes", -1.0),
        ("<think>yes</think><think>no, wait</think>\n**Yes**", 1.0),  # several thinking blocks
        ("<think>a</think>No<think>b</think>", -1.0),  # nothing after the last block: between them
        ("<think>x</think>Yes. <think>but maybe", 1.0),  # thinking opened again, never closed
        ("it agrees, so no doubt</think>Yes", 1.0),  # thinking opened in the prompt
        ("Answer: yes\n", 1.0),
        ("<think>is it yes? no...</think>\nyes", 1.0),
        ("<think>maybe yes</think> no", -1.0),
        ("<think>they agree, yes", None),  # cut off while thinking
        ("nothing to say", None),
        ("yesterday nobody knew", None),  # words, not substrings
        ("", None),
    ],
)
def test_yes_no(verdict, expected):
    assert parse_yes_no(verdict) == expected


@pytest.mark.parametrize(
    "verdict, expected",
    [
        (r"The score is \boxed{7}.", 7.0),
        (r"\boxed{3} then \boxed{0.5}", 0.5),
        (r"\boxed{-2}", -2.0),
        (r"\boxed{ $3/4$ }", 0.75),
        (r"\boxed{\frac{3}{4}}", 0.75),
        (r"\boxed{-\dfrac{1}{2}}", -0.5),
        (r"\boxed{\tfrac{ 5 }{ 2 }}", 2.5),
        (r"\boxed{\frac{3}{0}}", None),
        (r"\boxed{\frac{a}{4}}", None),
        (r"\boxed{1e-1}", 0.1),
        (r"<think>\boxed{1}</think> final: \boxed{9}", 9.0),
        (r"<think>\boxed{1}", None),
        (r"\boxed{seven}", None),
        (r"\boxed{1/0}", None),
        (r"\boxed{inf}", None),
        (r"\boxed{7", None),
        ("7 out of 10", None),
    ],
)
def test_boxed_score(verdict, expected):
    assert parse_boxed_score(verdict) == expected


def test_a_user_parser_loads_by_path(tmp_path):
    f = tmp_path / "grade.py"
    f.write_text("def grade(text):\n    return len(text) / 10\n")
    name, fn = load_parser(f"{f}:grade")
    assert name.endswith("grade.py:grade") and fn("abcde") == 0.5
    with pytest.raises(
        RewardModelError, match="reward.model.parser='yes_or_no' is not one of yes_no, boxed_score"
    ):
        load_parser("yes_or_no")


def test_the_prompt_fills_the_three_placeholders_once_and_keeps_other_braces():
    sample = RewardSample(
        3,
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "What is 6*7?"}],
        "It is {ground_truth}: 42",
        ground_truth="42",
    )
    text = render_prompt(r"Q={question} R={response} G={ground_truth} \boxed{x} {other}", sample)
    assert text == r"Q=What is 6*7? R=It is {ground_truth}: 42 G=42 \boxed{x} {other}"
    default = render_prompt(DEFAULT_PROMPT_TEMPLATE, sample)
    assert "What is 6*7?" in default and "It is {ground_truth}: 42" in default
    assert default.rstrip().endswith("Reply with one word: yes or no.")


def test_combine_defaults_to_the_model_score_and_calls_a_user_function(tmp_path):
    sample = RewardSample(0, [], "resp", ground_truth="gt", data_source="free_form", extra_info={"w": 0.25})
    assert Combiner(None)(sample, rule_score=-1.0, model_score=0.5) == Combiner()(sample, None, 0.5)
    assert Combiner(None)(sample, -1.0, -0.5).acc is False
    f = tmp_path / "mix.py"
    f.write_text(
        "def mix(data_source, solution_str, ground_truth, extra_info, rule_score, model_score):\n"
        "    w = extra_info['w']\n"
        "    return {'score': w * rule_score + (1 - w) * model_score, 'acc': rule_score > 0, 'pred': data_source}\n"
    )
    out = Combiner(f"{f}:mix")(sample, rule_score=1.0, model_score=-1.0)
    assert (out.score, out.acc, out.pred) == (-0.5, True, "free_form")
    f.write_text(
        "def mix(data_source, solution_str, ground_truth, extra_info, rule_score, model_score):\n    return 'x'\n"
    )
    with pytest.raises(
        RewardModelError, match=r"reward.combine=.*mix.py:mix failed for sample 0 .*TypeError"
    ):
        Combiner(f"{f}:mix")(sample, 1.0, 1.0)
    with pytest.raises(ValueError, match="an unscored sample leaves its group"):
        Combiner(None)(sample, 1.0, None)


def test_an_outcome_is_a_score_or_a_reason():
    assert ScoreOutcome(1, 0.0).scored, "0.0 is a real score"
    assert not ScoreOutcome(1, None, "timeout").scored
    with pytest.raises(ValueError, match="not both"):
        ScoreOutcome(1, 0.0, "timeout")
    with pytest.raises(ValueError, match="neither"):
        ScoreOutcome(1, None)
    with pytest.raises(ValueError, match="is not one of"):
        ScoreOutcome(1, None, "oops")
