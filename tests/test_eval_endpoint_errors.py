"""HTTP errors from an endpoint, against a scripted local server (loopback only): eval's
OpenAI-compatible client and the SGLang rollout client put the server's own message, the URL and
the problem or request in the one-line error; 4xx answers are sent once, 5xx answers and
connection errors are retried. Also how eval counts response tokens from a completions reply."""

from __future__ import annotations

import json
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from megatron_dapo.eval.openai_endpoint import EndpointError, make_endpoint_generator
from megatron_dapo.eval.runner import EvalProblem
from megatron_dapo.http_errors import http_error, server_message
from megatron_dapo.rollout.types import GenerationRequest, SamplingParams
from megatron_dapo.sglang.client import SGLangEngine, SGLangError

# SGLang 0.5.23's answers, verbatim in shape: its OpenAI routes (serving_base.create_error_response)
# and its native routes (http_server._create_error_response).
OPENAI_400 = {
    "object": "error",
    "message": "The input (300 tokens) is longer than the model's context length (256 tokens).",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}
NATIVE_400 = {
    "error": {"message": "The input (300 tokens) is longer than the model's context length (256 tokens)."}
}


class Scripted:
    """Answers each POST with the next scripted (status, body); afterwards with `ok(body)`."""

    def __init__(self, ok):
        self.script: deque = deque()
        self.posts: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.posts.append(body)
                status, reply = fake.script.popleft() if fake.script else (200, ok(body))
                data = reply.encode() if isinstance(reply, str) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def completions(body):
    n = body["n"]
    choices = [{"index": i, "text": "ab", "finish_reason": "stop" if i else "length"} for i in range(n)]
    return {"choices": choices, "usage": {"prompt_tokens": 3, "completion_tokens": 7 * n}}


@pytest.fixture
def endpoint():
    s = Scripted(completions)
    yield s
    s.close()


def generator(url, **kw):
    return make_endpoint_generator(
        url, model="m", temperature=1.0, top_p=0.7, max_tokens=8, count_text=len, backoff_s=0, **kw
    )


PROBLEM = EvalProblem("p7", "text", [1, 2, 3], "aime", "0", {})


def test_eval_4xx_is_sent_once_and_names_the_servers_message_url_and_problem(endpoint):
    endpoint.script.append((400, OPENAI_400))
    with pytest.raises(EndpointError) as err:
        generator(endpoint.url)([PROBLEM], 2)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("HTTP 400 Bad Request: The input (300 tokens) is longer than the model's context")
    assert f"(POST {endpoint.url}/v1/completions, problem p7)" in line
    assert "not retried" in line
    assert len(endpoint.posts) == 1
    assert endpoint.posts[0]["prompt"] == [1, 2, 3]  # the token ids, not the text


def test_eval_5xx_and_dropped_connections_are_retried(endpoint):
    endpoint.script.extend([(503, {"error": {"message": "overloaded"}}), (500, "Internal Server Error")])
    out = generator(endpoint.url)([PROBLEM], 2)
    assert len(out[0]) == 2 and len(endpoint.posts) == 3
    endpoint.script.extend([(500, {"detail": "scheduler died"})] * 3)
    with pytest.raises(EndpointError) as err:
        generator(endpoint.url)([PROBLEM], 2)
    line = str(err.value)
    assert line.startswith(
        "problem p7 failed after 3 tries; last: HTTP 500 Internal Server Error: scheduler died"
    )
    assert f"(POST {endpoint.url}/v1/completions, problem p7)" in line
    assert len(endpoint.posts) == 6


def test_eval_connection_refused_is_retried_and_named(endpoint):
    url = endpoint.url
    endpoint.close()
    with pytest.raises(
        EndpointError, match=rf"problem p7 failed after 2 tries; last: ConnectError.*POST {url}"
    ):
        generator(url, max_retries=1)([PROBLEM], 1)


def test_response_tokens_usage_for_one_choice_else_the_tokenizer_count_and_the_stop_token(endpoint):
    one = generator(endpoint.url)([PROBLEM], 1)[0]
    assert [c.num_tokens for c in one] == [7]  # the server's usage: one choice
    two = generator(endpoint.url)([PROBLEM], 2)[0]
    # usage (14) is the sum of both: each text is counted (len("ab") = 2), +1 for the trimmed stop token
    assert [(c.num_tokens, c.truncated) for c in two] == [(2, True), (3, False)]


@pytest.mark.parametrize(
    "body, message",
    [
        (OPENAI_400, OPENAI_400["message"]),
        (NATIVE_400, NATIVE_400["error"]["message"]),
        ({"error": "no such model"}, "no such model"),
        ({"detail": [{"loc": ["body", "n"], "msg": "must be >= 1"}]}, "body.n: must be >= 1"),
        ("line one\n  line two", "line one line two"),
        ("", ""),
    ],
)
def test_server_message_shapes(body, message):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.Response(400, text=content, request=httpx.Request("POST", "http://h:1/generate"))
    assert server_message(r) == message
    line = http_error(r, "request r1")
    assert line == f"HTTP 400 Bad Request: {message or '(empty body)'} (POST http://h:1/generate, request r1)"


# -- the SGLang rollout client ------------------------------------------------------------------


def sglang_reply(body):
    return {
        "text": "",
        "meta_info": {
            "id": body["rid"],
            "finish_reason": {"type": "stop", "matched": 2},
            "output_token_logprobs": [[-0.5, 2, None]],
        },
    }


@pytest.fixture
def sglang():
    s = Scripted(sglang_reply)
    yield s
    s.close()


@pytest.fixture
def engine(sglang):
    e = SGLangEngine(sglang.url, name="engine-0", max_retries=2, backoff_s=0.01)
    yield e
    e.close()


def test_sglang_4xx_is_sent_once_and_names_the_servers_message_url_and_request(sglang, engine):
    sglang.script.append((400, NATIVE_400))
    req = GenerationRequest("rq5", [1] * 300, SamplingParams(max_new_tokens=4))
    with pytest.raises(SGLangError) as err:
        engine.generate([req])
    line = str(err.value)
    assert "\n" not in line
    assert line == (
        "sglang engine engine-0: POST /generate -> HTTP 400 Bad Request: The input (300 tokens) is longer "
        f"than the model's context length (256 tokens). (POST {sglang.url}/generate, request rq5)"
    )
    assert len(sglang.posts) == 1


def test_sglang_5xx_is_retried_for_idempotent_calls_and_names_the_message(sglang, engine):
    sglang.script.extend([(503, {"error": {"message": "busy"}})] * 3)
    with pytest.raises(SGLangError) as err:
        engine.run(engine.client.call("POST", "/abort_request", {"abort_all": True}, expect_json=False))
    line = str(err.value)
    assert line.startswith("sglang engine engine-0: POST /abort_request failed after 3 attempts; last: ")
    assert line.endswith(f"HTTP 503 Service Unavailable: busy (POST {sglang.url}/abort_request)")
    assert len(sglang.posts) == 3
