"""Hostile tools inside episodes: one call of the same turn hangs, one raises, one floods stdout,
one returns 10 MB, beside a well-behaved one. Every episode gets its answer (an error observation
where the tool failed), goes on to its next turn and ends; the turn costs one time-out, not one
per hostile call; nothing is lost and each failure is counted."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from helpers import function_tool_spec
from test_agent_runner import EOT, CharTokenizer, Scripted, render_whole, request, toks

from megatron_dapo.agent.bridge import ChatBridge
from megatron_dapo.agent.calls import ToolCall
from megatron_dapo.agent.from_config import call_format
from megatron_dapo.agent.runner import AppendOnly, MultiTurn, MultiTurnSettings
from megatron_dapo.agent.tools.host import ToolHost
from megatron_dapo.agent.tools.spec import ToolSpec
from megatron_dapo.demo.calculator.calls import FORMAT
from megatron_dapo.demo.tokenizer import build_calculator_tokenizer
from megatron_dapo.rollout.types import GenerationRequest, GenerationResult, SamplingParams

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

    def rerender(self, turns):
        return [], toks(render_whole(turns, lambda c: f"<{c}>"))


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


# -- the calculator demo's tokenizer and settings, with a calculator that misbehaves by its argument --

HOSTILE_CALCULATOR = """
import time


def calculator(expression: str) -> str:
    if expression == "1":
        raise ValueError("the expression is wrong " * 20)
    if expression == "2":
        time.sleep(30)
    return "9" * 5000
"""


class DemoScripted:
    """Turn ``k`` of episode ``e`` answers ``script[e][k]`` in the demo tokenizer's ids."""

    name = "demo-scripted"

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script

    def generate(self, requests, on_result=None):
        out = []
        for q in requests:
            rid, turn = q.request_id.rsplit("/t", 1)
            ids = self.tokenizer.encode(self.script[rid][int(turn)], add_special_tokens=False)
            ids = ids[: q.sampling.max_new_tokens]
            finish = "stop" if ids[-1] in q.sampling.stop_token_ids else "length"
            out.append(GenerationResult(q.request_id, ids, [-0.5] * len(ids), finish, weight_version=0))
        return out


def test_every_call_is_counted_and_a_capped_answer_fits_the_demo_budget(tmp_path):
    """The calculator demo's budgets (40 response tokens, 16 per turn, answers cut to 16 in the
    middle) on its character tokenizer, with a calculator that raises, hangs or floods: each
    answer fits its 16 tokens, marker included, so the episode goes on to its reply; and where
    an answer cannot fit at all, its call is still counted."""
    tool_file = tmp_path / "hostile_calculator.py"
    tool_file.write_text(HOSTILE_CALCULATOR)
    tokenizer = build_calculator_tokenizer()
    bridge = ChatBridge(tokenizer)
    cap = 16
    settings = MultiTurnSettings(
        max_assistant_turns=2,
        max_turn_tokens=16,
        max_tool_response_tokens=cap,
        tool_response_truncate_side="middle",
        max_parallel_calls=1,
    )
    script = {f"e{x}": [f"[{x}]<|end|>", "Answer: 5<|end|>"] for x in (1, 2, 3)}
    engine = DemoScripted(tokenizer, script)
    spec = function_tool_spec("calculator", tool_file, expression="string")
    with ToolHost([spec], timeout_s=1.0, workers=3, memory_mb=1024) as host:
        loop = MultiTurn(settings, AppendOnly(bridge), host, call_format(FORMAT), tokenizer)
        eot = bridge.end_of_turn_ids
        fits = loop.run(
            engine, [_demo_request(tokenizer, f"e{x}", 40, eot) for x in (1, 2, 3)], threading.Event()
        )
        # 4 call tokens + the tool turn (16 + its two template tokens) + 1 for a reply > 20
        short = loop.run(
            engine, [_demo_request(tokenizer, f"e{x}", 20, eot) for x in (1, 2, 3)], threading.Event()
        )
    counts = []
    for r in fits:
        call, tool, reply = r.episode.turns
        assert r.episode.end == "stop" and tool.role == "tool", r.request_id
        env = r.output_ids[tool.start : tool.end]
        assert env[0] == tokenizer.convert_tokens_to_ids("<|tool|>") and env[-1] == 5  # <|assistant|>
        assert len(env) - 2 <= cap, tokenizer.decode(env)  # the answer fits its cap, marker included
        assert tokenizer.decode(r.output_ids[reply.start : reply.end]) == "Answer: 5<|end|>"
        counts.append((tool.calls, tool.errors, tool.timeouts))
    assert counts == [(1, 1, 0), (1, 0, 1), (1, 0, 0)]
    for r, want in zip(short, counts):
        call, tool = r.episode.turns
        assert r.episode.end == "length" and tool.start == tool.end == call.end, r.request_id
        assert (tool.calls, tool.errors, tool.timeouts) == want  # counted though not appended


def _demo_request(tokenizer, rid, budget, stops):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Compute 347 * 48."}], add_generation_prompt=True, tokenize=True
    )
    return GenerationRequest(
        rid, list(prompt), SamplingParams(max_new_tokens=budget, seed=0, stop_token_ids=stops)
    )
