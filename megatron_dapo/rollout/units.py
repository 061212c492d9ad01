"""The units of rollout scheduling: a drawn group, one engine call's worth of groups, a call in
flight; the seed of each request and the check of an engine's answer to a call.

Each engine call carries a fixed set of requests (``groups_per_call`` consecutive groups, ``n``
requests each) whose seeds depend only on (seed, weight version, the group's draw position,
sample index), so a response does not depend on the engine that ran it, on retries, or on timing.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.rollout.partial import CarriedGroup, PartialSample, continuation, from_result, join
from megatron_dapo.rollout.types import GenerationRequest, GenerationResult, RolloutSample


@dataclass
class Group:
    serial: int  # draw position in this step
    prompt: Any
    samples: list[RolloutSample] | None = None
    carried: CarriedGroup | None = None  # rollout.partial: what an earlier rollout left of it


@dataclass
class Unit:
    """One engine call: ``groups_per_call`` groups, ``n`` requests each."""

    groups: list[Group]
    requests: list[GenerationRequest]
    attempts: int = 0
    avoid: str | None = None
    # rollout.partial: the requests sent (the unfinished ones, continued after their tokens so
    # far); the finished responses (``held``) and the unfinished ones' tokens (``prefix``) by id
    send: list[GenerationRequest] = field(default_factory=list)
    held: dict[str, PartialSample] = field(default_factory=dict)
    prefix: dict[str, PartialSample] = field(default_factory=dict)
    # responses an engine handed over before its call returned (``on_result``), each with its
    # reward's future: request id -> (the full response scored, future). Kept across the unit's
    # calls (a retry, a continuation after a pause): a reward stands wherever the same tokens
    # come back. Written by the engine's thread.
    early: dict[str, tuple[GenerationResult, Future]] = field(default_factory=dict)

    def __post_init__(self):
        if not self.send and not self.held:
            self.send = self.requests
        self._positions = {q.request_id: i for i, q in enumerate(self.requests)}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._positions

    def position(self, request_id: str) -> int:
        """Where ``request_id`` sits in ``requests`` (group ``position // n``, sample ``% n``)."""
        return self._positions[request_id]

    def replan(self) -> None:
        """``send`` from what is held and what is partly generated."""
        self.send = [
            continuation(
                r.request_id, r.prompt_ids, self.prefix[r.request_id], r.sampling, tools_kwargs=r.tools_kwargs
            )
            if r.request_id in self.prefix
            else r
            for r in self.requests
            if r.request_id not in self.held
        ]

    def fold(self, results: list[GenerationResult]) -> int:
        """Keep what ``results`` (answers to ``send``, finished or aborted) generated; the tokens
        they added."""
        sent = {q.request_id for q in self.send}
        added = 0
        for r in results:
            rid = r.request_id
            if rid not in sent:
                continue
            prior = self.prefix.get(rid)
            sample = from_result(join(prior, r), prior)
            added += len(r.output_ids)
            if sample.finished:
                self.held[rid] = sample
                self.prefix.pop(rid, None)
            else:
                self.prefix[rid] = sample
        self.replan()
        return added


@dataclass
class Call:
    unit: Unit
    engine: Any
    start: float  # perf_counter at dispatch (the engines' busy intervals)
    since: float  # the manager's clock at dispatch: the request timeout counts from here
    # set when the manager aborts this call's engine for it: a multi-turn runner starts no turn after
    stop: threading.Event = field(default_factory=threading.Event)
    pauses: int = 0  # the manager's pause count at dispatch: a pause since then may have aborted it


def request_seed(seed: int, version: int, serial: int, sample: int) -> int:
    """A 31-bit seed per (run seed, weight version, group draw position, sample index)."""
    x = 0
    for part in (seed, version, serial, sample):
        x = (x * 1_000_003 + int(part)) % (2**61 - 1)
    return x % (2**31 - 1)


def check_results(unit: Unit, results: Any) -> str | None:
    """None if ``results`` answer every request sent for ``unit`` completely; else what is wrong."""
    if not isinstance(results, list) or len(results) != len(unit.send):
        got = len(results) if isinstance(results, list) else type(results).__name__
        return f"engine returned {got} results for {len(unit.send)} requests"
    ids = {r.request_id for r in results}
    missing = [q.request_id for q in unit.send if q.request_id not in ids]
    if missing:
        return f"engine results lack request ids {missing[:3]}"
    aborted = [r.request_id for r in results if r.finish_reason == "abort"]
    if aborted:
        return f"engine aborted {len(aborted)} requests (e.g. {aborted[0]}) although the batch was not full"
    return None
