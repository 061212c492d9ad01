"""The multi-turn episode loop (agent/runner.py) against a scripted engine, stand-in tools and a
character bridge, every value written out by hand: turns and their token spans, loss mask and
log-probs of the environment's tokens, budgets, the turn limit, refused and failed calls, aborts
and prefix breaks."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import pytest

from megatron_dapo.agent.runner import AppendOnly, MultiTurn, MultiTurnSettings, turn_seed
from megatron_dapo.rollout.types import EpisodeInfo, GenerationRequest, GenerationResult, SamplingParams

EOT = ord("$")


def toks(text: str) -> list[int]:
    return [ord(c) for c in text]


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


@dataclass
class Call:
    name: str
    arguments: dict
    error: str | None = None


class BracketCalls:
    """A turn's calls are its ``[name:arg]`` pieces."""

    def parse(self, text):
        out, rest = [], text
        while "[" in rest and "]" in rest:
            body, rest = rest.split("[", 1)[1].split("]", 1)
            name, _, arg = body.partition(":")
            out.append(Call(name, {"x": arg}))
        return out


@dataclass
class Answer:
    text: str
    status: str


class Tools:
    """``up`` answers its argument upper-cased; ``fail`` an error; ``slow`` a time-out."""

    workers = 4

    def __init__(self):
        self.calls, self.released = [], []

    def call(self, episode_id, call, *, tools_kwargs=None):
        if call.error:  # as ToolHost answers a malformed call
            return Answer(f"Error: {call.error}", "error")
        self.calls.append((episode_id, call.name, call.arguments["x"]))
        if call.name == "fail":
            return Answer("Error: ValueError: no", "error")
        if call.name == "slow":
            return Answer("Error: tool slow timed out after 1 s", "timeout")
        return Answer(call.arguments["x"].upper(), "ok")

    def release(self, episode_id):
        self.released.append(episode_id)

    def close(self):
        pass


class CharChat:
    """A template whose tool turn renders as ``\\n<answer>\\n`` after the end-of-turn token."""

    end_of_turn_ids = [EOT]

    def env_ids(self, messages, *, ended_with_eot=True):
        body = "".join(f"\n<{m['content']}>\n" for m in messages)
        return ([] if ended_with_eot else [EOT]) + toks(body)

    def truncate(self, text, max_tokens, side):
        return text[:max_tokens]

    def rerender(self, turns):
        """The same template on the whole conversation: a model turn's text, then the "$" the
        template writes after every assistant message (none after an unfinished last one), each
        tool message as ``\n<content>\n``."""
        return [], toks(render_whole(turns, lambda c: f"\n<{c}>\n"))


def render_whole(turns, tool):
    text = ""
    for i, (role, value) in enumerate(turns):
        if role == "assistant":
            body = CharTokenizer().decode(value)
            closed = body.endswith("$")
            text += (body[:-1] if closed else body) + ("$" if closed or i < len(turns) - 1 else "")
        else:
            text += "".join(tool(c) for c in value)
    return text


class Scripted:
    """An engine that answers turn ``k`` of an episode with ``script[k]`` (cut at max_new_tokens,
    "stop" when it ends with a stop token) and records what it was sent."""

    name = "scripted"

    def __init__(self, script, abort_turn=None):
        self.script, self.sent, self.abort_turn = script, [], abort_turn

    def generate(self, requests, on_result=None):
        self.sent.append(requests)
        out = []
        for q in requests:
            turn = int(q.request_id.rsplit("/t", 1)[1])
            text = self.script[q.request_id.split("/")[0]][turn]
            ids = toks(text)[q.sampling.seed_offset :][: q.sampling.max_new_tokens]
            finish = "stop" if ids and ids[-1] in [EOT, *q.sampling.stop_token_ids] else "length"
            if self.abort_turn == turn:
                ids, finish = ids[:2], "abort"
            out.append(GenerationResult(q.request_id, ids, [-0.5] * len(ids), finish, weight_version=7))
        return out


def runner(tools=None, **over):
    settings = MultiTurnSettings(
        **{
            "max_assistant_turns": 3,
            "max_turn_tokens": None,
            "max_tool_response_tokens": 50,
            "tool_response_truncate_side": "right",
            "max_parallel_calls": 2,
            **over,
        }
    )
    return MultiTurn(settings, AppendOnly(CharChat()), tools or Tools(), BracketCalls(), CharTokenizer())


def request(rid="e0", budget=100, prompt="Q?", seed=11, episode=None):
    return GenerationRequest(
        rid, toks(prompt), SamplingParams(max_new_tokens=budget, seed=seed), episode=episode
    )


def test_two_turn_episode_tokens_mask_and_turns():
    engine = Scripted({"e0": ["[up:ab]$", "AB$"]})
    tools = Tools()
    (res,) = runner(tools).run(engine, [request()], threading.Event())
    env = "\n<AB>\n"
    assert res.output_ids == toks("[up:ab]$" + env + "AB$")
    assert res.loss_mask == [1] * 8 + [0] * len(env) + [1] * 3
    assert res.logprobs == [-0.5] * 8 + [0.0] * len(env) + [-0.5] * 3
    assert res.token_versions == [7] * len(res.output_ids) and res.finish_reason == "stop"
    info = res.episode
    assert [(t.role, t.start, t.end, t.calls) for t in info.turns] == [
        ("assistant", 0, 8, 1),
        ("tool", 8, 8 + len(env), 1),
        ("assistant", 8 + len(env), 11 + len(env), 0),
    ]
    assert info.end == "stop" and info.prefix_breaks == 0
    # turn 1's request is the prompt, turn 0's tokens and the tool's, as ids; its own seed
    second = engine.sent[1][0]
    assert second.prompt_ids == toks("Q?[up:ab]$" + env)
    assert engine.sent[0][0].sampling.seed == 11 and second.sampling.seed == turn_seed(11, 1) != 11
    assert second.sampling.max_new_tokens == 100 - 8 - len(env) and EOT in second.sampling.stop_token_ids
    # the earlier turns' prompt lengths, where an HF engine splits the prompt to reuse their keys
    assert engine.sent[0][0].prefix_lengths == () and second.prefix_lengths == (2,)
    assert tools.calls == [("e0", "up", "ab")] and tools.released == ["e0"]


def test_the_first_turns_go_as_one_engine_call_and_every_later_turn_alone():
    engine = Scripted({"a": ["[up:x]$", "X$"], "b": ["done$"], "c": ["[up:y]$", "[up:z]$", "Z$"]})
    results = runner().run(engine, [request("a"), request("b"), request("c")], threading.Event())
    sent = [[q.request_id for q in call] for call in engine.sent]
    assert sent[0] == ["a/t0", "b/t0", "c/t0"]  # a unit's first turns batch as a single-turn call's
    assert sorted(sent[1:]) == [["a/t1"], ["c/t1"], ["c/t2"]]
    assert sent.index(["c/t1"]) < sent.index(["c/t2"])
    assert [r.episode.end for r in results] == ["stop", "stop", "stop"]
    assert results[1].loss_mask == [1] * 5 and len(results[1].episode.turns) == 1


class Held(Tools):
    """``hold`` answers once ``gate`` opens (or after ``wait_s``, saying so); every call's
    start and answer are timed."""

    def __init__(self, wait_s=3.0):
        super().__init__()
        self.gate, self.wait_s, self.times = threading.Event(), wait_s, {}

    def call(self, episode_id, call, *, tools_kwargs=None):
        start = time.monotonic()
        if call.name == "hold":
            opened = self.gate.wait(self.wait_s)
            self.times[episode_id] = (start, time.monotonic())
            return Answer("opened" if opened else "waited", "ok")
        return super().call(episode_id, call, tools_kwargs=tools_kwargs)


class Timed(Scripted):
    """Scripted, and when each turn was sent."""

    def __init__(self, script, **kw):
        super().__init__(script, **kw)
        self.at = {}

    def generate(self, requests, on_result=None):
        for q in requests:
            self.at[q.request_id] = time.monotonic()
        return super().generate(requests, on_result)


def test_an_episode_waiting_on_a_slow_tool_holds_no_other_episode_back():
    """a's tool answers only once b and c have ended (or after 3 s): b and c take all their turns
    (b three, with two tool calls) while a's call runs, and are handed over before a's second turn
    is even sent. A loop that sends a call's turns together waits for a's tool at every turn."""
    engine = Timed({"a": ["[hold:x]$", "X$"], "b": ["[up:y]$", "[up:z]$", "Z$"], "c": ["[up:q]$", "Q$"]})
    tools = Held()
    handed = []

    def on_result(result):
        handed.append((result.request_id, time.monotonic()))
        if {"b", "c"} <= {rid for rid, _ in handed}:
            tools.gate.set()

    results = runner(tools).run(
        engine, [request("a"), request("b"), request("c")], threading.Event(), on_result
    )
    assert [r.episode.end for r in results] == ["stop", "stop", "stop"]
    assert results[0].output_ids == toks("[hold:x]$\n<opened>\nX$")  # the gate opened: no time-out
    held_from, held_to = tools.times["a"]
    assert [rid for rid, _ in handed] in (["b", "c", "a"], ["c", "b", "a"])
    ended = dict(handed)
    # every turn of b and c was sent, and both ended, while a's tool held its answer
    for turn in ("b/t1", "b/t2", "c/t1"):
        assert held_from <= engine.at[turn] <= held_to, turn
    assert max(ended["b"], ended["c"]) <= held_to <= engine.at["a/t1"] <= ended["a"]


def test_each_episode_is_handed_over_when_it_ends_while_the_others_still_run():
    """``on_result`` gets an episode the moment it ends: b (one turn) before any second turn is
    sent, a after its second turn and c after its third; each exactly once, equal to the call's
    result."""
    engine = Scripted({"a": ["[up:x]$", "X$"], "b": ["done$"], "c": ["[up:y]$", "[up:z]$", "Z$"]})
    handed = []

    def on_result(result):
        sent = [q.request_id for call in engine.sent for q in call]
        handed.append((result.request_id, sent))

    results = runner().run(engine, [request("a"), request("b"), request("c")], threading.Event(), on_result)
    assert sorted(rid for rid, _ in handed) == ["a", "b", "c"]
    by_id = dict(handed)
    assert by_id["b"] == ["a/t0", "b/t0", "c/t0"]
    assert "a/t1" in by_id["a"] and "c/t2" in by_id["c"]
    assert [r.request_id for r in results] == ["a", "b", "c"] and all(
        r.finish_reason == "stop" for r in results
    )


def test_an_aborted_episode_is_not_handed_over():
    engine = Scripted({"e0": ["[up:ab]$", "AB$"]}, abort_turn=0)
    handed = []
    (res,) = runner().run(engine, [request()], threading.Event(), handed.append)
    assert res.finish_reason == "abort" and handed == []


def test_the_turn_limit_ends_turns_without_running_the_last_calls():
    engine = Scripted({"e0": ["[up:a]$", "[up:b]$", "[up:c]$"]})
    tools = Tools()
    (res,) = runner(tools, max_assistant_turns=3).run(engine, [request()], threading.Event())
    assert res.finish_reason == "turns" and res.episode.end == "turns"
    assert [t.role for t in res.episode.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert [c[2] for c in tools.calls] == ["a", "b"]  # the third turn's call is not run
    assert res.output_ids[-7:] == toks("[up:c]$") and res.loss_mask[-7:] == [1] * 7


def test_budget_counts_both_kinds_and_a_tool_answer_that_does_not_fit_ends_length():
    env = "\n<AB>\n"  # 6 tokens
    engine = Scripted({"e0": ["[up:ab]$", "AB$"]})
    # 8 sampled + 6 environment + 1 for a reply = 15: a budget of 14 cannot take the answer
    (res,) = runner().run(engine, [request(budget=14)], threading.Event())
    assert res.finish_reason == "length" and res.output_ids == toks("[up:ab]$") and len(engine.sent) == 1
    # the call ran and is counted, its answer not appended: a tool turn of no tokens
    assert [(t.role, t.start, t.end, t.calls) for t in res.episode.turns] == [
        ("assistant", 0, 8, 1),
        ("tool", 8, 8, 1),
    ]
    (res,) = runner().run(engine, [request(budget=15)], threading.Event())
    assert res.finish_reason == "length" and res.output_ids == toks("[up:ab]$" + env + "A")
    assert engine.sent[-1][0].sampling.max_new_tokens == 1
    # the per-turn cap and the context cap
    engine = Scripted({"e0": ["[up:ab]$", "AB$"]})
    runner(max_turn_tokens=5).run(engine, [request()], threading.Event())
    assert engine.sent[0][0].sampling.max_new_tokens == 5
    engine = Scripted({"e0": ["[up:ab]$", "AB$"]})
    runner(max_context=12).run(engine, [request()], threading.Event())
    assert engine.sent[0][0].sampling.max_new_tokens == 10  # 12 - the prompt's 2


def test_refused_failed_and_timed_out_calls_are_answered_and_counted():
    engine = Scripted({"e0": ["[fail:1][slow:2][up:3]$", "ok$"]})
    tools = Tools()
    (res,) = runner(tools, max_parallel_calls=2, max_tool_response_tokens=200).run(
        engine, [request(budget=400)], threading.Event()
    )
    tool_turn = res.episode.turns[1]
    assert (tool_turn.calls, tool_turn.errors, tool_turn.timeouts) == (3, 2, 1)
    text = CharTokenizer().decode(res.output_ids[tool_turn.start : tool_turn.end])
    assert "Error: ValueError: no" in text and "timed out" in text and "at most 2 tool calls per turn" in text
    assert [c[1] for c in tools.calls] == ["fail", "slow"]  # the third call is refused, not run


def test_an_abort_stops_new_turns_but_finishes_the_calls_made():
    # mid-turn: the engine aborted the turn; it comes back unfinished with its tokens so far
    engine = Scripted({"a": ["[up:x]$", "XX$"]}, abort_turn=1)
    tools = Tools()
    (r,) = runner(tools).run(engine, [request("a")], threading.Event())
    assert r.finish_reason == "abort" and r.episode.end is None
    last = r.episode.turns[-1]
    assert last.role == "assistant" and last.finish_reason is None and last.end - last.start == 2
    assert r.output_ids[-2:] == toks("XX")
    assert tools.released == []  # unfinished: its tools' instances live on
    # right after a tool answer: b's call runs on after the call's stop is set (by a's turn 1,
    # as the manager sets it before aborting the engine), its answer is kept, no turn follows
    stop = threading.Event()
    tools = Held()
    tools.gate = stop

    class Stopping(Scripted):
        def generate(self, requests, on_result=None):
            if any(q.request_id == "a/t1" for q in requests):
                stop.set()
            return super().generate(requests, on_result)

    engine = Stopping({"a": ["[up:x]$", "XX$"], "b": ["[hold:y]$", "YY$"]}, abort_turn=1)
    a, b = runner(tools).run(engine, [request("a"), request("b")], stop)
    assert a.finish_reason == b.finish_reason == "abort"
    assert a.output_ids[-2:] == toks("XX") and a.episode.turns[-1].finish_reason is None
    assert [t.role for t in b.episode.turns] == ["assistant", "tool"]
    assert b.output_ids == toks("[hold:y]$\n<opened>\n")
    assert "b/t1" not in [q.request_id for call in engine.sent for q in call]
    # a stop set before the call: nothing runs, every episode comes back unfinished and empty
    engine = Scripted({"a": ["[up:x]$"]})
    stop = threading.Event()
    stop.set()
    (res,) = runner().run(engine, [request("a")], stop)
    assert res.finish_reason == "abort" and res.output_ids == [] and engine.sent == []


def test_a_continued_episode_resumes_mid_turn_and_equals_the_uninterrupted_one():
    from megatron_dapo.rollout.partial import PartialSample, continuation, from_result, join

    script = {"e0": ["[up:ab]$", "ABCD$"]}
    (whole,) = runner().run(Scripted(script), [request()], threading.Event())
    (cut,) = runner().run(Scripted(script, abort_turn=1), [request()], threading.Event())
    carried = from_result(cut, None)
    assert isinstance(carried, PartialSample) and carried.episode["turns"][-1]["finish_reason"] is None
    again = continuation("e0", toks("Q?"), carried, SamplingParams(max_new_tokens=100, seed=11))
    assert again.sampling.seed_offset == 2 and again.episode.key == "e0"
    engine = Scripted(script)
    (rest,) = runner().run(engine, [again], threading.Event())
    assert engine.sent[0][0].request_id == "e0/t1" and engine.sent[0][0].sampling.seed == turn_seed(11, 1)
    # split where the turns' prompts end, the interrupted one's included: a resumed run splits as
    # the uninterrupted run that continues it does
    assert engine.sent[0][0].prefix_lengths == (2, len(toks("Q?[up:ab]$\n<AB>\n")))
    joined = join(carried, rest)
    assert joined.output_ids == whole.output_ids and joined.loss_mask == whole.loss_mask
    assert joined.episode.as_dict() == whole.episode.as_dict()


class ReRender:
    """A bridge that re-renders the conversation from text (what verl's docs warn about): its
    tokens differ from the sampled ones when the text does not round-trip."""

    end_of_turn_ids = [EOT]

    def next_context(self, context, messages, ended_with_eot):
        text = CharTokenizer().decode(context).replace("[up:", "[UP:")
        return toks(text) + toks("".join(f"\n<{m['content']}>\n" for m in messages))

    def truncate(self, text, max_tokens, side):
        return text


def test_a_prefix_break_is_counted_and_never_trained_on():
    settings = MultiTurnSettings(3, None, 50, "right", 2)
    loop = MultiTurn(settings, ReRender(), Tools(), BracketCalls(), CharTokenizer())
    (res,) = loop.run(Scripted({"e0": ["[up:ab]$", "AB$"]}), [request()], threading.Event())
    assert res.episode.prefix_breaks == 1 and res.episode.end == "prefix_break"
    assert res.loss_mask == [0] * len(res.output_ids) and res.output_ids == toks("[up:ab]$")


def test_episode_info_round_trips_as_json():
    import json

    (res,) = runner().run(Scripted({"e0": ["[up:ab]$", "AB$"]}), [request()], threading.Event())
    back = EpisodeInfo.from_dict(json.loads(json.dumps(res.episode.as_dict())))
    assert back == res.episode
    # as_dict is written out by hand (asdict's deep copy was slow): it must miss no field, every
    # field of the dataclasses set to something other than its default
    from dataclasses import asdict, replace

    full = replace(res.episode, prefix_breaks=1, rerender_mismatches=1, digest="d", key="k", end="stop")
    full.turns[0] = replace(
        full.turns[0], finish_reason="stop", calls=2, errors=1, timeouts=1, contents=["x"]
    )
    assert full.as_dict() == asdict(full)


@pytest.mark.parametrize("seed", [None, 0, 5])
def test_turn_seed(seed):
    assert turn_seed(seed, 0) == seed
    if seed is not None:
        assert len({turn_seed(seed, k) for k in range(50)}) == 50


def test_hermes_turns_calls_while_thinking_are_not_run_and_a_malformed_call_is_counted():
    from megatron_dapo.agent.calls import HermesFormat

    turn = (
        '<think>maybe <tool_call>{"name": "up", "arguments": {"x": "no"}}</tool_call></think>\n'
        '<tool_call>{"name": "up", "arguments": {"x": "yes"}}</tool_call>\n'
        '<tool_call>{"name": "up", "arguments": {"x": </tool_call>$'
    )
    for in_think, ran in ((False, ["yes"]), (True, ["no", "yes"])):
        tools = Tools()
        settings = MultiTurnSettings(3, None, 500, "right", 3, calls_in_think=in_think)
        loop = MultiTurn(settings, AppendOnly(CharChat()), tools, HermesFormat(), CharTokenizer())
        (res,) = loop.run(Scripted({"e0": [turn, "ok$"]}), [request(budget=1000)], threading.Event())
        assert [c[2] for c in tools.calls] == ran
        tool = res.episode.turns[1]
        assert (tool.calls, tool.errors) == (len(ran) + 1, 1) and res.episode.end == "stop"
        assert "not valid JSON" in CharTokenizer().decode(res.output_ids[tool.start : tool.end])


# -- the token check: (a) requests against the episode's ids, (b) the template's whole rendering --


class EnvRewrite(CharChat):
    """The environment's tokens as a faulty bridge renders them (``render``), beside the
    template's own rendering of the whole conversation (CharChat's ``rerender``)."""

    def __init__(self, render):
        self.render = render

    def env_ids(self, messages, *, ended_with_eot=True):
        return ([] if ended_with_eot else [EOT]) + toks("".join(self.render(m["content"]) for m in messages))


def _checked(bridge, mode):
    settings = MultiTurnSettings(3, None, 50, "right", 2, tokenization_sanity_check_mode=mode)
    loop = MultiTurn(settings, AppendOnly(bridge), Tools(), BracketCalls(), CharTokenizer())
    (res,) = loop.run(Scripted({"e0": ["[up:ab]$", "AB$"]}), [request()], threading.Event())
    return res


@pytest.mark.parametrize(
    ("render", "mode", "broken"),
    [
        (lambda c: f"\n<{c}>\n", "strict", False),  # the template's own rendering
        (lambda c: f"\n[{c}]\n", "strict", True),  # one token rewritten on each side of the answer
        (lambda c: f"\n[{c}]\n", "ignore_strippable", True),
        (lambda c: f"\n[{c}]\n", "disable", False),
        (lambda c: f"\n<{c}>\n\n", "strict", True),  # whitespace only
        (lambda c: f"\n<{c}>\n\n", "ignore_strippable", False),
    ],
)
def test_the_rerender_check_masks_an_episode_the_template_would_render_otherwise(render, mode, broken):
    res = _checked(EnvRewrite(render), mode)
    assert res.episode.end == "stop" and res.finish_reason == "stop"
    assert res.episode.rerender_mismatches == int(broken) and res.episode.broken == broken
    assert res.episode.prefix_breaks == 0
    sampled = [1] * 8 + [0] * (len(res.output_ids) - 11) + [1] * 3
    assert res.loss_mask == ([0] * len(res.output_ids) if broken else sampled)


def test_a_turn_stopped_on_another_stop_token_gets_the_end_of_turn_token_before_the_answer():
    """The model's turn ends on ``#`` (a stop token, not the end-of-turn ``$``): the template
    writes ``$`` after the assistant message, so the environment's tokens start with it. A runner
    that took the turn as ended by ``$`` (``ended_with_eot=True``) gives an episode the template
    renders otherwise: the rerender check masks it."""
    engine = Scripted({"e0": ["[up:ab]#", "AB$"]})
    req = request()
    req.sampling.stop_token_ids = [ord("#")]
    (res,) = runner().run(engine, [req], threading.Event())
    env = "$\n<AB>\n"
    assert res.output_ids == toks("[up:ab]#" + env + "AB$")
    assert res.episode.rerender_mismatches == 0 and res.loss_mask == [1] * 8 + [0] * len(env) + [1] * 3


def test_a_continuation_whose_carried_tokens_changed_is_broken_and_masked_whole():
    """Check (a) on a continuation after an abort: its request must end with the response the
    episode had when it stopped. A carried token rewritten on the way (here by hand) breaks the
    episode at once: nothing is generated, every token is masked, the carried ones included, and
    the episode is scored by no one."""
    from megatron_dapo.rollout.partial import continuation, from_result, join
    from megatron_dapo.rollout.scoring import BROKEN_EPISODE

    script = {"e0": ["[up:ab]$", "ABCD$"]}
    (cut,) = runner().run(Scripted(script, abort_turn=1), [request()], threading.Event())
    carried = from_result(cut, None)
    assert cut.episode.digest is not None
    sampling = SamplingParams(max_new_tokens=100, seed=11)
    # untouched, the continuation goes on
    (rest,) = runner().run(
        Scripted(script), [continuation("e0", toks("Q?"), carried, sampling)], threading.Event()
    )
    assert not rest.episode.broken and join(carried, rest).loss_mask.count(1) == 8 + 5
    carried.output_ids[3] = ord("U")  # "[up:" -> "[uU:"
    engine = Scripted(script)
    (rest,) = runner().run(engine, [continuation("e0", toks("Q?"), carried, sampling)], threading.Event())
    assert engine.sent == [] and rest.episode.prefix_breaks == 1 and rest.episode.end == "prefix_break"
    joined = join(carried, rest)
    assert joined.output_ids == carried.output_ids and joined.loss_mask == [0] * len(carried.output_ids)
    assert _scored(joined).unscored == BROKEN_EPISODE


def _scored(result):
    from types import SimpleNamespace

    from megatron_dapo.data.types import PromptSample
    from megatron_dapo.rollout.scoring import GroupScoring
    from megatron_dapo.rollout.units import Group, Unit

    prompt = PromptSample(0, "none", [], "p0", toks("Q?"), "1", {})
    unit = Unit([Group(0, prompt)], [GenerationRequest(result.request_id, toks("Q?"), SamplingParams())])
    scoring = GroupScoring(SimpleNamespace(n=1), scorer=None, tokenizer=CharTokenizer())
    return scoring.reward(unit, result.request_id, result, [])


def test_a_difference_in_tokens_of_the_same_text_names_their_ids():
    """A sampled token the text does not re-encode to (a reserved token the model wrote) reads
    the same on both sides: the difference the log shows carries the ids, and whitespace-only
    tolerance does not excuse it."""
    from megatron_dapo.agent.runner import _differences

    text = {1: "a", 2: "<|r|>", 3: "<|", 4: "r|>", 5: "b"}

    def decode(ids):
        return "".join(text[i] for i in ids)

    (diff,) = _differences([1, 2, 5], [1, 3, 4, 5], decode)
    assert diff == ("<|r|> (ids [2])", "<|r|> (ids [3, 4])")
    assert "".join(diff[0].split()) != "".join(diff[1].split())


class Submitted(Scripted):
    """Scripted, and it takes one-request calls by ``submit_turn`` (`SubmitsTurns`): their futures are
    answered only when the test says."""

    def __init__(self, script):
        super().__init__(script)
        self.held: list[tuple[GenerationRequest, Future]] = []
        self.queued = threading.Semaphore(0)

    def submit_turn(self, request):
        fut = Future()
        self.held.append((request, fut))
        self.queued.release()
        return fut

    def answer_held(self):
        held, self.held = self.held, []
        for q, fut in held:
            fut.set_result(self.generate([q])[0])


def test_later_turns_submitted_to_an_engine_that_takes_them_hold_no_thread_each():
    """64 episodes' second turns wait on the engine at once: with an engine that takes a turn by
    ``submit`` no thread is started for them (a thread per waiting turn is what cost the
    calculator demo's driver a fifth more CPU than the lockstep loop, in thread switches), and the
    episodes end as with ``generate``."""
    script = {f"e{i}": ["[up:ab]$", "AB$"] for i in range(64)}
    engine = Submitted(script)
    before = threading.active_count()
    out = {}
    run = threading.Thread(
        target=lambda: out.setdefault(
            "r", runner().run(engine, [request(f"e{i}") for i in range(64)], threading.Event())
        )
    )
    run.start()
    for _ in range(64):
        assert engine.queued.acquire(timeout=60)
    assert threading.active_count() - before <= 8  # the run thread and the tool pool's, not one a turn
    engine.answer_held()
    run.join(timeout=60)
    assert [r.output_ids for r in out["r"]] == [toks("[up:ab]$\n<AB>\nAB$")] * 64
    assert all(r.episode.end == "stop" for r in out["r"])
