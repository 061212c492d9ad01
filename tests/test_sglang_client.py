"""SGLang client: payloads against SGLang's own request definitions (contract fixtures read from its
source), retry and error handling against a local HTTP server that fails on purpose, abort."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import defaultdict, deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from megatron_dapo.rollout.types import GenerationRequest, SamplingParams
from megatron_dapo.sglang.client import (
    SGLangEngine,
    SGLangError,
    parse_generate_reply,
    payload_generate,
)
from megatron_dapo.sglang.ipc import serialize_bucket_for_ipc

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
IO = json.loads((FIXTURES / "io_struct.json").read_text())
ROUTES = json.loads((FIXTURES / "http_routes.json").read_text())


class FakeSGLang:
    """127.0.0.1 stand-in for an SGLang server; ``script[path]`` queues misbehaviours for that path."""

    def __init__(self):
        self.log: list[tuple[str, str, dict | None, dict]] = []
        self.script: dict[str, deque] = defaultdict(deque)
        self.aborted = threading.Event()
        self.block_rids: set[str] = set()  # /generate requests with these ids block until an abort
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                path = self.path.split("?")[0]
                fake.log.append((self.command, path, body, dict(self.headers)))
                action = fake.script[path].popleft() if fake.script[path] else ("default",)
                if path == "/generate" and body["rid"] in fake.block_rids:
                    action = ("block_until_abort",)
                if action[0] == "drop":  # close the socket without an answer
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action[0] == "sleep":
                    time.sleep(action[1])
                if action[0] == "status":
                    return self._send(action[1], action[2])
                if action[0] == "badjson":
                    return self._send(200, "{not json", raw=True)
                if action[0] == "block_until_abort":
                    fake.aborted.wait(10)
                    return self._send(200, fake.reply(body, aborted=True))
                self._send(200, fake.default(path, body))

            def _send(self, code, payload, raw=False):
                data = payload.encode() if raw or isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @staticmethod
    def reply(body, aborted=False):
        first = body["input_ids"][-1] + 1
        items = [[-0.5, first, None]] if aborted else [[-0.5, first, None], [-1.25, 2, None]]
        reason = {"type": "abort", "message": "aborted"} if aborted else {"type": "stop", "matched": 2}
        return {
            "text": "",
            "meta_info": {
                "id": body["rid"],
                "finish_reason": reason,
                "weight_version": "4",
                "output_token_logprobs": items,
            },
        }

    def default(self, path, body):
        if path == "/generate":
            return self.reply(body)
        if path == "/abort_request":
            self.aborted.set()
            return ""
        if path.startswith(("/update_weights", "/init_weights", "/begin_weight", "/end_weight")):
            return {"success": True, "message": "ok"}
        if path == "/get_server_info":
            return {"version": "fake", "tp_size": 1}
        return {"status": "ok"}

    def paths(self):
        return [p for _, p, _, _ in self.log]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeSGLang()
    yield s
    s.close()


@pytest.fixture
def engine_factory():
    made = []

    def make(url, **kw):
        kw.setdefault("backoff_s", 0.01)
        e = SGLangEngine(url, name="sg-test", **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def req(i=0, **sampling):
    return GenerationRequest(f"rq{i}", [3, 4, 5 + i], SamplingParams(seed=11, **sampling))


def check_against_contract(method: str, path: str, body):
    route = ROUTES["routes"].get(path)
    assert route is not None, f"{path} is not an SGLang route"
    assert method in route["methods"], f"{method} {path} not allowed ({route['methods']})"
    if route["body"] is None or body is None:
        return
    spec = IO["requests"][route["body"]]
    extra = set(body) - set(spec["fields"])
    assert not extra, f"{path}: fields {extra} are not in {route['body']}"
    assert set(spec["required"]) <= set(body), f"{path}: lacks required {set(spec['required']) - set(body)}"
    if "one_of_required" in spec:
        assert sum(k in body for k in spec["one_of_required"]) == 1
    for key, allowed in spec.get("enums", {}).items():
        values = body.get(key)
        values = values if isinstance(values, list) else [values] if values is not None else []
        assert set(values) <= set(allowed), f"{path}: {key}={values} not in {allowed}"
    if path == "/generate":
        extra = set(body["sampling_params"]) - set(IO["sampling_params"]["fields"])
        assert not extra, f"sampling_params fields {extra} are not SGLang SamplingParams fields"


def test_every_payload_the_client_sends_matches_sglang(server, engine_factory):
    e = engine_factory(server.url, api_key="sekret")
    c = e.client
    server.script["/get_server_info"].append(_info("0.5.23"))  # 0.5.21+: updates in a session
    assert e.run(c.on_connect()) == (0, 5, 23)
    e.generate([req(0, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[2]), req(1)])
    e.abort()
    e.run(c.flush_cache())
    e.run(c.pause_generation("retract"))
    e.run(c.continue_generation())
    e.load_from_disk("/ckpt/step_3", 3)
    e.run(
        c.init_weights_update_group(
            master_address="10.0.0.1", master_port=29555, rank_offset=1, world_size=3, group_name="dapo_sync"
        )
    )
    bucket = {"model.norm.weight": torch.ones(4, dtype=torch.bfloat16), "lm_head.weight": torch.zeros(8, 4)}
    e.run(c.update_weights_from_distributed(bucket, 3, "dapo_sync"))
    e.run(c.update_weights_from_tensor(serialize_bucket_for_ipc(bucket, 2), 3))
    e.run(c.continue_generation())
    e.release_memory(["kv_cache", "weights"])
    e.resume_memory(["weights"])
    e.resume_memory()
    assert e.run(c.get_server_info())["version"] == "fake"
    assert e.health()
    sent = {p for _, p, _, _ in server.log}
    assert {
        "/generate",
        "/abort_request",
        "/flush_cache",
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/get_server_info",
        "/health",
        "/begin_weight_update",
        "/end_weight_update",
    } <= sent
    for method, path, body, headers in server.log:
        check_against_contract(method, path, body)
        assert headers.get("Authorization") == "Bearer sekret"
    by_path = {p: b for _, p, b, _ in server.log}
    assert by_path["/update_weights_from_distributed"]["dtypes"] == ["bfloat16", "float32"]
    assert by_path["/update_weights_from_distributed"]["shapes"] == [[4], [8, 4]]
    assert by_path["/update_weights_from_distributed"]["weight_version"] == "3"
    assert len(by_path["/update_weights_from_tensor"]["serialized_named_tensors"]) == 2  # one per TP rank
    assert by_path["/init_weights_update_group"]["rank_offset"] == 1


def test_generate_payload_and_reply_parsing():
    p = payload_generate(req(0, temperature=0.5, max_new_tokens=9))
    assert p["input_ids"] == [3, 4, 5] and p["return_logprob"] is True and p["rid"] == "rq0"
    assert p["sampling_params"]["sampling_seed"] == 11 and p["sampling_params"]["max_new_tokens"] == 9
    example = ROUTES["generate_reply_example"]["reply"]
    res = parse_generate_reply(example, req(), "sg")
    assert res.output_ids == [11, 2] and res.logprobs == [-0.5, -1.25]
    assert res.finish_reason == "stop" and res.weight_version == 4
    length = {
        "meta_info": {
            "finish_reason": {"type": "length", "length": 1},
            "output_token_logprobs": [[-1.0, 7, None]],
        }
    }
    assert parse_generate_reply(length, req(), "sg").finish_reason == "length"
    with pytest.raises(SGLangError, match=r"sg: /generate reply for rq0 lacks"):
        parse_generate_reply({"text": "hi"}, req(), "sg")


def test_5xx_and_dropped_connections_are_retried_for_idempotent_calls(server, engine_factory):
    e = engine_factory(server.url, max_retries=3)
    server.script["/abort_request"].extend([("status", 500, "boom"), ("drop",), ("status", 503, "busy")])
    e.run(e.client.call("POST", "/abort_request", {"abort_all": True}, expect_json=False))
    assert server.paths().count("/abort_request") == 4


@pytest.mark.parametrize(
    "path, call",
    [
        ("/generate", lambda e: e.generate([req()])),
        (
            "/init_weights_update_group",
            lambda e: e.run(
                e.client.init_weights_update_group(
                    master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2, group_name="g"
                )
            ),
        ),
        (
            "/update_weights_from_distributed",
            lambda e: e.run(e.client.update_weights_from_distributed({"w": torch.zeros(2)}, 1, "g")),
        ),
        ("/update_weights_from_tensor", lambda e: e.run(e.client.update_weights_from_tensor(["x"], 1))),
    ],
)
@pytest.mark.parametrize("failure", [("status", 500, "boom"), ("drop",)])
def test_non_idempotent_calls_are_sent_once(server, engine_factory, path, call, failure):
    # a second metadata POST would leave the server waiting in a broadcast that never comes;
    # a second /generate with the same rid is a duplicate request
    e = engine_factory(server.url, max_retries=3)
    server.script[path].extend([failure, failure])
    with pytest.raises(
        SGLangError, match=rf"sg-test: POST {path} failed after 1 attempts; last: .*not retried"
    ):
        call(e)
    assert server.paths().count(path) == 1


def test_persistent_500_names_engine_and_endpoint(server, engine_factory):
    e = engine_factory(server.url, max_retries=2)
    server.script["/flush_cache"].extend([("status", 500, "scheduler died")] * 5)
    with pytest.raises(
        SGLangError, match=r"sg-test: POST /flush_cache failed after 3 attempts; last: HTTP 500"
    ):
        e.run(e.client.flush_cache())


def test_malformed_json_and_4xx_fail_at_once(server, engine_factory):
    e = engine_factory(server.url, max_retries=3)
    server.script["/generate"].append(("badjson",))
    with pytest.raises(SGLangError, match=r"sg-test: POST /generate answered malformed JSON"):
        e.generate([req()])
    server.script["/update_weights_from_disk"].append(
        ("status", 400, {"success": False, "message": "no such path"})
    )
    with pytest.raises(
        SGLangError, match=r"sg-test: POST /update_weights_from_disk -> HTTP 400.*no such path"
    ):
        e.load_from_disk("/nope", 1)
    assert server.paths().count("/generate") == 1 and server.paths().count("/update_weights_from_disk") == 1
    server.script["/update_weights_from_tensor"].append(
        ("status", 200, {"success": False, "message": "shape"})
    )
    with pytest.raises(SGLangError, match=r"update_weights_from_tensor did not succeed.*shape"):
        e.run(e.client.update_weights_from_tensor(["x"], 1))


def test_generate_read_timeout_is_not_retried(server, engine_factory):
    e = engine_factory(server.url, timeout_s=0.3, max_retries=3)
    server.script["/generate"].append(("sleep", 1.0))
    with pytest.raises(SGLangError, match=r"sg-test: POST /generate timed out reading"):
        e.generate([req()])
    assert server.paths().count("/generate") == 1


def test_unreachable_server_is_unhealthy_and_errors(engine_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = engine_factory(f"http://127.0.0.1:{port}", max_retries=1, connect_timeout_s=0.5)
    assert e.health() is False
    with pytest.raises(SGLangError, match=r"failed after 2 attempts; last: ConnectError"):
        e.generate([req()])


def test_abort_returns_open_requests_as_aborted(server, engine_factory):
    e = engine_factory(server.url)
    server.script["/generate"].extend([("block_until_abort",)] * 2)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", e.generate([req(0), req(1)])))
    t.start()
    deadline = time.monotonic() + 5
    while e.client.in_flight < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    e.abort()
    t.join(timeout=10)
    assert [r.finish_reason for r in out["r"]] == ["abort", "abort"]
    assert [r.output_ids for r in out["r"]] == [[6], [7]]  # the partial tokens come back
    assert e.client.in_flight == 0 and "/abort_request" in server.paths()
    body = next(b for _, p, b, _ in server.log if p == "/abort_request")
    assert body == {"abort_all": True}


def test_each_reply_is_handed_over_as_it_arrives_and_an_aborted_one_is_not(server, engine_factory):
    """rq0's reply reaches ``on_result`` while rq1 still blocks the call; rq1, aborted, is returned
    but never handed over."""
    e = engine_factory(server.url)
    server.block_rids = {"rq1"}
    handed, out = [], {}
    t = threading.Thread(
        target=lambda: out.setdefault("r", e.generate([req(0), req(1)], on_result=handed.append))
    )
    t.start()
    deadline = time.monotonic() + 5
    while not handed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.request_id for r in handed] == ["rq0"] and t.is_alive()  # the call is still open
    e.abort()
    t.join(timeout=10)
    assert [r.finish_reason for r in out["r"]] == ["stop", "abort"]
    assert handed == [out["r"][0]] and handed[0] is out["r"][0]


def test_ipc_payload_round_trips_through_forking_pickler():
    import base64
    from multiprocessing.reduction import ForkingPickler

    bucket = {"a.weight": torch.arange(6.0).reshape(2, 3), "b.bias": torch.ones(2, dtype=torch.bfloat16)}
    payloads = serialize_bucket_for_ipc(bucket, tp_size=2)
    assert len(payloads) == 2 and payloads[0] == payloads[1]
    named = ForkingPickler.loads(base64.b64decode(payloads[0]))
    assert [n for n, _ in named] == ["a.weight", "b.bias"]
    for (_, t), ref in zip(named, bucket.values()):
        assert t.dtype == ref.dtype and torch.equal(t, ref)


def test_flush_cache_retries_its_400_until_requests_drain(server, engine_factory):
    e = engine_factory(server.url, max_retries=0)
    busy = ("status", 400, "Flush cache failed: requests still running\n")
    server.script["/flush_cache"].extend([busy] * 3)
    e.run(e.client.flush_cache())
    assert server.paths().count("/flush_cache") == 4


def test_flush_cache_gives_up_after_its_named_timeout(server, engine_factory):
    e = engine_factory(server.url, max_retries=0, flush_timeout_s=0.5)
    server.script["/flush_cache"].extend([("status", 400, "busy")] * 1000)
    with pytest.raises(
        SGLangError, match=r"sg-test: /flush_cache still refused after 0.5s \(flush_timeout_s"
    ):
        e.run(e.client.flush_cache())


def test_release_memory_flushes_first(server, engine_factory):
    e = engine_factory(server.url)
    server.script["/flush_cache"].append(("status", 400, "busy"))
    e.release_memory()
    assert server.paths() == ["/flush_cache", "/flush_cache", "/release_memory_occupation"]


def test_request_aborted_while_queued_is_an_empty_aborted_result():
    # SGLang answers a request aborted in the waiting queue without output_token_logprobs
    reply = {
        "meta_info": {"id": "rq0", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}
    }
    res = parse_generate_reply(reply, req(), "sg")
    assert (res.output_ids, res.logprobs, res.finish_reason) == ([], [], "abort")


def _info(version):
    return ("status", 200, {"version": version, "tp_size": 1})


def test_tensor_and_distributed_updates_are_wrapped_in_a_weight_update_session(server, engine_factory):
    e = engine_factory(server.url)
    server.script["/get_server_info"].append(_info("0.5.23"))
    e.run(e.client.update_weights_from_tensor(["x"], 1))
    e.run(e.client.update_weights_from_distributed({"w": torch.zeros(2)}, 1, "g"))
    e.run(e.client.continue_generation())
    assert server.paths() == [
        "/get_server_info",
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/end_weight_update",
        "/continue_generation",
    ]
    bodies = {p: b for _, p, b, _ in server.log}
    # the sync flushes once itself; buckets do not flush again
    assert bodies["/update_weights_from_tensor"]["flush_cache"] is False
    assert bodies["/update_weights_from_distributed"]["flush_cache"] is False


def test_older_servers_get_no_weight_update_session(server, engine_factory):
    e = engine_factory(server.url)
    server.script["/get_server_info"].append(_info("0.5.10.post1"))
    e.run(e.client.update_weights_from_tensor(["x"], 1))
    e.run(e.client.continue_generation())
    assert "/begin_weight_update" not in server.paths() and "/end_weight_update" not in server.paths()


@pytest.mark.parametrize("version", ["0.4.6.post5", "0.6.1", None])
def test_connect_refuses_unsupported_sglang(server, engine_factory, version):
    e = engine_factory(server.url)
    server.script["/get_server_info"].append(_info(version))
    with pytest.raises(
        SGLangError, match=r"sg-test: SGLang .* is not supported; this release needs sglang>=0.5.21,<0.6"
    ):
        e.run(e.client.on_connect())


def test_connect_resumes_a_server_a_crashed_trainer_left_paused(server, engine_factory):
    e = engine_factory(server.url)
    server.script["/get_server_info"].append(_info("0.5.23"))
    assert e.run(e.client.on_connect()) == (0, 5, 23)
    assert server.paths() == ["/get_server_info", "/continue_generation"]


def test_health_waits_for_the_generation_it_runs(server, engine_factory):
    # SGLang 0.5.x answers /health after a one-token generation; a busy server takes seconds
    e = engine_factory(server.url)
    server.script["/health"].append(("sleep", 6.0))
    assert e.health() is True


def test_engines_given_by_url_are_version_checked_and_resumed(server):
    from megatron_dapo.sglang.engines import connect_sglang_engines, stop_sglang_engines

    server.script["/get_server_info"].extend([_info("0.5.23")] * 2)
    engines = connect_sglang_engines([server.url], tp_size=1, api_key=None, health_timeout_s=30)
    try:
        assert "/continue_generation" in server.paths()
    finally:
        stop_sglang_engines(engines)
    server.script["/get_server_info"].append(_info("0.4.6.post5"))
    with pytest.raises(
        SGLangError, match=r"SGLang 0.4.6 is not supported; this release needs sglang>=0.5.21"
    ):
        connect_sglang_engines([server.url], tp_size=1, api_key=None, health_timeout_s=30)


def test_generation_resumes_even_when_closing_the_update_session_fails(server, engine_factory):
    e = engine_factory(server.url)
    server.script["/get_server_info"].append(_info("0.5.23"))
    e.run(e.client.update_weights_from_tensor(["x"], 1))
    server.script["/end_weight_update"].append(("status", 400, {"success": False, "message": "no session"}))
    with pytest.raises(SGLangError, match=r"/end_weight_update -> HTTP 400"):
        e.run(e.client.continue_generation())
    assert server.paths()[-2:] == ["/end_weight_update", "/continue_generation"]


def test_rollout_manager_continues_an_aborted_sglang_request(server, engine_factory):
    """rollout.partial over HTTP: the tail request the manager aborts comes back with its first
    token (the shape of SGLang's abort reply); the next rollout sends prompt + that token with
    the budget left, and the sample is the two pieces joined."""
    from rollout_fakes import Dataset, Scorer, Tokenizer, manager_config

    from megatron_dapo.rollout.manager import RolloutManager

    e = engine_factory(server.url)
    cfg = manager_config(
        n=1,
        train_batch_size=1,
        gen_batch_size=2,
        filter_groups_enable=False,
        partial=True,
        max_response_length=8,
    )
    mgr = RolloutManager([e], Scorer(), cfg, Tokenizer())
    server.block_rids = {"v0-g1-s0"}  # prompt 1, the second group drawn
    first = mgr.collect(Dataset([0]), 0)
    assert [s.prompt.index for s in first.samples] == [0]
    assert first.metrics["rollout/partial_groups_carried"] == 1
    second = mgr.collect(Dataset([0]), 1)
    (s,) = [s for s in second.samples if s.prompt.index == 1]
    body = next(b for _, p, b, _ in server.log if p == "/generate" and b["rid"] == "v1-g0-s0")
    assert body["input_ids"] == [0, 7, 1, 2] and body["sampling_params"]["max_new_tokens"] == 7
    assert s.response_ids == [2, 3, 2] and s.rollout_logprobs == [-0.5, -0.5, -1.25]
    assert s.token_versions == [4, 4, 4] and s.interrupted == 1 and s.finish_reason == "stop"
