"""A reward function that raises is seen: counted in rollout/reward_errors over every response
generated, never mixed into a combined score as if it had scored, and a step whose responses fail
mostly by reward errors stops with that error (file and line) instead of blaming the data."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from rollout_fakes import MIXED, RIGHT, WRONG, Dataset, ScriptedEngine, Tokenizer, manager_config
from test_reward_model_metrics import ScriptedJudge
from test_reward_unscored import _sample

from megatron_dapo.rewards.scorer import Scorer
from megatron_dapo.rewards.served import Combiner, ScoreOutcome
from megatron_dapo.rollout.engine_pool import EnginePool
from megatron_dapo.rollout.ledger import Ledger
from megatron_dapo.rollout.manager import RolloutManager
from megatron_dapo.rollout.rollout_metrics import rollout_metrics
from megatron_dapo.rollout.scoring import RewardFunctionError
from megatron_dapo.rollout.types import EpisodeInfo, EpisodeTurn
from megatron_dapo.rollout.units import Group

# a new user's custom reward: extra_info["tool_calls"] is an int, not a list
BROKEN = """def broken(data_source, solution_str, ground_truth, extra_info=None):
    calls = extra_info.get("tool_calls", 3)
    return float(len(calls))


def broken_when_wrong(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "right":
        return 1.0
    return broken(data_source, solution_str, ground_truth, extra_info)
"""
MIX = """def mix(data_source, solution_str, ground_truth, extra_info, rule_score, model_score):
    return rule_score + model_score
"""


def test_a_raising_rule_under_combine_is_a_reward_error_not_a_mixed_score(tmp_path):
    (tmp_path / "broken.py").write_text(BROKEN)
    (tmp_path / "mix.py").write_text(MIX)
    judge = ScriptedJudge()  # scores sample 0 and 2 +1, sample 1 -1, sample 3 unscored
    manager = RolloutManager(
        [ScriptedEngine("e0")],
        Scorer(f"{tmp_path / 'broken.py'}:broken_when_wrong"),
        manager_config(filter_groups_enable=False),
        Tokenizer(),
        reward_model=judge,
        combiner=Combiner(f"{tmp_path / 'mix.py'}:mix"),
    )
    batch = manager.collect(Dataset([MIXED]), weight_version=0)
    scored = [s for s in batch.samples if s.unscored is None]
    failed = [s for s in scored if s.response_text == "wrong"]
    assert len(scored) == 12 and len(failed) == 4  # 4 groups x the 3 the judge scores; 1 wrong in each
    # the rule's failure value stands (-1, wrong), never rule(-1) + model = a mixed score
    assert all(s.reward_error and "TypeError" in s.reward_error for s in failed)
    assert [s.score for s in failed] == [-1.0] * 4 and not any(s.acc for s in failed)
    assert all(s.rule_score is None for s in failed)
    assert batch.metrics["rollout/reward_errors"] == 4


class ErrorsOnWrong:
    """The rule as the fakes score it (+1 "right", -1 "wrong"), but every "wrong" fails in it."""

    custom_fn = "/rewards/mine.py:score"

    def score_many(self, items):
        out = []
        for _, text, _, _ in items:
            error = (
                None
                if text == "right"
                else "TypeError: object of type 'int' has no len() (at mine.py:3 in score)"
            )
            out.append(Result(1.0 if text == "right" else -1.0, text == "right", text, error))
        return out


class Result:
    def __init__(self, score, acc, pred, error):
        self.score, self.acc, self.pred, self.error = score, acc, pred, error


def test_reward_errors_count_in_the_filtered_groups_too():
    # one group per class; the batch takes one group: the cut is at the mixed one, the 4th drawn
    manager = RolloutManager(
        [ScriptedEngine("e0")],
        ErrorsOnWrong(),
        manager_config(train_batch_size=1, gen_batch_size=4),
        Tokenizer(),
    )
    batch = manager.collect(Dataset([WRONG, RIGHT, RIGHT, MIXED]), weight_version=0)
    m = batch.metrics
    assert m["rollout/groups_in_batch"] == 1 and m["rollout/filtered_all_wrong"] == 1
    # the all-wrong group's 4 failures and the batch's 2: counted over every scored response (6 of 16)
    assert sum(s.reward_error is not None for s in batch.samples) == 2
    assert m["rollout/reward_errors"] == 6


def test_a_step_failing_mostly_in_the_reward_stops_naming_the_error_not_the_data(tmp_path):
    # every response fails in a new user's reward: all groups all-wrong, the rounds run out
    (tmp_path / "broken.py").write_text(BROKEN)
    with Scorer(f"{tmp_path / 'broken.py'}:broken") as scorer:
        manager = RolloutManager(
            [ScriptedEngine("e0")], scorer, manager_config(max_num_gen_batches=2), Tokenizer()
        )
        with pytest.raises(RewardFunctionError) as caught:
            manager.collect(Dataset([MIXED]), weight_version=0)
    message = str(caught.value)
    assert "\n" not in message and "too difficult" not in message
    assert "32 of the step's 32 responses failed in the reward function" in message
    # the first error with the line of the user's file that raised
    assert (
        f"TypeError: object of type 'int' has no len() (at {tmp_path / 'broken.py'}:3 in broken)" in message
    )


def test_a_step_failing_mostly_in_the_reward_stops_even_with_the_filter_off():
    manager = RolloutManager(
        [ScriptedEngine("e0")], ErrorsOnWrong(), manager_config(filter_groups_enable=False), Tokenizer()
    )
    with pytest.raises(RewardFunctionError, match=r"12 of the step's 16 responses failed .*mine.py:score"):
        manager.collect(Dataset([WRONG, WRONG, RIGHT, WRONG]), weight_version=0)


def test_groups_dropped_unscored_blame_the_reward_model_not_the_data():
    class DeadJudge(ScriptedJudge):
        def score(self, s):
            self.asked += 1
            return ScoreOutcome(s.sample_id, None, "down", "connection refused")

    manager = RolloutManager(
        [ScriptedEngine("e0")],
        ErrorsOnWrong(),
        manager_config(max_num_gen_batches=2),
        Tokenizer(),
        reward_model=DeadJudge(),
    )
    with pytest.raises(
        RewardFunctionError,
        match=r"8 of the step's 8 dropped groups .* unscored \(responses by reason: down: 32\)",
    ):
        manager.collect(Dataset([MIXED]), weight_version=0)


def test_tool_errors_and_timeouts_count_in_the_filtered_groups_too():
    def episode(errors, timeouts):
        turns = [
            EpisodeTurn("assistant", 0, 1, "stop", calls=2),
            EpisodeTurn("tool", 1, 2, errors=errors, timeouts=timeouts),
        ]
        return EpisodeInfo(turns, "stop").as_dict()

    ledger = Ledger(["e0"], target=1)
    dropped, kept = Group(0, None), Group(1, None)
    kept.samples = [_sample(0, 1.0), _sample(0, -1.0)]
    dropped.samples = [_sample(1, -1.0), _sample(1, -1.0)]
    for s in kept.samples:
        s.episode = episode(0, 0)
    for s in dropped.samples:
        s.episode = episode(1, 1)  # a tool that fails makes the group all-wrong
    ledger.drawn, ledger.rounds = 2, 1
    ledger.record(dropped, "all_wrong")  # drawn first
    ledger.record(kept, "kept")  # the cut: the batch is this one group
    ledger.settle()
    cfg = SimpleNamespace(n=2, train_batch_size=1, partial=False, max_response_length=8)
    m = rollout_metrics(cfg, EnginePool([SimpleNamespace(name="e0")]), kept.samples, ledger, 1.0, 0)
    assert m["rollout/multiturn/tool_errors"] == 2.0 and m["rollout/multiturn/tool_timeouts"] == 2.0


def test_a_partial_batch_left_by_an_unscoring_reward_model_blames_it_not_the_batch_size():
    """With allow_partial_batch (the demo's), a reward model that leaves most groups unscored
    made a partial batch of the few it scored, and the run then stopped on "fewer than one
    optimizer mini-batch" (measured: a crash-looping reward server's run stopped so at step 4).
    The step names the reward model instead."""
    import re

    class MostlyDeadJudge(ScriptedJudge):
        def score(self, s):
            self.asked += 1
            group = int(re.search(r"g(\d+)", str(s.sample_id)).group(1))
            if group == 0:  # one group scored, with spread: a partial batch of one group
                return ScoreOutcome(s.sample_id, 1.0 if s.sample_id.endswith(("s0", "s2")) else -1.0)
            return ScoreOutcome(s.sample_id, None, "down", "connection refused")

    manager = RolloutManager(
        [ScriptedEngine("e0")],
        Scorer(),
        manager_config(max_num_gen_batches=2, allow_partial_batch=True),
        Tokenizer(),
        reward_model=MostlyDeadJudge(),
    )
    with pytest.raises(RewardFunctionError, match=r"of the step's \d+ dropped groups were dropped because"):
        manager.collect(Dataset([MIXED]), weight_version=0)
