"""The evaluation runner with a scripted generator, and the OpenAI-compatible endpoint client
against a local HTTP server (loopback only) that answers, fails, then answers."""

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_dapo.driver.validation import engine_generator
from megatron_dapo.eval.openai_endpoint import EndpointError, make_endpoint_generator
from megatron_dapo.eval.runner import Completion, EvalProblem, evaluate
from megatron_dapo.rollout.types import GenerationResult, SamplingParams


@dataclass
class _R:
    score: float
    acc: bool
    pred: str


class ExactScorer:
    """Correct when the response is the ground truth (the real rule is tested in test_rewards_*)."""

    def score(self, data_source, solution_str, ground_truth, extra_info=None):
        ok = solution_str.strip() == ground_truth
        return _R(1.0 if ok else -1.0, ok, solution_str.strip())


def _problems():
    # the AIME layout repeats each problem; the runner must de-duplicate by prompt
    return [
        EvalProblem(f"p{i % 2}", f"prompt {i % 2}", [1, 10 + i % 2], "aime", str(i % 2), {}) for i in range(6)
    ]


def test_evaluate_dedupes_and_aggregates():
    answers = {"prompt 0": ["0", "0", "5", "0"], "prompt 1": ["1", "2", "2", "3"]}

    def gen(problems, k):
        assert [p.prompt_text for p in problems] == ["prompt 0", "prompt 1"] and k == 4
        return [[Completion(t, 3, t == "5") for t in answers[p.prompt_text]] for p in problems]

    m = evaluate(_problems(), gen, ExactScorer(), k=4, pass_ks=(1, 2))
    assert m["val/avg@4"] == pytest.approx((3 / 4 + 1 / 4) / 2)
    assert m["val/maj@4"] == pytest.approx((1 + 0) / 2)  # "0" wins for p0, "2" (wrong) wins for p1
    assert m["val/num_problems"] == 2
    assert m["val/truncated_ratio"] == pytest.approx(1 / 8)


def test_evaluate_rejects_short_generator_output():
    with pytest.raises(RuntimeError, match="expected 4 each"):
        evaluate(_problems(), lambda probs, k: [[Completion("0", 1, False)]] * len(probs), ExactScorer(), k=4)


class _Handler(BaseHTTPRequestHandler):
    calls = {"n": 0}

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.calls["n"] += 1
        # the prompt arrives as token ids: [1, 10 + answer]
        if body["prompt"] == [1, 11] and _Handler.calls.get("failed") is None:
            _Handler.calls["failed"] = True
            self.send_response(500)
            self.end_headers()
            return
        if body["prompt"] == [99]:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"not json")
            return
        assert body["temperature"] == 1.0 and body["top_p"] == 0.7 and body["max_tokens"] == 16
        ans = str(body["prompt"][-1] - 10)
        choices = [{"index": i, "text": ans, "finish_reason": "stop"} for i in range(body["n"])]
        payload = json.dumps({"choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_endpoint_generator_retries_and_scores(server):
    gen = make_endpoint_generator(
        server,
        model="m",
        temperature=1.0,
        top_p=0.7,
        max_tokens=16,
        count_text=len,
        timeout_s=10,
        backoff_s=0,
    )
    m = evaluate(_problems(), gen, ExactScorer(), k=3)
    assert m["val/avg@3"] == 1.0
    bad = [EvalProblem("b", "broken", [99], "aime", "0", {})]
    with pytest.raises(EndpointError, match="problem b failed after 3 tries"):
        gen(bad, 2)


class RecordingScorer(ExactScorer):
    def __init__(self):
        self.seen = []

    def score(self, data_source, solution_str, ground_truth, extra_info=None):
        self.seen.append(solution_str)
        return super().score(data_source, solution_str, ground_truth, extra_info)


def test_an_unscored_completion_is_left_out_and_counted():
    answers = {"prompt 0": ["0", "0!", "5", "0"], "prompt 1": ["1", "2", "2", "3"]}

    def gen(problems, k):
        # "0!": a broken episode whose text is the right answer "0"
        return [
            [
                Completion(t.rstrip("!"), 3, False, unscored="broken_episode" if t.endswith("!") else None)
                for t in answers[p.prompt_text]
            ]
            for p in problems
        ]

    scorer = RecordingScorer()
    m = evaluate(_problems(), gen, scorer, k=4, pass_ks=(1,))
    assert len(scorer.seen) == 7  # the broken one never reached the scorer
    # hand-computed on the scored samples: p0 right, 5 wrong, right -> 2/3; p1 1/4
    assert m["val/avg@4"] == pytest.approx((2 / 3 + 1 / 4) / 2)
    assert m["val/unscored"] == 1 and m["val/unscored/broken_episode"] == 1
    assert m["val/problems_below@4"] == 1  # p0 has 3 scored samples of 4
    assert m["val/response_length/mean"] == 3  # an unscored response is still sampled


def test_validation_leaves_a_broken_episode_unscored():
    """The trainer's validation generator marks an episode whose token check broke (a prefix
    break or a re-render mismatch), as training's scoring leaves it unscored."""
    from megatron_dapo.driver.validation import engine_generator
    from megatron_dapo.rollout.types import EpisodeInfo, EpisodeTurn, GenerationResult, SamplingParams

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    class Runner:
        """Sample 0 of every problem answers "0" in an episode that broke (one a prefix break, one a
        re-render mismatch); sample 1 answers "9" in a sound one."""

        def run(self, engine, requests, cancel):
            out = []
            for req in requests:
                j = int(req.request_id.rsplit("-", 1)[1])
                text = "0" if j == 0 else "9"
                breaks = {"prefix_breaks": 1} if "p0" in req.request_id else {"rerender_mismatches": 1}
                info = EpisodeInfo(
                    turns=[EpisodeTurn("assistant", 0, 1, "stop")], **(breaks if j == 0 else {})
                )
                out.append(GenerationResult(req.request_id, [ord(text)], [0.0], "stop", episode=info))
            return out

    problems = [EvalProblem(f"p{i}", f"prompt {i}", [1], "aime", "0", {}) for i in range(2)]
    generate = engine_generator(
        [object()], Tok(), SamplingParams(max_new_tokens=4), seed=0, episodes=Runner()
    )
    scorer = RecordingScorer()
    m = evaluate(problems, generate, scorer, k=2)
    assert scorer.seen == ["9", "9"]
    assert m["val/unscored/broken_episode"] == 2 and m["val/problems_below@2"] == 2
    assert m["val/avg@2"] == 0.0  # the right-looking "0"s were never counted


class CharTok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_validation_keeps_several_calls_in_flight_on_an_engine_and_its_numbers():
    """``calls_per_engine`` calls run on an engine at once (an engine batches them; one at a time it
    waits at each call's last episodes), and the samples are the same as one call at a time."""

    class Engine:
        name = "e"

        def __init__(self):
            self.now = self.most = 0
            self.lock = threading.Lock()

        def generate(self, requests, on_result=None):
            with self.lock:
                self.now += 1
                self.most = max(self.most, self.now)
            time.sleep(0.05)
            with self.lock:
                self.now -= 1
            return [
                GenerationResult(q.request_id, [ord("0") + q.sampling.seed % 10], [0.0], "stop")
                for q in requests
            ]

    problems = [EvalProblem(f"p{i}", f"prompt {i}", [1], "aime", "0", {}) for i in range(8)]
    seen = {}
    for calls in (1, 4):
        engine = Engine()
        generate = engine_generator(
            [engine],
            CharTok(),
            SamplingParams(max_new_tokens=4),
            seed=0,
            requests_per_call=4,
            calls_per_engine=calls,
        )
        seen[calls] = [[c.text for c in row] for row in generate(problems, 4)]
        assert engine.most == calls
    assert seen[1] == seen[4]
