"""Scoring under load: the cut of a full batch does not wait for rewards past it (their requests
are cancelled), a step's scoring has a deadline (reward.model.step_timeout_s), a served model's
responses are coroutines on its client's loop rather than a thread each, and the built-in rule
scores with no lock or worker process between scoring threads."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from reward_model_fixtures import served_settings
from rollout_fakes import MIXED, Dataset, Scorer, ScriptedEngine, Tokenizer, manager_config
from test_rewards_served_failures import StandIn, samples

from megatron_dapo.rewards.scorer import Scorer as RuleScorer
from megatron_dapo.rewards.served import BlockingRewardModel, ScoreOutcome
from megatron_dapo.rollout.manager import RolloutManager


class AsyncJudge:
    """A judge with a loop of its own (``submit``): group 0's samples are scored at once (two
    right, two wrong), every later group's never (a judge stuck on them); counts the scoring
    threads alive while it is asked."""

    kind = "judge"
    concurrency = 256
    step_timeout_s = None

    def __init__(self):
        self.futures: list[Future] = []
        self.threads = 0

    def submit(self, sample, deadline=None):
        self.threads = max(self.threads, sum(t.name.startswith("reward") for t in threading.enumerate()))
        fut: Future = Future()
        group, j = str(sample.sample_id).rsplit("-g", 1)[1].split("-s")
        if group == "0":
            fut.set_result(ScoreOutcome(sample.sample_id, 1.0 if int(j) % 2 else -1.0))
        self.futures.append(fut)
        return fut

    def check_down(self):
        pass


def test_the_cut_does_not_wait_for_rewards_past_it_and_cancels_them():
    judge = AsyncJudge()
    cfg = manager_config(train_batch_size=1, gen_batch_size=8, abort_timeout_s=60.0)
    manager = RolloutManager([ScriptedEngine("e0")], Scorer(), cfg, Tokenizer(), reward_model=judge)
    start = time.monotonic()
    batch = manager.collect(Dataset([MIXED]), weight_version=0)
    assert time.monotonic() - start < 20  # not abort_timeout_s: nothing waits for the stuck judge
    assert batch.metrics["rollout/groups_in_batch"] == 1
    stuck = [f for f in judge.futures if not f.done() or f.cancelled()]
    assert stuck and all(f.cancelled() for f in stuck)  # their requests cancelled, not left running
    # more responses waiting at the judge than scoring threads: no thread held per response (the
    # pool only decodes)
    assert len(stuck) > 4 and judge.threads <= 4


def test_a_step_s_scoring_deadline_leaves_the_late_ones_unscored():
    s = StandIn(default=("hang",))
    try:
        settings = served_settings(kind="judge", url=s.url, timeout_s=30.0, step_timeout_s=0.5)
        with BlockingRewardModel(settings) as model:
            assert model.step_timeout_s == 0.5
            start = time.monotonic()
            fut = model.submit(samples(1)[0], deadline=time.monotonic() + 0.5)
            out = fut.result(timeout=20)
            assert time.monotonic() - start < 10
    finally:
        s.close()
    assert out.unscored == "timeout" and "reward.model.step_timeout_s" in out.detail


def test_the_built_in_rule_scores_without_a_worker_or_a_lock():
    with RuleScorer() as scorer:
        results = []
        threads = [
            threading.Thread(
                target=lambda: results.extend(scorer.score_many([("math_dapo", "Answer: 42", "42")]))
            )
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert scorer._proc is None  # no worker process, so no lock to queue behind
    assert [(r.score, r.acc) for r in results] == [(1.0, True)] * 4
