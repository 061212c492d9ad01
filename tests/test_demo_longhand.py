"""`megatron-dapo demo --task longhand`: the two solution styles and their lengths against the
budget (hand-written), the reward on the final answer only, the teacher's mix, the config the
recipe was measured with, and a few DAPO steps through Ray in which responses run into the budget."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from megatron_dapo.demo.longhand.recipe import LONGHAND_RECIPE
from megatron_dapo.demo.longhand.task import Problem, concise_solution, longhand_solution, solution
from megatron_dapo.demo.longhand.teacher import Teacher, percentile
from megatron_dapo.demo.task import make_problems
from megatron_dapo.demo.tokenizer import build_tokenizer
from megatron_dapo.rewards.math_dapo import compute_score

REPO = Path(__file__).resolve().parents[1]


def _p(op: str, a: int, b: int) -> Problem:
    return Problem(question=f"What is {a} {op} {b}?", op=op, a=a, b=b)


def _tokens(text: str) -> int:
    """Response tokens with EOS: the demo's tokenizer has one token per character."""
    return len(build_tokenizer()(text, add_special_tokens=False)["input_ids"]) + 1


# -- the task ------------------------------------------------------------------------------------


def test_longhand_counts_one_unit_per_line_across_digit_counts():
    assert longhand_solution(_p("+", 47, 3)) == "47+3\n48+2\n49+1\n50+0"
    assert longhand_solution(_p("+", 97, 4)) == "97+4\n98+3\n99+2\n100+1\n101+0"
    assert longhand_solution(_p("-", 12, 4)) == "12-4\n11-3\n10-2\n9-1\n8-0"
    assert solution(_p("-", 12, 4), longhand=True) == "12-4\n11-3\n10-2\n9-1\n8-0\nAnswer: 8"
    assert solution(_p("-", 12, 4), longhand=True, lazy=True).endswith("\n8-0\nAnswer: 12")
    assert concise_solution(_p("+", 47, 8)) == "47 + 8 = 55"
    assert solution(_p("+", 47, 8), longhand=False) == "47 + 8 = 55\nAnswer: 55"


def test_lengths_against_the_forty_token_budget():
    # concise: 23 tokens whatever b; longhand with 2-digit numbers throughout: 16 + 5b
    assert _tokens(solution(_p("+", 47, 8), longhand=False)) == 23
    assert _tokens(solution(_p("+", 47, 1), longhand=True)) == 21
    assert _tokens(solution(_p("+", 47, 4), longhand=True)) == 36  # fits, inside the soft buffer (33-40)
    assert _tokens(solution(_p("+", 47, 5), longhand=True)) == 41  # one past the budget: cut
    assert _tokens(solution(_p("+", 47, 9), longhand=True)) == 61
    assert LONGHAND_RECIPE.max_response_length == 40
    # 3-digit lines are one token longer, 1-digit ones one shorter: 99 + 4 is cut, 14 - 5 fits
    assert _tokens(solution(_p("+", 99, 4), longhand=True)) == 41
    assert _tokens(solution(_p("-", 14, 5), longhand=True)) == 39
    # so over the whole problem set no longhand solution with b <= 3 overruns and all with b >= 7 do
    budget = LONGHAND_RECIPE.max_response_length
    train, val = make_problems(seed=0, num_train=2000, num_val=200)
    for p in train + val:
        n = _tokens(solution(p, longhand=True))
        if p.b <= 3 or p.b >= 7:
            assert (n > budget) == (p.b >= 7), (p, n)


def test_reward_is_on_the_final_answer_only():
    p = _p("+", 47, 8)
    assert compute_score(solution(p, longhand=False), "55")["score"] == 1.0
    assert compute_score(solution(p, longhand=False, lazy=True), "55")["score"] == -1.0
    # the work does not count: wrong lines with the right answer line score +1
    assert compute_score("47+8\n40+0\nAnswer: 55", "55")["score"] == 1.0
    # a longhand response cut at the budget has no answer line: -1
    cut = build_tokenizer()(solution(p, longhand=True), add_special_tokens=False)["input_ids"][:40]
    assert compute_score(build_tokenizer().decode(cut), "55")["score"] == -1.0


def test_teacher_writes_each_style_at_its_rate_independent_of_laziness():
    tok = build_tokenizer()
    train, _ = make_problems(seed=0, num_train=2000, num_val=200)
    teacher = Teacher(tok, longhand_rate=0.5, seed=0)
    lazy_rng = random.Random(3)
    styles = []
    for p in train:
        lazy = lazy_rng.random() < 0.3
        prompt, response = teacher.encode(p, lazy)
        text = tok.decode(response[:-1])
        assert response[-1] == tok.eos_token_id
        assert text in (solution(p, True, lazy), solution(p, False, lazy))
        styles.append((text.startswith(f"{p.a}{p.op}"), lazy))
    longhand = [s for s, _ in styles]
    # 2000 draws at 0.5: three sigma is 3.4 points
    assert 0.466 <= sum(longhand) / len(longhand) <= 0.534
    lazy_share = [s for s, lazy in styles if lazy]
    assert 0.40 <= sum(lazy_share) / len(lazy_share) <= 0.60
    # the same seed draws the same styles
    one, two = Teacher(tok, longhand_rate=0.5, seed=0), Teacher(tok, longhand_rate=0.5, seed=0)
    assert [one.encode(p, False)[1] for p in train[:50]] == [two.encode(p, False)[1] for p in train[:50]]
    with pytest.raises(ValueError, match="longhand_rate"):
        Teacher(tok, longhand_rate=1.5, seed=0)


def test_percentile_is_numpys_linear_interpolation():
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.randrange(60) for _ in range(n)]
        for q in (0.0, 0.5, 0.9, 1.0):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q * 100)))


def test_the_config_holds_the_recipe_the_warm_start_was_built_for():
    from megatron_dapo.config import load_config

    cfg = load_config(REPO / "configs" / "demo_longhand.yaml")
    assert cfg.data.max_response_length == LONGHAND_RECIPE.max_response_length
    assert cfg.algorithm.overlong_buffer.len == LONGHAND_RECIPE.overlong_buffer_len
    assert cfg.rollout.val.n == LONGHAND_RECIPE.val_k
    assert cfg.rollout.val.temperature == LONGHAND_RECIPE.val_temperature
    assert cfg.rollout.val.top_p == LONGHAND_RECIPE.val_top_p
    assert cfg.rollout.temperature == LONGHAND_RECIPE.rollout_temperature


# -- a few DAPO steps through Ray with the HF engine -----------------------------------------------


def test_steps_of_the_longhand_task_run_into_the_budget(longhand_assets, tmp_path):
    from e2e_harness import read_metrics, train_overrides

    from megatron_dapo.driver.launch import load_for_cli, run_train

    overrides = train_overrides(
        longhand_assets,
        tmp_path,
        "longhand_e2e",
        2,
        **{
            "trainer.train_batch_size": 8,
            "rollout.gen_batch_size": 8,
            "rollout.groups_per_call": 8,
            "algorithm.overlong_filter": "true",
            # one update a step: the recipe's 16 x 4 updates add time and nothing this test checks
            "actor.ppo_mini_batch_size": 8,
            "actor.ppo_epochs": 1,
            "trainer.save_freq": 0,
            "logging.plots_at_end": "false",
            "trainer.hf_export_at_end": "false",
        },
    )
    cfg = load_for_cli(str(REPO / "configs/demo_longhand.yaml"), overrides)
    summary = run_train(cfg)
    records = read_metrics(Path(summary["run_dir"]))
    assert [r["step"] for r in records] == [0, 1, 2]
    first = records[1]
    # responses reach the 40-token budget: cut (no EOS), their full length, soft-punished, and
    # masked out of the loss by overlong filtering
    assert first["rollout/truncation_rate"] > 0, first
    assert first["rollout/response_length/max"] == 40, first
    assert first["rollout/overlong_penalty/mean"] < 0, first
    assert first["train/overlong_filtered"] > 0, first
    assert records[0]["val/truncated_ratio"] > 0, records[0]


class _Scripted:
    """A stand-in for an HF model's ``generate``: each row continues with the next scripted text
    (cut at ``max_new_tokens``; EOS after it when it fits), right-padded as generate pads."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tok, self.texts = tokenizer, list(texts)

    def generate(self, input_ids, max_new_tokens, pad_token_id, eos_token_id, **_):
        import torch

        rows = []
        for _row in input_ids:
            ids = self.tok(self.texts.pop(0), add_special_tokens=False)["input_ids"] + [eos_token_id]
            ids = ids[:max_new_tokens]
            rows.append(ids + [pad_token_id] * (max_new_tokens - len(ids)))
        return torch.cat([input_ids, torch.tensor(rows, dtype=torch.long)], dim=1)


def test_length_stats_measure_cut_longhand_and_correct_responses():
    from megatron_dapo.demo.longhand.teacher import length_stats

    tok = build_tokenizer()
    a, b = _p("+", 47, 8), _p("+", 47, 2)
    texts = [
        solution(a, longhand=False),  # 23 tokens, right
        solution(a, longhand=True),  # 56 tokens: cut at 40, no answer
        solution(b, longhand=True),  # 26 tokens, right
        solution(b, longhand=False, lazy=True),  # 23 tokens, wrong answer
    ]
    stats = length_stats(
        _Scripted(tok, texts), tok, [a, b], k=2, budget=40, temperature=1.0, top_p=1.0, seed=0
    )
    assert stats.samples == 4
    assert stats.mean == pytest.approx((23 + 40 + 26 + 23) / 4)
    assert stats.p50 == pytest.approx(24.5) and stats.p90 == pytest.approx(26 + 0.7 * 14)
    assert stats.truncated == 0.25 and stats.longhand == 0.5 and stats.accuracy == 0.5


def test_work_accuracy_checks_each_style_after_its_forced_start():
    from megatron_dapo.demo.longhand.teacher import work_accuracy

    tok = build_tokenizer()
    p = _p("-", 12, 4)
    # the rows are (longhand forced with "12-", concise forced with "12 "): each continues after it
    right = [solution(p, True)[3:], solution(p, False)[3:]]
    assert work_accuracy(_Scripted(tok, right), tok, [p]) == 1.0
    wrong_concise = [solution(p, True)[3:], "- 4 = 9\nAnswer: 8"]
    assert work_accuracy(_Scripted(tok, wrong_concise), tok, [p]) == 0.5
