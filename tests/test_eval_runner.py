"""The evaluation runner with a scripted generator, and the OpenAI-compatible endpoint client
against a local HTTP server (loopback only) that answers, fails, then answers."""

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_dapo.eval.openai_endpoint import EndpointError, make_endpoint_generator
from megatron_dapo.eval.runner import Completion, EvalProblem, evaluate


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
