"""Served reward models against a stand-in HTTP server that fails on purpose: every failure ends in
an unscored outcome with its reason, or in one named line, never in a score of 0 or a traceback;
retries, back-off and the in-flight bound are what the settings say (counted at the stand-in)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import judge_standin
import pytest
from reward_model_fixtures import served_settings

from megatron_dapo.ports import free_port
from megatron_dapo.rewards.served import (
    BlockingRewardModel,
    RewardModelError,
    RewardRequestError,
    RewardSample,
    RewardServerDown,
)
from megatron_dapo.rewards.served.classifier import ClassifierClient
from megatron_dapo.rewards.served.transport import ServerPool


class StandIn(judge_standin.StandIn):
    """A 127.0.0.1 server answering the reward endpoints; ``script`` queues one behaviour per
    request (then ``default``): ("ok",), ("verdict", text), ("slow", seconds), ("hang",) until
    ``release``, ("drop",), ("status", code, payload[, headers]), ("garbage",). It counts requests and the
    most it held at once (``peak``)."""

    def __init__(self, default=("ok",), max_model_len=None, port=0):
        self.default = default
        self.script: deque = deque()
        self.release = threading.Event()  # ends every hang at teardown
        self._script_lock = threading.Lock()
        super().__init__(
            {}, other=self._act, model_id="standin-judge", max_model_len=max_model_len, port=port
        )

    def _act(self, path: str, body: dict):
        with self._script_lock:
            action = self.script.popleft() if self.script else self.default
        kind = action[0]
        if kind == "hang":
            self.release.wait(60)
            return 200, self.reply(path, "yes")
        if kind == "drop":
            return "drop"
        if kind == "status":  # ("status", code, payload[, headers])
            return tuple(action[1:])
        if kind == "garbage":
            return 200, "{not json"
        if kind == "slow":
            time.sleep(action[1])
        return 200, self.reply(path, action[1] if kind == "verdict" else "yes")

    @staticmethod
    def reply(path: str, verdict: str) -> dict:
        if path == "/classify":
            return {"embedding": [0.25], "meta_info": {"id": "x"}}
        if path == "/generate":
            return {"text": verdict, "meta_info": {"finish_reason": {"type": "stop"}}}
        return {
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": verdict}, "finish_reason": "stop"}
            ]
        }

    def posts(self) -> int:
        return len(self.requests)

    def close(self):
        self.release.set()
        super().close()


@pytest.fixture
def stand_in():
    servers = []

    def make(default=("ok",), max_model_len=None):
        s = StandIn(default, max_model_len)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def judge(url, **kw) -> BlockingRewardModel:
    """A judge given by URL (the OpenAI-compatible API): the whole client stack, no tokenizer."""
    settings = dict(kind="judge", url=url, timeout_s=5.0, max_retries=2, max_in_flight=8, down_grace_s=300.0)
    settings.update(kw)
    return BlockingRewardModel(served_settings(**settings))


def samples(n: int) -> list[RewardSample]:
    return [
        RewardSample(i, [{"role": "user", "content": f"q{i}"}], f"answer {i}", ground_truth="42")
        for i in range(n)
    ]


def test_a_good_answer_is_scored_with_the_model_name_the_server_lists(stand_in):
    s = stand_in()
    with judge(s.url) as model:
        [out] = model.score_many(samples(1))
    assert out.scored and out.score == 1.0 and out.verdict == "yes" and out.attempts == 1
    path, body = s.requests[-1]
    assert path == "/v1/chat/completions" and body["model"] == "standin-judge"
    assert body["temperature"] == 0.0 and body["max_completion_tokens"] == 1024
    assert "answer 0" in body["messages"][0]["content"] and "42" in body["messages"][0]["content"]


def test_5xx_is_retried_then_the_sample_is_unscored_server_error(stand_in):
    s = stand_in(default=("status", 500, {"error": {"message": "CUDA out of memory"}}))
    with judge(s.url, max_retries=2) as model:
        [out] = model.score_many(samples(1))
    assert out.score is None and out.unscored == "server_error"
    assert "HTTP 500" in out.detail and "CUDA out of memory" in out.detail and "sample 0" in out.detail
    assert out.attempts == 3 and s.posts() == 3


def test_a_5xx_then_an_answer_scores_on_the_retry(stand_in):
    s = stand_in()
    s.script.append(("status", 503, "overloaded"))
    with judge(s.url) as model:
        [out] = model.score_many(samples(1))
    assert out.scored and out.attempts == 2 and s.posts() == 2


def test_a_429_waits_its_retry_after_then_scores_and_is_counted(stand_in):
    s = stand_in()
    s.script.append(("status", 429, {"error": "rate limit"}, {"Retry-After": "1.5"}))
    with judge(s.url) as model:
        [out] = model.score_many(samples(1))
    # the back-off alone would have waited 0.5 s
    assert out.scored and out.attempts == 2 and out.throttled == 1 and out.elapsed_s >= 1.5
    assert s.posts() == 2


def test_a_408_is_retried_and_429_on_every_attempt_is_unscored_rate_limited(stand_in):
    s = stand_in(default=("status", 429, {"error": "rate limit"}, {"Retry-After": "0"}))
    s.script.append(("status", 408, "request timeout"))
    with judge(s.url, max_retries=2) as model:
        [out] = model.score_many(samples(1))
    assert out.unscored == "rate_limited" and "HTTP 429" in out.detail
    assert out.attempts == 3 and out.throttled == 3 and s.posts() == 3


def test_retry_after_as_seconds_or_an_http_date_within_its_cap():
    import email.utils

    import httpx

    from megatron_dapo.rewards.served.transport import _RETRY_AFTER_MAX_S, _retry_after

    def wait(value):
        return _retry_after(httpx.Response(429, headers={} if value is None else {"Retry-After": value}), 0.5)

    assert wait("3") == 3.0 and wait(None) == 0.5 and wait("soon") == 0.5 and wait("-4") == 0.0
    assert wait("86400") == _RETRY_AFTER_MAX_S
    date = email.utils.formatdate(time.time() + 20, usegmt=True)
    assert 17.0 <= wait(date) <= 20.0


def test_a_hang_ends_unscored_timeout_within_its_retries(stand_in):
    s = stand_in(default=("hang",))
    timeout, retries = 0.5, 2
    with judge(s.url, timeout_s=timeout, max_retries=retries) as model:
        start = time.monotonic()
        [out] = model.score_many(samples(1))
        elapsed = time.monotonic() - start
    assert out.unscored == "timeout" and "0.5s" in out.detail and out.attempts == retries + 1
    backoff = 0.5 + 1.0  # the pool's waits before retries 1 and 2
    assert timeout * (retries + 1) <= elapsed < timeout * (retries + 1) + backoff + 2.0


def test_garbage_json_is_unscored_unparseable_and_not_retried(stand_in):
    s = stand_in(default=("garbage",))
    with judge(s.url) as model:
        [out] = model.score_many(samples(1))
    assert out.unscored == "unparseable" and "not JSON" in out.detail and "{not json" in out.detail
    assert s.posts() == 1


def test_an_answer_without_text_is_unscored_unparseable(stand_in):
    message = {"role": "assistant", "content": None, "reasoning_content": "thinking about yes"}
    s = stand_in(default=("status", 200, {"choices": [{"message": message, "finish_reason": "length"}]}))
    with judge(s.url) as model:
        [out] = model.score_many(samples(1))
    assert out.unscored == "unparseable" and "has no text" in out.detail and out.verdict is None


def test_a_verdict_without_yes_or_no_is_unscored_unparseable_with_the_verdict(stand_in):
    s = stand_in(default=("verdict", "I cannot decide."))
    with judge(s.url) as model:
        [out] = model.score_many(samples(1))
    assert out.unscored == "unparseable" and out.verdict == "I cannot decide."
    assert "yes_no found no score" in out.detail and s.posts() == 1


def test_connection_refused_is_unscored_down():
    url = f"http://127.0.0.1:{free_port()}"
    with judge(url, max_retries=1) as model:
        [out] = model.score_many(samples(1))
    assert out.unscored == "down" and url in out.detail and out.attempts == 2


def test_a_long_outage_stays_unscored_down_however_many_requests_fail():
    """A step's worth of requests failing against a dead server (the e2e kill saw 1025 in a row):
    each is unscored down, the back-off stays bounded (it overflowed a float at 2**1024 before)."""
    url = f"http://127.0.0.1:{free_port()}"
    with judge(url, max_retries=0, max_in_flight=64) as model:
        outs = model.score_many(samples(1100))
    assert {o.unscored for o in outs} == {"down"}


def test_a_connection_dropped_mid_answer_is_unscored_down(stand_in):
    s = stand_in(default=("drop",))
    with judge(s.url, max_retries=0) as model:
        [out] = model.score_many(samples(1))
    assert out.unscored == "down" and s.posts() == 1


def test_a_server_down_past_the_grace_stops_with_one_line():
    url = f"http://127.0.0.1:{free_port()}"
    with judge(url, max_retries=3, down_grace_s=1.0) as model, pytest.raises(RewardServerDown) as e:
        model.score_many(samples(1))
    line = str(e.value)
    assert "\n" not in line and url in line and "reward.model.down_grace_s=1" in line
    assert "ConnectError" in line


def test_a_dead_server_s_samples_move_to_the_live_one(stand_in):
    live = stand_in()
    dead = f"http://127.0.0.1:{free_port()}"
    settings = served_settings(kind="judge", url=dead, max_retries=2, max_in_flight=4)
    with BlockingRewardModel(settings, urls=[dead, live.url]) as model:
        outs = model.score_many(samples(8))
    assert all(o.scored and o.server == live.url for o in outs)


def test_a_4xx_is_one_line_naming_url_reason_and_sample_and_is_not_retried(stand_in):
    s = stand_in(default=("status", 400, {"object": "error", "message": "temperature must be non-negative"}))
    with judge(s.url) as model, pytest.raises(RewardRequestError) as e:
        model.score_many([samples(8)[7]])
    line = str(e.value)
    assert "\n" not in line and "HTTP 400" in line and "temperature must be non-negative" in line
    assert f"{s.url}/v1/chat/completions" in line and "sample 7" in line
    assert s.posts() == 1


def test_a_4xx_among_many_cancels_the_rest(stand_in):
    s = stand_in(default=("slow", 0.3))
    s.script.append(("status", 422, {"detail": [{"loc": ["body", "messages"], "msg": "field required"}]}))
    with judge(s.url, max_in_flight=1) as model, pytest.raises(RewardRequestError, match="field required"):
        model.score_many(samples(20))
    assert s.posts() < 20


@pytest.mark.parametrize("servers", [1, 2])
def test_in_flight_requests_per_server_stay_within_max_in_flight(stand_in, servers):
    backends = [stand_in(default=("slow", 0.3)) for _ in range(servers)]
    settings = served_settings(kind="judge", url=backends[0].url, max_in_flight=3)
    with BlockingRewardModel(settings, urls=[b.url for b in backends]) as model:
        outs = model.score_many(samples(18))
        peaks = model.peak_in_flight()
    assert all(o.scored for o in outs)
    for b in backends:
        assert b.peak == 3, "the bound is reached (18 samples) and never passed"
        assert peaks[b.url] == 3
    assert sum(b.posts() for b in backends) == 18


class _Tokenizer:
    """Enough of an HF tokenizer for the classifier: a chat template and ids of a text."""

    chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) % 97 for c in text]}


def classify(url: str, transform=None, **pool_kw):
    pool_kw = {"timeout_s": 5.0, "max_retries": 1, "max_in_flight": 4, "down_grace_s": 300.0, **pool_kw}

    async def run():
        pool = ServerPool([url], what="reward classifier", **pool_kw)
        try:
            client = ClassifierClient(pool, _Tokenizer(), transform)
            return await client.score(samples(1)[0])
        finally:
            await pool.aclose()

    return asyncio.run(run())


def test_classifier_sends_the_chat_rendered_ids_and_reads_the_logit(stand_in):
    s = stand_in()
    out = classify(s.url)
    assert out.score == 0.25 and out.raw == [0.25]
    path, body = s.requests[0]
    assert path == "/classify" and body == {
        "input_ids": [ord(c) % 97 for c in "user: q0\nassistant: answer 0\n"]
    }


def test_classifier_transform_maps_the_logit(stand_in, tmp_path):
    s = stand_in()
    fn = tmp_path / "t.py"
    fn.write_text("def scaled(x):\n    return 4 * x - 1\n")
    assert classify(s.url, f"{fn}:scaled").score == 0.0


def test_classifier_answer_without_a_score_is_unparseable(stand_in):
    s = stand_in(default=("status", 200, {"embedding": [], "meta_info": {}}))
    out = classify(s.url)
    assert out.unscored == "unparseable" and "embedding" in out.detail


def test_classifier_4xx_names_url_reason_and_sample(stand_in):
    s = stand_in(default=("status", 400, {"error": {"message": "token id 999 out of range"}}))
    with pytest.raises(RewardRequestError) as e:
        classify(s.url)
    assert (
        f"{s.url}/classify" in str(e.value) and "token id 999" in str(e.value) and "sample 0" in str(e.value)
    )


def test_a_transform_that_raises_is_one_line_naming_it(stand_in, tmp_path):
    from megatron_dapo.rewards.served import RewardModelError

    s = stand_in()
    fn = tmp_path / "t.py"
    fn.write_text("def broken(x):\n    return 1 / 0\n")
    with pytest.raises(
        RewardModelError, match=r"reward.model.transform=.*t.py:broken raised ZeroDivisionError"
    ):
        classify(s.url, f"{fn}:broken")


def test_throttled_answers_are_a_step_metric():
    from megatron_dapo.rewards.served import ScoreOutcome
    from megatron_dapo.rollout.rollout_metrics import served_model_metrics

    outcomes = [
        ("judge", ScoreOutcome(0, 1.0, attempts=3, throttled=2)),
        ("judge", ScoreOutcome(1, None, "rate_limited", attempts=3, throttled=3)),
        ("judge", ScoreOutcome(2, -1.0, attempts=1)),
    ]
    m = served_model_metrics(outcomes)
    assert m["reward/judge_throttled"] == 5.0 and m["reward/judge_retries"] == 4.0


class _WordTokenizer:
    """One token per space-separated word; a chat template of one line per message."""

    chat_template = "words"

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"

    def __call__(self, text, add_special_tokens):
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            ids.append(self.vocab[w])
        return {"input_ids": ids}

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


def served_judge(url, too_long="cut", max_new_tokens=16, tokenizer=None):
    from megatron_dapo.rewards.served.judge import JudgeClient

    async def run(sample):
        pool = ServerPool([url], timeout_s=5.0, max_retries=0, max_in_flight=4, down_grace_s=60.0)
        try:
            judge = JudgeClient(
                pool,
                api="sglang",
                tokenizer=tokenizer or _WordTokenizer(),
                prompt_template="Judge {response} against {ground_truth}: yes or no?",
                max_new_tokens=max_new_tokens,
                too_long=too_long,
            )
            return await judge.score(sample)
        finally:
            await pool.aclose()

    return lambda sample: asyncio.run(run(sample))


LONG = RewardSample(
    5, [{"role": "user", "content": "q"}], " ".join(f"w{i}" for i in range(200)) + " Answer: 42", "42"
)


def test_a_judge_prompt_past_its_context_is_cut_to_the_response_s_end_and_counted(stand_in):
    s = stand_in(max_model_len=64)  # the judge's context, from GET /v1/models as SGLang reports it
    tok = _WordTokenizer()
    out = served_judge(s.url, max_new_tokens=16, tokenizer=tok)(LONG)
    path, body = s.requests[-1]
    sent = tok.decode(body["input_ids"]).split()
    # prompt + verdict fill the context: 64 - 16 for the prompt, 16 for the verdict
    assert len(sent) == 48 and body["sampling_params"]["max_new_tokens"] == 16
    # 8 words of template and reference, the mark, and the response's last 39 words (its final
    # answer): its first 202 - 39 = 163 dropped
    assert sent[:3] == ["<user>", "Judge", "[...]"] and sent[3] == "w163"
    assert sent[-9:] == ["w199", "Answer:", "42", "against", "42:", "yes", "or", "no?", "<assistant>"]
    assert out.scored and out.cut_tokens == 163


def test_a_judge_prompt_past_its_context_is_unscored_too_long_when_asked(stand_in):
    s = stand_in(max_model_len=64)
    out = served_judge(s.url, too_long="unscored")(LONG)
    assert out.unscored == "too_long" and "context 64" in out.detail and s.posts() == 0


def test_a_judge_that_refuses_a_prompt_as_too_long_leaves_it_unscored_not_the_run_stopped(stand_in):
    message = "The input (263 tokens) is longer than the model's context length (256 tokens)."
    s = stand_in(default=("status", 400, {"object": "error", "message": message}))
    with judge(s.url) as model:
        [out] = model.score_many(samples(1))
    assert out.unscored == "too_long" and "263 tokens" in out.detail and s.posts() == 1


def test_a_judge_whose_context_cannot_hold_the_template_is_refused_at_start_up(stand_in):
    """Measured: the demo's policy as its own judge (256-token context) took the built-in
    template at 263 tokens before any response; every sample of step 1 came back too_long and the
    run stopped after generating the step. The client refuses such a judge when it opens."""
    from megatron_dapo.rewards.served.judge import JudgeClient

    s = stand_in(max_model_len=32)

    async def run():
        pool = ServerPool([s.url], timeout_s=5.0, max_retries=0, max_in_flight=4, down_grace_s=60.0)
        try:
            template = " ".join(f"word{i}" for i in range(30)) + " {response} {ground_truth}"
            judge = JudgeClient(
                pool, api="sglang", tokenizer=_WordTokenizer(), prompt_template=template, max_new_tokens=16
            )
            await judge.resolve_server()
            judge.check_template_fits()
        finally:
            await pool.aclose()

    with pytest.raises(RewardModelError, match=r"empty question, response and reference is 32 tokens") as e:
        asyncio.run(run())
    assert "\n" not in str(e.value) and "context of 32 tokens leaves 24" in str(e.value)
    assert s.posts() == 0
    # a template that fits with room to spare opens as before
    assert served_judge(s.url, max_new_tokens=4)(samples(1)[0]).scored
