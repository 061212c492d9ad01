"""A loopback HTTP server standing in for the servers `megatron-dapo eval` talks to: a policy's
OpenAI-compatible ``/v1/completions`` and a judge's ``/v1/chat/completions``, each answered by a
function of the request, so that a test knows every response and verdict by hand however the
requests interleave.

``StandIn(routes)``: ``routes`` maps a POST path to ``fn(body) -> (status, payload[, headers])`` or
``"drop"`` (the connection is closed without an answer, as a server that died mid-request); a
payload given as a string is sent as is (not JSON). ``other(path, body)``, when given, answers
the POST paths ``routes`` lacks (else 404). ``GET /v1/models`` lists one model (``model_id``, with
``max_model_len`` when given: its context, as SGLang and vLLM report it).
Daemon threads: a test (or a forked CLI run) just uses ``.url``; ``close()`` stops it.
``requests`` records every (path, body); ``in_flight`` and ``peak`` count the POSTs being answered
now and the most at once.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Route = Callable[[dict], "tuple[int, dict | str] | str"]


class StandIn:
    def __init__(
        self,
        routes: dict[str, Route],
        other: Callable[[str, dict], tuple[int, dict | str] | str] | None = None,
        model_id: str = "standin",
        max_model_len: int | None = None,
        port: int = 0,
    ):
        self.routes = routes
        self.other = other
        self.requests: list[tuple[str, dict]] = []
        self.in_flight = 0
        self.peak = 0
        self._lock = threading.Lock()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                if self.path == "/v1/models":
                    card = (
                        {"id": model_id}
                        if max_model_len is None
                        else {"id": model_id, "max_model_len": max_model_len}
                    )
                    return self._send(200, {"object": "list", "data": [card]})
                self._send(404, {"detail": "Not Found"})

            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else {}
                with stand_in._lock:
                    stand_in.requests.append((self.path, body))
                    stand_in.in_flight += 1
                    stand_in.peak = max(stand_in.peak, stand_in.in_flight)
                try:
                    self._answer(body)
                finally:
                    with stand_in._lock:
                        stand_in.in_flight -= 1

            def _answer(self, body):
                route = stand_in.routes.get(self.path)
                if route is not None:
                    answer = route(body)
                elif stand_in.other is not None:
                    answer = stand_in.other(self.path, body)
                else:
                    return self._send(404, {"detail": "Not Found"})
                if answer == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._send(*answer)

            def _send(self, code, payload, headers=None):
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(code)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda request, address: None  # a client that gave up
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def chat_answer(verdict: str) -> tuple[int, dict]:
    """A 200 ``/v1/chat/completions`` answer carrying ``verdict``."""
    message = {"role": "assistant", "content": verdict}
    return 200, {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


# The parts of the judge's built-in prompt (rewards/served/judge.py DEFAULT_PROMPT_TEMPLATE).
_JUDGE_PROMPT = re.compile(
    r"Question:\n(?P<question>.*?)\n\nReference answer:\n(?P<ground_truth>.*?)\n\nResponse:\n(?P<response>.*?)\n\n"
    r"Is the final answer",
    re.DOTALL,
)


def judge_prompt_parts(body: dict) -> dict[str, str]:
    """``question``, ``ground_truth`` and ``response`` of a chat request in the built-in template."""
    m = _JUDGE_PROMPT.search(body["messages"][-1]["content"])
    if m is None:
        raise AssertionError(f"not the built-in judge prompt: {body['messages'][-1]['content'][:200]!r}")
    return m.groupdict()


def refuse(status: int, message: str) -> Route:
    """A route answering every request with ``status`` and an OpenAI-style error ``message``."""
    return lambda body: (
        status,
        {"object": "error", "message": message, "type": "BadRequestError", "code": status},
    )
