"""Hostile tools inside episodes: one call of the same turn hangs, one raises, one floods stdout,
one returns 10 MB, beside a well-behaved one. Every episode gets its answer (an error observation
where the tool failed), goes on to its next turn and ends; the turn costs one time-out, not one
per hostile call; nothing is lost and each failure is counted."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from helpers import function_tool_spec
from test_agent_runner import EOT, CharTokenizer, Scripted, request, toks

from megatron_dapo.agent.calls import ToolCall
from megatron_dapo.agent.runner import AppendOnly, MultiTurn, MultiTurnSettings
from megatron_dapo.agent.tools.host import ToolHost
from megatron_dapo.agent.tools.spec import ToolSpec

FIX = Path(__file__).parent / "fixtures" / "agent_tools"
TIMEOUT_S = 2.0


def _spec(fn: str, file: str, **params: str) -> ToolSpec:
    return function_tool_spec(fn, FIX / file, **params)


class Named:
    """``[name]`` in a turn calls tool ``name`` with the arguments the test set for it."""

    def __init__(self, arguments):
        self.arguments = arguments

    def parse(self, text):
        names = [piece.split("]", 1)[0] for piece in text.split("[")[1:]]
        return [ToolCall(n, dict(self.arguments[n])) for n in names]


class CharChat:
    end_of_turn_ids = [EOT]

    def env_ids(self, messages, *, ended_with_eot=True):
        return toks("".join(f"<{m['content']}>" for m in messages))

    def truncate(self, text, max_tokens, side):
        return text[:max_tokens]


def test_hostile_tools_cost_one_time_out_and_lose_nothing(tmp_path):
    specs = [
        _spec("sleep_forever", "hostile_tools.py", pid_file="string"),
        _spec("raise_error", "hostile_tools.py", message="string"),
        _spec("print_lots", "hostile_tools.py", mb="integer"),
        _spec("return_lots", "hostile_tools.py", mb="integer"),
        _spec("add", "plain_tools.py", a="integer", b="integer"),
    ]
    arguments = {
        "sleep_forever": {"pid_file": str(tmp_path / "pid")},
        "raise_error": {"message": "no"},
        "print_lots": {"mb": 10},
        "return_lots": {"mb": 10},
        "add": {"a": 2, "b": 3},
    }
    names = list(arguments)
    script = {f"e{i}": [f"[{name}]$", "done$"] for i, name in enumerate(names)}
    settings = MultiTurnSettings(
        max_assistant_turns=3,
        max_turn_tokens=None,
        max_tool_response_tokens=40,
        tool_response_truncate_side="right",
        max_parallel_calls=1,
    )
    with ToolHost(specs, timeout_s=TIMEOUT_S, workers=len(specs), memory_mb=1024) as host:
        host.start()
        loop = MultiTurn(settings, AppendOnly(CharChat()), host, Named(arguments), CharTokenizer())
        t0 = time.perf_counter()
        results = loop.run(
            Scripted(script), [request(f"e{i}", budget=200) for i in range(len(names))], threading.Event()
        )
        elapsed = time.perf_counter() - t0
        # after it all, the host still answers
        assert host.call("x", ToolCall("add", {"a": 1, "b": 1})).text == "2"
    assert elapsed < TIMEOUT_S + 3.0, elapsed  # the calls ran together: one time-out, not four
    answers = {}
    for name, r in zip(names, results):
        assert r.finish_reason == "stop" and r.episode.end == "stop", name  # on to its last turn
        tool = r.episode.turns[1]
        answers[name] = (
            CharTokenizer().decode(r.output_ids[tool.start : tool.end]),
            tool.errors,
            tool.timeouts,
        )
        assert r.output_ids[-5:] == toks("done$")
    assert answers["sleep_forever"][2] == 1 and "timed out" in answers["sleep_forever"][0]
    assert answers["raise_error"][1] == 1 and "ValueError: no" in answers["raise_error"][0]
    assert answers["print_lots"][0] == "<ok>" and answers["print_lots"][1:] == (0, 0)
    assert answers["return_lots"][0] == "<" + "y" * 40 + ">"  # cut to the answer's token cap
    assert answers["add"] == ("<5>", 0, 0)
