"""The demo's tiny judge (`megatron-dapo demo --judge`): what it is taught to say matches the DAPO
rule and the built-in yes_no parser, it reads exactly the ids a served judge is sent, it is cached,
and the demo's run takes it as its reward model."""

from __future__ import annotations

import argparse
import io
import random
from dataclasses import replace

from rich.console import Console

from megatron_dapo.commands.demo import _prepare
from megatron_dapo.config import load_config
from megatron_dapo.demo.judge import (
    JUDGE_TEMPLATE,
    JudgeRecipe,
    judge_overrides,
    judged_response,
    prepare_demo_judge,
    verdict,
)
from megatron_dapo.demo.task import make_problems
from megatron_dapo.demo.tokenizer import build_tokenizer
from megatron_dapo.rewards.math_dapo import compute_score
from megatron_dapo.rewards.served.classifier import load_tokenizer
from megatron_dapo.rewards.served.judge import judge_prompt_ids, parse_yes_no
from megatron_dapo.rewards.served.outcome import RewardSample


def test_the_verdicts_it_is_taught_are_the_rule_s_as_yes_no_reads_them():
    cases = {
        "47 + 8 = 55\nAnswer: 55": ("55 55 yes", 1.0),
        "47 + 8 = 55\nAnswer: 47": ("47 55 no", -1.0),  # the lazy teacher's
        "47 + 8 = 54\nAnswer: 55": ("55 55 yes", 1.0),  # the rule reads the final answer only
        "47 + 8 = 55": ("none 55 no", -1.0),  # cut before its answer
    }
    for response, (said, score) in cases.items():
        assert verdict(response, "55") == said
        assert parse_yes_no(said) == score == compute_score(response, "55")["score"]
    # every kind of response it is shown occurs, and right and wrong ones both do
    rng = random.Random(0)
    train, _ = make_problems(0, 200, 20)
    labels = {compute_score(judged_response(q, rng), str(q.answer))["acc"] for q in train}
    assert labels == {True, False}


def test_it_is_trained_on_the_ids_a_served_judge_is_sent_and_cached(tmp_path):
    console = Console(file=io.StringIO(), width=100)
    recipe = replace(JudgeRecipe(), steps=1, probe_examples=4)
    judge = prepare_demo_judge(tmp_path / "judge", seed=0, recipe=recipe, console=console)
    assert not judge.reused and 0.0 <= judge.accuracy <= 1.0 and judge.steps == 1
    # the tokenizer the reward client loads from the judge's checkpoint (transformers' AutoTokenizer
    # made it a Qwen2Tokenizer that dropped every space and newline: the served judge read other
    # ids than it was trained on) against the demo's own, written out by hand: the markers, then
    # one id per character
    tok = load_tokenizer(str(judge.hf_dir), "judge")
    demo = build_tokenizer(128)
    sample = RewardSample(
        "s", [{"role": "user", "content": "What is 47 + 8?"}], "47 + 8 = 55\nAnswer: 55", "55"
    )
    body = "Reference: 55\n47 + 8 = 55\nAnswer: 55\nSame?"
    expected = [demo.bos_token_id, demo.convert_tokens_to_ids("<|user|>")]
    expected += [demo.convert_tokens_to_ids(ch) for ch in body] + [
        demo.convert_tokens_to_ids("<|assistant|>")
    ]
    assert judge_prompt_ids(tok, JUDGE_TEMPLATE, sample) == expected
    again = prepare_demo_judge(tmp_path / "judge", seed=0, recipe=recipe, console=console)
    assert again.reused and again.accuracy == judge.accuracy
    changed = prepare_demo_judge(tmp_path / "judge", seed=0, recipe=replace(recipe, lr=1e-3), console=console)
    assert not changed.reused

    # the demo's run: its reward model is this judge, with the template it was trained on
    cfg = load_config(None, ["model.path=/m", *judge_overrides(judge)])
    m = cfg.reward.model
    assert (m.kind, m.path, m.prompt_template, m.parser) == (
        "judge",
        str(judge.hf_dir),
        JUDGE_TEMPLATE,
        "yes_no",
    )


def test_judge_is_for_the_arithmetic_task_only():
    args = argparse.Namespace(task="calculator", no_tools=False, judge=True, assets=None, seed=0, algo="dapo")
    try:
        _prepare(args, Console(file=io.StringIO()))
    except Exception as e:  # noqa: BLE001 - the refusal's type is the CLI's ConfigError
        assert "--judge is for --task arithmetic" in str(e) and type(e).__name__ == "ConfigError"
    else:
        raise AssertionError("--judge with --task calculator was accepted")
