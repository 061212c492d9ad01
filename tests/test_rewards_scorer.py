"""Reward registry and the fault-isolated Scorer (custom rewards that raise, hang, crash, print)."""

import logging
import time

import numpy as np
import pytest

from megatron_dapo.rewards import RewardResult, RewardWorkerError, Scorer, UnknownDataSourceError
from megatron_dapo.rewards.registry import builtin_reward, is_math_dapo_source, load_custom_fn, reward_fields

CUSTOM = """
import json, os, time

def echo(data_source, solution_str, ground_truth, extra_info):
    return {"score": 0.5, "pred": json.dumps([data_source, solution_str, ground_truth, extra_info])}

def plain_float(data_source, solution_str, ground_truth, extra_info):
    return 1.0 if solution_str == ground_truth else 0.0

def with_acc(data_source, solution_str, ground_truth, extra_info):
    return {"score": -0.2, "acc": True}

def misbehave(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "raise":
        raise ZeroDivisionError("division by zero in reward")
    if solution_str == "hang":
        time.sleep(60)
    if solution_str == "crash":
        os._exit(3)
    if solution_str == "nokey":
        return {"acc": True}
    if solution_str == "print":
        print("this goes to stderr, not into the protocol")
    return 1.0
"""


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return path


@pytest.mark.parametrize(
    "source", ["math_dapo", "math", "aime24", "AIME-2024", "aime_2025", "DAPO-17k", "dapo_math"]
)
def test_known_sources(source):
    assert is_math_dapo_source(source)
    assert builtin_reward(source)("Answer: 3", "3", {})["acc"] is True


def test_unknown_source_error_names_sources_and_the_fix():
    with pytest.raises(UnknownDataSourceError) as err:
        builtin_reward("openai/gsm8k")
    msg = str(err.value)
    assert "'openai/gsm8k'" in msg and "math_dapo" in msg and "'aime'" in msg
    assert "path/to/file.py:function" in msg


def test_reward_fields_contract():
    assert reward_fields(1.0) == (1.0, True, "")
    assert reward_fields(0) == (0.0, False, "")
    assert reward_fields(np.float32(0.5)) == (0.5, True, "")
    assert reward_fields({"score": -1.0, "pred": 7}) == (-1.0, False, "7")
    assert reward_fields({"score": -1.0, "acc": True}) == (-1.0, True, "")
    with pytest.raises(ValueError, match="no 'score' key"):
        reward_fields({"acc": True})
    with pytest.raises(ValueError, match="finite"):
        reward_fields(float("nan"))
    with pytest.raises(TypeError, match="must be a number"):
        reward_fields("1.0")


def test_load_custom_fn_errors(custom_file):
    assert load_custom_fn(f"{custom_file}:plain_float")("s", "a", "a", {}) == 1.0
    with pytest.raises(ValueError, match="path/to/file.py:function"):
        load_custom_fn(str(custom_file))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_custom_fn("/nonexistent/reward.py:fn")
    with pytest.raises(AttributeError, match="no function 'nope'.*plain_float"):
        load_custom_fn(f"{custom_file}:nope")


def test_builtin_scoring_and_stats():
    with Scorer() as scorer:
        r = scorer.score("aime24", "work...\nAnswer: $540$", "540")
        assert r == RewardResult(1.0, True, "540", None)
        results = scorer.score_many(
            [("math_dapo", "Answer: 3", "4"), ("DAPO-17k", "Answer: 1,000", "1000", {})]
        )
        assert [(x.score, x.acc, x.pred) for x in results] == [(-1.0, False, "3"), (1.0, True, "1000")]
        assert scorer.stats == {"calls": 3, "errors": 0, "timeouts": 0, "worker_restarts": 0}
        with pytest.raises(UnknownDataSourceError, match="openai/gsm8k"):
            scorer.score("openai/gsm8k", "Answer: 1", "1")


def test_boxed_fallback_flag_reaches_the_rule():
    with Scorer(boxed_fallback=True) as scorer:
        assert scorer.score("math_dapo", "so \\boxed{12}", "12").acc is True
    with Scorer() as scorer:
        assert scorer.score("math_dapo", "so \\boxed{12}", "12").acc is False


def test_custom_fn_gets_verl_arguments(custom_file):
    with Scorer(f"{custom_file}:echo") as scorer:
        # a custom reward scores every data_source, known or not; numpy values are sent as lists
        r = scorer.score("anything/else", "sol", "gt", {"index": 3, "v": np.arange(2)})
        assert r.score == 0.5 and r.acc is True and r.error is None
        assert r.pred == '["anything/else", "sol", "gt", {"index": 3, "v": [0, 1]}]'
        assert scorer.score("x", "sol", "gt").pred.endswith("{}]")  # extra_info None -> {}
    with Scorer(f"{custom_file}:with_acc") as scorer:
        assert scorer.score("x", "s", "g") == RewardResult(-0.2, True, "", None)
    with Scorer(f"{custom_file}:plain_float") as scorer:
        assert [r.acc for r in scorer.score_many([("x", "a", "a"), ("x", "a", "b")])] == [True, False]


def test_raising_hanging_crashing_rewards_do_not_stop_scoring(custom_file, caplog):
    items = [("x", s, "gt") for s in ["ok", "raise", "raise", "hang", "ok", "crash", "nokey", "print", "ok"]]
    with Scorer(f"{custom_file}:misbehave", timeout_s=0.5) as scorer, caplog.at_level(logging.WARNING):
        t0 = time.monotonic()
        results = scorer.score_many(items)
        elapsed = time.monotonic() - t0
        # the 60 s hang, not a bound on speed: a loaded machine (worker restarts after the crash)
        # can take many times the 0.5 s timeout
        assert elapsed < 40, "the hang must cost about one timeout, not 60 s"
        assert [r.score for r in results] == [1.0, -1.0, -1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0]
        assert [r.acc for r in results] == [True, False, False, False, True, False, False, True, True]
        # the line of the user's file that raised, so a new user's bug is found without a debugger
        line = next(
            i
            for i, t in enumerate(custom_file.read_text().splitlines(), 1)
            if "division by zero in reward" in t
        )
        assert results[1].error == (
            f"ZeroDivisionError: division by zero in reward (at {custom_file.resolve()}:{line} in misbehave)"
        )
        assert results[3].error == "reward call timed out after 0.5s"
        assert results[5].error == "reward worker exited with code 3 while scoring"
        assert "no 'score' key" in results[6].error
        assert all(results[i].error is None for i in (0, 4, 7, 8))
        assert scorer.stats == {"calls": 9, "errors": 4, "timeouts": 1, "worker_restarts": 2}
        # later calls still work after the restarts
        assert scorer.score("x", "ok", "gt").acc is True
    logged = [rec.getMessage() for rec in caplog.records if "division by zero" in rec.getMessage()]
    assert len(logged) == 1, "a repeated error is logged once"


def test_broken_custom_file_fails_at_construction(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def f(:\n")
    with pytest.raises(RewardWorkerError, match="SyntaxError"):
        Scorer(f"{bad}:f")
    with pytest.raises(RewardWorkerError, match="no function 'g'"):
        (tmp_path / "ok.py").write_text("def f(*a):\n    return 1.0\n")
        Scorer(f"{tmp_path / 'ok.py'}:g")


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        Scorer(timeout_s=0)
    with Scorer() as scorer, pytest.raises(ValueError, match="got 2 fields"):
        scorer.score_many([("math_dapo", "Answer: 1")])
