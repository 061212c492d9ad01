"""A judge through the real SGLang 0.5.23 CPU server, on a tiny random causal LM with a chat
template; a user parser (``path.py:fn``) maps whatever the random model says to a deterministic
score, so the plumbing is real end to end. One server start, by ``RewardServers.launch`` on
this node (the path a run without Ray takes).

The served judge (``/generate`` with ids rendered here by the judge's chat template) and the same
server asked as an OpenAI-compatible judge (``/v1/chat/completions``, the server rendering the
template) give the same greedy verdict for every sample: the client renders the prompt as the
server's own template would. The built-in ``yes_no`` finds no verdict in the random model's text,
and the sample is unscored ``unparseable``, not scored.
"""

from __future__ import annotations

import pytest
from helpers import make_tiny_hf_checkpoint
from reward_model_fixtures import add_chat_template, served_settings

from megatron_dapo.config import load_config
from megatron_dapo.rewards.served import (
    BlockingRewardModel,
    RewardSample,
    ServedRewardSettings,
    settings_from_config,
)
from megatron_dapo.sglang.reward_servers import RewardServers

PARSER = "def grade(verdict):\n    return (sum(map(ord, verdict)) % 11) / 10\n"
SAMPLES = [
    RewardSample(i, [{"role": "user", "content": q}], r, ground_truth=g)
    for i, (q, r, g) in enumerate(
        [("What is 6*7?", "Answer: 42", "42"), ("Capital of France?", "Lyon", "Paris"), ("2+2?", "4", "4")]
    )
]


def grade(verdict: str) -> float:
    return (sum(map(ord, verdict)) % 11) / 10


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return add_chat_template(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("judge") / "judge", seed=3))


@pytest.fixture(scope="module")
def judge_server(judge_dir, tmp_path_factory):
    """Started as a run without Ray starts it, on its own node (``RewardServers.launch``)."""
    cfg = load_config(
        None, [f"model.path={judge_dir}", "reward.model.kind=judge", f"reward.model.path={judge_dir}"]
    )
    servers = RewardServers.launch(cfg, settings_from_config(cfg.reward), tmp_path_factory.mktemp("run"))
    try:
        yield servers.servers[0]
    finally:
        servers.stop()
    assert not servers.servers[0].process.alive()


@pytest.fixture(scope="module")
def parser(tmp_path_factory):
    f = tmp_path_factory.mktemp("parser") / "grade.py"
    f.write_text(PARSER)
    return f"{f}:grade"


# the tiny judge reads 128 tokens of one character each: the default template would not fit
TEMPLATE = "Q:{question} R:{response} G:{ground_truth}"


def verdicts(settings: ServedRewardSettings, urls=None):
    with BlockingRewardModel(settings, urls) as model:
        return model.score_many(SAMPLES)


def test_a_served_judge_and_the_same_server_by_url_give_the_same_greedy_verdicts(
    judge_dir, judge_server, parser
):
    common = dict(parser=parser, max_new_tokens=12, prompt_template=TEMPLATE)
    served = verdicts(served_settings("judge", path=str(judge_dir), **common), [judge_server.url])
    assert all(o.scored and o.attempts == 1 and o.server == judge_server.url for o in served), served
    assert [o.score for o in served] == [grade(o.verdict) for o in served]
    assert any(o.verdict for o in served), "the random judge says something"
    again = verdicts(served_settings("judge", path=str(judge_dir), **common), [judge_server.url])
    assert [o.verdict for o in again] == [o.verdict for o in served], "greedy by default"
    by_url = verdicts(served_settings("judge", url=judge_server.url, **common))
    assert [o.verdict for o in by_url] == [o.verdict for o in served]
    assert [o.score for o in by_url] == [o.score for o in served]


def test_a_verdict_yes_no_cannot_read_is_unscored_not_scored(judge_dir, judge_server):
    settings = served_settings(
        "judge", path=str(judge_dir), parser="yes_no", max_new_tokens=12, prompt_template=TEMPLATE
    )
    outcomes = verdicts(settings, [judge_server.url])
    assert all(o.score is None and o.unscored == "unparseable" for o in outcomes), outcomes
    assert all("yes_no found no score" in o.detail and o.verdict is not None for o in outcomes)
