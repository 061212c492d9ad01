"""reward.model's own metrics (reward/<kind>_*), by hand: a scripted rollout of 4 groups x 4 whose
judge answers sample 0 and 2 "yes" at once, sample 1 "no" after one retry, and times out on
sample 3 after three requests. Every figure below is counted from that script, not from the code."""

from __future__ import annotations

import pytest
from rollout_fakes import MIXED, Dataset, Scorer, ScriptedEngine, Tokenizer, manager_config

from megatron_dapo.rewards.served import ScoreOutcome
from megatron_dapo.rollout.manager import RolloutManager

# sample index -> (score, verdict, requests, seconds); None: unscored (timeout)
SCRIPT = {0: (1.0, "yes", 1, 0.5), 1: (-1.0, "no", 2, 1.5), 2: (1.0, "yes", 1, 0.5), 3: (None, None, 3, 4.0)}


class ScriptedJudge:
    kind = "judge"
    concurrency = 4

    def __init__(self):
        self.asked = 0

    def score(self, s):
        self.asked += 1
        score, verdict, attempts, elapsed = SCRIPT[int(str(s.sample_id).rsplit("-s", 1)[1])]
        unscored = "timeout" if score is None else None
        return ScoreOutcome(s.sample_id, score, unscored, "", None, verdict, "", attempts, elapsed)

    def check_down(self):
        pass


def test_the_judges_requests_retries_latency_and_verdicts_are_step_metrics():
    judge = ScriptedJudge()
    manager = RolloutManager(
        [ScriptedEngine("e0")], Scorer(), manager_config(), Tokenizer(), reward_model=judge
    )
    m = manager.collect(Dataset([MIXED]), weight_version=0).metrics
    assert judge.asked == 16 and m["rollout/groups_in_batch"] == 4
    assert m["reward/judge_requests"] == 4 * (1 + 2 + 1 + 3)
    assert m["reward/judge_retries"] == 4 * (0 + 1 + 0 + 2)
    assert m["reward/judge_latency_mean_s"] == pytest.approx((0.5 + 1.5 + 0.5 + 4.0) / 4)
    assert m["reward/judge_latency_max_s"] == 4.0
    assert m["reward/judge_verdict_chars_mean"] == pytest.approx((3 + 2 + 3) / 3)  # the timeout has none
    assert m["reward/model_mean"] == pytest.approx(1 / 3) and m["reward/unscored_timeout"] == 4
    assert not any(k.startswith("reward/classifier_") for k in m)
