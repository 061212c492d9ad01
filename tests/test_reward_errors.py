"""A reward function that raises is seen: counted in rollout/reward_errors over every response
generated, never mixed into a combined score as if it had scored, and a step whose responses fail
mostly by reward errors stops with that error (file and line) instead of blaming the data."""

from __future__ import annotations

import pytest
from rollout_fakes import MIXED, Dataset, ScriptedEngine, Tokenizer, manager_config
from test_reward_model_metrics import ScriptedJudge

from megatron_dapo.rewards.scorer import Scorer
from megatron_dapo.rewards.served import Combiner
from megatron_dapo.rollout.manager import RolloutManager

# a new user's custom reward: extra_info["tool_calls"] is an int, not a list
BROKEN = """def broken(data_source, solution_str, ground_truth, extra_info=None):
    calls = extra_info.get("tool_calls", 3)
    return float(len(calls))
"""
MIX = """def mix(data_source, solution_str, ground_truth, extra_info, rule_score, model_score):
    return rule_score + model_score
"""


@pytest.fixture
def broken_scorer(tmp_path):
    (tmp_path / "broken.py").write_text(BROKEN)
    with Scorer(f"{tmp_path / 'broken.py'}:broken") as scorer:
        yield scorer


def test_a_raising_rule_under_combine_is_a_reward_error_not_a_mixed_score(tmp_path, broken_scorer):
    (tmp_path / "mix.py").write_text(MIX)
    judge = ScriptedJudge()  # scores sample 0 and 2 +1, sample 1 -1, sample 3 unscored
    manager = RolloutManager(
        [ScriptedEngine("e0")],
        broken_scorer,
        manager_config(filter_groups_enable=False),
        Tokenizer(),
        reward_model=judge,
        combiner=Combiner(f"{tmp_path / 'mix.py'}:mix"),
    )
    batch = manager.collect(Dataset([MIXED]), weight_version=0)
    scored = [s for s in batch.samples if s.unscored is None]
    assert len(scored) == 12  # 4 groups x the 3 samples the judge scores
    # the rule's failure value stands (-1, wrong), never rule(-1) + model(+1) = 0
    assert all(s.reward_error and "TypeError" in s.reward_error for s in scored)
    assert [s.score for s in scored] == [-1.0] * 12 and not any(s.acc for s in scored)
    assert all(s.rule_score is None for s in scored)
    assert batch.metrics["rollout/reward_errors"] == 12
