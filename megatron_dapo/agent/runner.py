"""The episode loop: one engine call of the rollout manager, run as multi-turn tool-use episodes.

Each request of the call is an episode, and each episode goes on its own: its next model turn is
sent the moment its own tool answers are in, and its tool calls start the moment its turn ends; no
episode waits for another's turns or tools (``_Flight``). The call's first turns go to the engine
together, as one ``generate`` (as a single-turn call sends its unit; the engine hands each turn
over as it finishes), every later turn as a ``generate`` of one request, on the same engine: the
manager sent the unit to the least-loaded engine, and its episodes stay there (its prefix cache
holds them). The engine batches what is in flight: SGLang and the HF engine alike let a request
join the decode at its next step. The tool calls of every episode share the runner's
pool, ``tool_workers`` at a time. A turn's request is the episode's context as token ids: the
prompt, every earlier turn's sampled tokens and every tool answer's tokens, never re-rendered from
text (``TurnBridge``).

The token check, on what does not come from the code that built the ids: (a) each request must be
the episode's ids (what is trained on) and extend the previous request's ids plus the ids the engine
returned for it; a continuation after an abort must end with the response the episode held when it
stopped (``EpisodeInfo.digest``); a break ends the episode (``EpisodeInfo.prefix_breaks``). (b) A
finished episode must equal the chat template's rendering of its whole conversation
(``TurnBridge.rerender``; ``rollout.multi_turn.tokenization_sanity_check_mode``), else
``EpisodeInfo.rerender_mismatches``. A broken episode has its loss mask cleared (``partial.join``
clears the carried part) and leaves its group unscored (``rollout.scoring``).

Budgets: a turn's ``max_new_tokens`` is the least of ``max_turn_tokens``, the response budget left
(the request's ``max_new_tokens``: model and environment tokens together never exceed
``data.max_response_length``) and the context left (the model's ``max_position_embeddings``). A
tool answer is cut to ``max_tool_response_tokens`` tokens, a truncation marker included; one that
does not fit the budget left (with room for one more model token) ends the episode "length" without
it, its calls still counted (a tool turn of no tokens). Calls written inside ``<think>`` do not run
unless ``calls_in_think``.

Seeds: turn ``k`` of an episode samples with ``turn_seed(seed, k)``, so a turn's draws do not depend
on how long the earlier turns were, nor on which other turns share its batch; a turn continued after
an abort skips the draws it already spent (``SamplingParams.seed_offset``), so with the same weights
the HF engine continues exactly as the uninterrupted episode would have. Which turns share an HF
decode step depends on when each episode's tools answered; the engine's responses do not depend
on their batch mates (``HFEngine``), so a seeded run is reproduced bit for bit.

Aborts: once the engine aborted one of the call's turns (the manager's abort: the batch is full, a
weight-sync pause) or the call's ``stop`` is set, no new turn of the call starts; the turns in
flight come back aborted with their tokens so far, and the tool calls already made still run (each
is bounded by its time-out), so an episode stops either mid-turn or right after a tool answer, and
``GenerationRequest.episode`` resumes it from exactly there. An engine call or a tool call that
raises also stops new turns; ``run`` raises it once nothing of the call is in flight.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from megatron_dapo.agent.calls import outside_think
from megatron_dapo.config.knobs import from_config, knob
from megatron_dapo.rollout.engine import EngineError, OnResult, SubmitsTurns
from megatron_dapo.rollout.types import (
    EpisodeInfo,
    EpisodeTurn,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)

logger = logging.getLogger(__name__)
_MAX_LOGGED = 5  # broken episodes whose difference is logged; the metrics count them all
# Threads waiting on the engine for turns, at most (``MultiTurn._turn_threads``): no cap in practice,
# as every turn in flight needs one; a pool makes a thread only when all of its threads are busy.
_TURN_THREADS = 1 << 16


# ---------------------------------------------------------------- what the loop is handed
class ToolCallLike(Protocol):
    name: str
    arguments: dict[str, Any]
    error: str | None


class CallParser(Protocol):
    """``agent/calls.py``'s formats: the tool calls in a model turn's text."""

    def parse(self, text: str) -> list[Any]: ...


class ToolRunner(Protocol):
    """``agent/tools/host.py``'s ToolHost: a call returns within its time-out, whatever the tool."""

    workers: int  # calls it runs at once (rollout.multi_turn.tool_workers): the loop runs as many

    def call(self, episode_id: str, call: Any, *, tools_kwargs: dict | None = None) -> Any: ...

    def release(self, episode_id: str) -> None: ...

    def close(self) -> None: ...


class TurnBridge(Protocol):
    """How the environment's messages join the episode's tokens (``agent/bridge.py``)."""

    end_of_turn_ids: list[int]

    def next_context(
        self, context: list[int], messages: list[dict[str, str]], ended_with_eot: bool
    ) -> list[int]:
        """The next model turn's request ids after ``context`` (the last request's ids and its
        output) and the environment's ``messages``."""
        ...

    def truncate(self, text: str, max_tokens: int, side: str) -> str: ...

    def rerender(self, turns: Sequence[tuple[str, Any]]) -> tuple[list[int], list[int]]:
        """The template's rendering of a whole conversation at once, for the token check:
        ``turns`` are ``("assistant", sampled ids)`` and ``("tool", [message contents])`` from
        the response's start; returns (the ids of a prompt, the ids of that prompt followed by
        the conversation), so that the prompt's ids plus the episode's response are compared
        with the second."""
        ...


class ChatTemplateBridge(Protocol):
    """``agent/bridge.py``'s ChatBridge: the suffix the chat template puts after a model turn."""

    end_of_turn_ids: list[int]

    def env_ids(self, messages: list[dict[str, str]], *, ended_with_eot: bool = True) -> list[int]: ...

    def truncate(self, text: str, max_tokens: int, side: str) -> str: ...

    def rerender(self, turns: Sequence[tuple[str, Any]]) -> tuple[list[int], list[int]]: ...


class AppendOnly:
    """The runner's bridge: the next request is the last one's ids and output, then the tokens the
    chat template renders for the environment's messages after an assistant turn."""

    def __init__(self, chat: ChatTemplateBridge):
        self.chat = chat
        self.end_of_turn_ids = list(chat.end_of_turn_ids)

    def next_context(
        self, context: list[int], messages: list[dict[str, str]], ended_with_eot: bool
    ) -> list[int]:
        return context + self.chat.env_ids(messages, ended_with_eot=ended_with_eot)

    def truncate(self, text: str, max_tokens: int, side: str) -> str:
        return self.chat.truncate(text, max_tokens, side)

    def rerender(self, turns: Sequence[tuple[str, Any]]) -> tuple[list[int], list[int]]:
        return self.chat.rerender(turns)


@dataclass
class MultiTurnSettings:
    max_assistant_turns: int = knob("rollout.multi_turn.max_assistant_turns")
    max_turn_tokens: int | None = knob("rollout.multi_turn.max_turn_tokens")
    max_tool_response_tokens: int = knob("rollout.multi_turn.max_tool_response_tokens")
    tool_response_truncate_side: str = knob("rollout.multi_turn.tool_response_truncate_side")
    max_parallel_calls: int = knob("rollout.multi_turn.max_parallel_calls")
    calls_in_think: bool = knob("rollout.multi_turn.calls_in_think")
    tokenization_sanity_check_mode: str = knob("rollout.multi_turn.tokenization_sanity_check_mode")
    # prompt + response tokens the model takes (its max_position_embeddings); learnt at start-up
    max_context: int = 1 << 30

    @classmethod
    def from_config(cls, cfg: Any, max_context: int) -> MultiTurnSettings:
        return from_config(cls, cfg, max_context=max_context)


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The seed of an episode's model turn ``turn`` (0: the request's own seed)."""
    if seed is None or turn == 0:
        return seed
    return (int(seed) * 1_000_003 + turn) % (2**31 - 1)


@dataclass
class ToolOutcome:
    """One call's answer as the loop needs it (ToolHost's ToolResult, or a refusal made here)."""

    text: str
    status: str  # "ok" | "error" | "timeout"


# ---------------------------------------------------------------- one episode
class _Episode:
    """An episode's state within one engine call: what it holds from before (a continuation), what
    this call added, and the request of its next turn."""

    def __init__(
        self, request: GenerationRequest, settings: MultiTurnSettings, bridge: TurnBridge, decode: Any
    ):
        self.request = request
        self.settings = settings
        self.bridge = bridge
        self.decode = decode
        info = request.episode
        self.info = EpisodeInfo() if info is None else EpisodeInfo.from_dict(info.as_dict())
        if not self.info.key:
            self.info.key = request.request_id  # the tools' instance key, kept across continuations
        self.offset = self.info.length  # response tokens before this call
        self.budget = request.sampling.max_new_tokens  # response tokens left at its start
        self.context = list(request.prompt_ids)
        self.sent: list[int] | None = None  # the last turn request's ids + its output
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int | None] = []
        self.pending: list[Any] = []  # the last turn's tool calls, to run
        self.aborted = False
        self.last: GenerationResult | None = None
        self.last_request: GenerationRequest | None = None
        self.first_request = True
        self.checked = False
        self.difference: str | None = None  # what broke the episode, for the log
        # a continuation: its request must end with the ids the episode had when it was handed over
        carried = self.carried()
        if self.info.digest is not None and (carried is None or _digest(carried) != self.info.digest):
            self._break(
                f"the continuation of {request.request_id} does not end with the {self.offset} response "
                "tokens the episode had when it stopped"
            )

    def carried(self) -> list[int] | None:
        """The response tokens from before this call (the request's ids end with them)."""
        ids = self.request.prompt_ids
        if self.offset > len(ids):
            return None
        return list(ids[len(ids) - self.offset :]) if self.offset else []

    def _break(self, why: str) -> None:
        """The episode's ids and what the engine was sent (or returned) differ: never train on it."""
        self.info.prefix_breaks += 1
        self.info.end = "prefix_break"
        self.pending = []
        self.difference = why

    def _check_request(self) -> bool:
        """The next request is exactly the episode's ids (what is trained on), and extends the
        last request's ids plus the ids the engine returned for it (its reply's, not a copy)."""
        stored = list(self.request.prompt_ids) + self.ids
        if self.context != stored:
            self._break(f"request {self.request.request_id}: the next turn's ids are not the episode's ids")
            return False
        if self.last_request is not None and self.last is not None:
            before = list(self.last_request.prompt_ids) + list(self.last.output_ids)
            if self.context[: len(before)] != before:
                self._break(
                    f"request {self.request.request_id}: the next turn's ids do not extend the last "
                    "request's ids and the engine's reply"
                )
                return False
        return True

    @property
    def live(self) -> bool:
        return self.info.end is None and not self.aborted

    def _turn_index(self) -> int:
        return len(self.info.assistant_turns())

    def next_request(self, extra_stops: list[int]) -> GenerationRequest | None:
        """The request of the next model turn (or of the turn an abort interrupted), None when no
        budget or context is left (the episode then ends "length")."""
        if not self._check_request():
            return None
        s = self.settings
        left = min(self.budget - len(self.ids), s.max_context - len(self.context))
        if s.max_turn_tokens is not None:
            left = min(left, s.max_turn_tokens)
        if left < 1:
            self.info.end = "length"
            return None
        turns = self.info.turns
        resuming = bool(turns) and turns[-1].role == "assistant" and turns[-1].finish_reason is None
        if not resuming:
            start = self.offset + len(self.ids)
            turns.append(EpisodeTurn("assistant", start, start))
        index = self._turn_index() - 1
        base = self.request.sampling
        offset = base.seed_offset if (resuming and self.first_request) else 0
        self.first_request = False
        sampling = SamplingParams(
            **{
                **asdict(base),
                "max_new_tokens": left,
                "seed": turn_seed(base.seed, index),
                "seed_offset": offset,
                "stop_token_ids": list(dict.fromkeys([*base.stop_token_ids, *extra_stops])),
            }
        )
        # the episode's earlier turns' prompts, from its turns (a resumed run's continuation splits
        # its prompt where the uninterrupted one's does): an HF engine reuses their keys and values
        base = len(self.request.prompt_ids) - self.offset
        cuts = sorted({base + t.start for t in self.info.assistant_turns()} - {len(self.context)})
        self.last_request = GenerationRequest(
            f"{self.request.request_id}/t{index}", list(self.context), sampling, prefix_lengths=tuple(cuts)
        )
        return self.last_request

    def take_turn(self, result: GenerationResult, parser: CallParser, decode) -> None:
        """Append the turn's sampled tokens; decide whether the episode ends or calls tools."""
        self.last = result
        turn = self.info.turns[-1]
        out = list(result.output_ids)
        versions = result.token_versions or [result.weight_version] * len(out)
        self.ids += out
        self.mask += [1] * len(out)
        self.logprobs += list(result.logprobs)
        self.versions += list(versions)
        turn.end += len(out)
        self.sent = self.context + out
        self.context = self.sent
        if result.finish_reason == "abort":
            self.aborted = True  # mid-turn: the turn stays unfinished, to be continued
            return
        turn.finish_reason = result.finish_reason
        if result.finish_reason == "length":
            self.info.end = "length"
            return
        n = turn.end - turn.start
        text = decode(self.context[len(self.context) - n :])
        calls = parser.parse(text if self.settings.calls_in_think else outside_think(text))
        turn.calls = len(calls)
        if not calls:
            self.info.end = "stop"
        elif self._turn_index() >= self.settings.max_assistant_turns:
            self.info.end = "turns"
        else:
            self.pending = calls

    def take_answers(self, outcomes: list[ToolOutcome], bridge: TurnBridge, eot: set[int]) -> None:
        """Append the environment's answer to the last turn's calls (loss mask 0). Every call is
        counted in the tool turn whatever becomes of its answer: one that is not appended (it does
        not fit the budget, or the episode broke) leaves a tool turn of no tokens."""
        s = self.settings
        messages = [
            {
                "role": "tool",
                "content": bridge.truncate(o.text, s.max_tool_response_tokens, s.tool_response_truncate_side),
            }
            for o in outcomes
        ]
        self.pending = []
        ended_with_eot = bool(self.sent) and self.sent[-1] in eot
        after = bridge.next_context(list(self.sent), messages, ended_with_eot)
        if after[: len(self.sent)] != self.sent:
            # the environment's rendering rewrote tokens the model already saw
            self._break(
                f"request {self.request.request_id}: the tool answer's rendering rewrote earlier tokens"
            )
            self._tool_turn(outcomes, 0)
            return
        env = after[len(self.sent) :]
        if len(self.ids) + len(env) + 1 > self.budget or len(after) + 1 > s.max_context:
            self.info.end = "length"  # the answer does not fit with room for a reply
            self._tool_turn(outcomes, 0)
            return
        version = self.versions[-1] if self.versions else None
        self._tool_turn(outcomes, len(env), [m["content"] for m in messages])
        self.ids += env
        self.mask += [0] * len(env)
        self.logprobs += [0.0] * len(env)
        self.versions += [version] * len(env)
        self.context = after

    def _tool_turn(self, outcomes: list[ToolOutcome], tokens: int, contents: list[str] | None = None) -> None:
        start = self.offset + len(self.ids)
        self.info.turns.append(
            EpisodeTurn(
                "tool",
                start,
                start + tokens,
                calls=len(outcomes),
                errors=sum(o.status == "error" for o in outcomes),
                timeouts=sum(o.status == "timeout" for o in outcomes),
                contents=contents,
            )
        )

    def check_rerender(self) -> None:
        """The finished episode against the chat template's rendering of its whole conversation
        (its model turns decoded, its tool messages as appended), in
        ``rollout.multi_turn.tokenization_sanity_check_mode``: ``strict``, any difference breaks
        the episode; ``ignore_strippable``, differences in whitespace alone do not; ``disable``,
        no check."""
        self.checked = True
        mode = self.settings.tokenization_sanity_check_mode
        response = self.carried()
        if mode == "disable" or response is None or self.info.broken:
            return
        response += self.ids
        turns: list[tuple[str, Any]] = []
        for t in self.info.turns:
            if t.role == "assistant":
                turns.append(("assistant", response[t.start : t.end]))
            elif t.end > t.start:
                if t.contents is None:  # carried from before the contents were kept: nothing to render
                    return
                turns.append(("tool", list(t.contents)))
        if not turns:
            return
        prompt, oneshot = self.bridge.rerender(turns)
        episode = list(prompt) + response
        if episode == oneshot:
            return
        differences = _differences(episode, oneshot, self.decode)
        if mode == "ignore_strippable":
            # whitespace-only: equal once whitespace is dropped (a BPE token can hold a newline
            # and the text before it, so one side's piece is not always whitespace alone)
            differences = [d for d in differences if "".join(d[0].split()) != "".join(d[1].split())]
        if differences:
            self.info.rerender_mismatches = 1
            ours, theirs = differences[0]
            self.difference = (
                f"request {self.request.request_id}: the episode differs from the chat template's rendering "
                f"of its conversation in {len(differences)} place(s), first {ours!r} where the rendering has "
                f"{theirs!r}"
            )

    def result(self) -> GenerationResult:
        if self.info.end is not None and not self.checked:
            self.check_rerender()
            for t in self.info.turns:
                # only a continuation's check needs the tool messages: a finished episode does not
                # carry them into batches, checkpoints and dumps
                t.contents = None
        carried = self.carried()
        if carried is not None:
            self.info.digest = _digest(carried + self.ids)
        if self.info.end is None:
            finish = "abort"
        elif self.info.end == "prefix_break":
            finish = "stop"
        else:
            finish = self.info.end
        mask = [0] * len(self.mask) if self.info.broken else list(self.mask)
        known = all(v is not None for v in self.versions)
        last = self.last
        return GenerationResult(
            self.request.request_id,
            list(self.ids),
            list(self.logprobs),
            finish,
            None if last is None else last.weight_version,
            token_versions=list(self.versions) if known and self.ids else None,
            routed_experts=None if last is None else last.routed_experts,
            loss_mask=mask,
            episode=self.info,
        )


# ---------------------------------------------------------------- the loop
class MultiTurn:
    """The rollout manager's episode runner for ``rollout.multi_turn`` (``rollout/episodes.py``).

    Args:
        settings: :class:`MultiTurnSettings`.
        bridge: a :class:`TurnBridge` (``agent.bridge.AppendOnly`` over the model's chat template).
        tools: a :class:`ToolRunner` (``agent.tools.host.ToolHost``).
        parser: the call format (``agent.calls.get_call_format(rollout.multi_turn.format)``).
        tokenizer: decodes a turn's tokens for the parser (special tokens kept: ``<tool_call>`` is one).
    """

    def __init__(
        self,
        settings: MultiTurnSettings,
        bridge: TurnBridge,
        tools: ToolRunner,
        parser: CallParser,
        tokenizer: Any,
    ):
        self.settings = settings
        self.bridge = bridge
        self.tools = tools
        self.parser = parser
        self.tokenizer = tokenizer
        self._eot = set(bridge.end_of_turn_ids)
        self._logged = 0
        self._pool = ThreadPoolExecutor(max_workers=tools.workers, thread_name_prefix="tool-call")
        # The threads that wait on the engine for the episodes' turns, shared by every engine call
        # of the run and kept between them: a pool per call started a thread per episode anew at
        # every call, a fifth of the driver's CPU in the calculator demo's rollouts. A thread waits
        # for one turn at a time, and an episode has at most one in flight.
        self._turn_threads = ThreadPoolExecutor(max_workers=_TURN_THREADS, thread_name_prefix="turn")

    def close(self) -> None:
        """End the tool processes (the run is over)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._turn_threads.shutdown(wait=False, cancel_futures=True)
        self.tools.close()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _log_broken(self, episode: _Episode) -> None:
        """The first few broken episodes' differences (the count is rollout/multiturn/prefix_breaks
        and rerender_mismatches)."""
        if episode.difference is not None and self._logged < _MAX_LOGGED:
            self._logged += 1
            logger.warning(
                "%s; the episode is masked and leaves its group (counted in rollout/multiturn/%s)",
                episode.difference,
                "prefix_breaks" if episode.info.prefix_breaks else "rerender_mismatches",
            )

    def run(
        self,
        engine: Any,
        requests: Sequence[GenerationRequest],
        stop: threading.Event,
        on_result: OnResult | None = None,
    ) -> list[GenerationResult]:
        episodes = [_Episode(r, self.settings, self.bridge, self._decode) for r in requests]
        results = _Flight(self, engine, episodes, stop, on_result).run()
        for e in episodes:
            if e.info.end is not None:
                self.tools.release(e.info.key)
        return results

    def _call(self, key: str, call: Any, tools_kwargs: dict | None) -> ToolOutcome:
        # verl's contract: each verl class tool's create() gets its create_kwargs from the sample
        result = self.tools.call(key, call, tools_kwargs=tools_kwargs)
        return ToolOutcome(result.text, result.status)


class _Flight:
    """One engine call's episodes, each on its own, driven by the events of what it waits for.

    The call's first turns go to the engine as one ``generate`` (a unit's requests together, as a
    single-turn call sends them, so the HF engine batches them as it batches those), whose
    ``on_result`` hands over each finished turn at once; from then on an episode's next turn is
    one ``generate`` of its own, sent the moment its own tool answers are in, and its tool calls
    go to the runner's pool (shared by every episode, ``tool_workers`` at a time) the moment its
    turn ends. Every change to an episode happens on the thread that called ``run``: the engine's
    and the tools' threads only post what came back (``_events``), so the episodes need no locks
    and ``on_result`` is called from one thread. At most one turn per episode is in flight, so
    the threads that wait on the engine are bounded by the call's episodes."""

    def __init__(
        self,
        runner: MultiTurn,
        engine: Any,
        episodes: list[_Episode],
        stop: threading.Event,
        on_result: OnResult | None,
    ):
        self.runner, self.engine, self.episodes = runner, engine, episodes
        self.stop, self.on_result = stop, on_result
        self.eot = list(runner._eot)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight = 0  # engine calls and tool calls not yet answered
        self._turns: dict[str, _Episode] = {}  # a turn's request id -> its episode, until answered
        self._answers: dict[int, list[ToolOutcome | None]] = {}  # id(episode) -> its calls' answers
        self._ended: dict[int, GenerationResult] = {}
        self._stopping = False  # an engine abort reached a turn: no new turn starts
        self._error: BaseException | None = None
        self._threads = runner._turn_threads

    def run(self) -> list[GenerationResult]:
        for e in self.episodes:
            self._report(e)  # a continuation broken from the start
        if self.stop.is_set():
            first = []
        else:
            first = [(e, q) for e in self.episodes if e.live and (q := self._request(e)) is not None]
        if first:
            self._send(first, on_result=True)
        while self._in_flight:
            self._take(self._events.get())
        if self._error is not None:
            raise self._error
        for e in self.episodes:
            if e.live:
                e.aborted = True  # stopped before its next turn: continued from here
            self._report(e)
        return [self._ended.get(id(e)) or e.result() for e in self.episodes]

    # -- what the run thread does -------------------------------------------------------------
    def _request(self, e: _Episode) -> GenerationRequest | None:
        """The episode's next turn, or None when it ended (a budget spent, a broken request)."""
        q = e.next_request(self.eot)
        if q is None:
            self._report(e)
        return q

    def _send(self, turns: list[tuple[_Episode, GenerationRequest]], on_result: bool = False) -> None:
        sent = [q for _, q in turns]
        for e, q in turns:
            self._turns[q.request_id] = e
        self._in_flight += 1
        if not on_result and len(sent) == 1 and isinstance(self.engine, SubmitsTurns):
            # no thread waits on it: hundreds of waiting turn threads cost more than the turns
            self.engine.submit_turn(sent[0]).add_done_callback(
                lambda f: self._events.put(("turn call", (sent, f)))
            )
            return
        if on_result:  # each finished turn handed over while the call's others still decode
            fut = self._threads.submit(self.engine.generate, sent, on_result=self._hand_over)
        else:
            fut = self._threads.submit(self.engine.generate, sent)
        fut.add_done_callback(lambda f: self._events.put(("call", (sent, f))))

    def _hand_over(self, result: GenerationResult) -> None:
        """The engine's ``on_result``, on its thread: only posted, taken by the run thread."""
        self._events.put(("turn", result))

    def _take(self, event: tuple[str, Any]) -> None:
        kind, what = event
        if kind == "turn":
            self._turn(what)
            return
        self._in_flight -= 1
        if kind in ("call", "turn call"):
            sent, fut = what
            try:
                results = fut.result() if kind == "call" else [fut.result()]
                _check_turn(self.engine, sent, results)
            except BaseException as e:  # noqa: BLE001 - raised from run() once nothing is in flight
                self._fail(e)
                return
            for r in results:
                self._turn(r)
        else:  # a tool call's answer
            e, index, fut = what
            try:
                outcome = fut.result()
            except BaseException as error:  # noqa: BLE001 - as above
                self._fail(error)
                return
            answers = self._answers[id(e)]
            answers[index] = outcome
            if all(a is not None for a in answers):
                del self._answers[id(e)]
                e.take_answers(answers, self.runner.bridge, self.runner._eot)
                self._next(e)

    def _turn(self, result: GenerationResult) -> None:
        """A model turn came back (by ``on_result``, or with its call: each is taken once)."""
        e = self._turns.pop(result.request_id, None)
        if e is None:
            return
        e.take_turn(result, self.runner.parser, self.runner._decode)
        self._stopping |= result.finish_reason == "abort"
        if e.pending and self._error is None:
            self._call_tools(e)
        elif e.pending:
            e.pending, e.aborted = [], True
        else:
            self._report(e)

    def _next(self, e: _Episode) -> None:
        """After the episode's tool answers: its next turn, unless it ended or the call stops."""
        if not e.live:
            self._report(e)
        elif self._stopping or self._error is not None or self.stop.is_set():
            e.aborted = True  # right after a tool answer: continued from here
        elif (q := self._request(e)) is not None:
            self._send([(e, q)])

    def _call_tools(self, e: _Episode) -> None:
        """Every call of the episode's last turn, on the shared tool pool; past
        ``max_parallel_calls`` a call is answered with an error instead of run."""
        limit = self.runner.settings.max_parallel_calls
        calls, e.pending = e.pending, []
        answers: list[ToolOutcome | None] = [None] * len(calls)
        self._answers[id(e)] = answers
        for i, call in enumerate(calls):
            if i >= limit:
                answers[i] = ToolOutcome(
                    f"Error: at most {limit} tool calls per turn (rollout.multi_turn.max_parallel_calls); "
                    f"call {i + 1} was not run",
                    "error",
                )
                continue
            self._in_flight += 1
            fut = self.runner._pool.submit(self.runner._call, e.info.key, call, e.request.tools_kwargs)
            fut.add_done_callback(lambda f, e=e, i=i: self._events.put(("answer", (e, i, f))))
        if all(a is not None for a in answers):  # every call refused (none to wait for)
            del self._answers[id(e)]
            e.take_answers(answers, self.runner.bridge, self.runner._eot)
            self._next(e)

    def _fail(self, error: BaseException) -> None:
        """An engine call or a tool call raised: no new turn starts; ``run`` raises it once the
        calls in flight are back (so nothing still runs for the call's episodes after it)."""
        if self._error is None:
            self._error = error

    def _report(self, e: _Episode) -> None:
        """Hand on an episode that ended (its reward can start now), once."""
        if e.info.end is None or id(e) in self._ended:
            return
        self._ended[id(e)] = e.result()
        self.runner._log_broken(e)
        if self.on_result is not None and self._error is None:
            self.on_result(self._ended[id(e)])


def _digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def _differences(a: list[int], b: list[int], decode: Any) -> list[tuple[str, str]]:
    """Where token lists ``a`` and ``b`` differ, as (text of ``a``'s span, text of ``b``'s)."""
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    out = []
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        ours, theirs = decode(a[i1:i2]), decode(b[j1:j2])
        if ours == theirs:  # the same text in other tokens (a sampled token the text does not re-encode to)
            ours, theirs = f"{ours} (ids {a[i1:i2]})", f"{theirs} (ids {b[j1:j2]})"
        out.append((ours, theirs))
    return out


def _check_turn(engine: Any, sent: list[GenerationRequest], results: Any) -> None:
    """An engine's answer to a turn must answer every request, in order; otherwise the manager
    retries the call (on another engine when it can)."""
    ids = [r.request_id for r in results] if isinstance(results, list) else None
    if ids != [q.request_id for q in sent]:
        got = len(results) if isinstance(results, list) else type(results).__name__
        raise EngineError(f"engine {engine.name} answered a turn of {len(sent)} requests with {got} results")
