"""How one engine call's requests become responses: the episode runner the manager is handed.

The manager schedules engine calls (units of ``groups_per_call`` groups) and never looks inside
them; what a call does with its engine is the runner's. A single-turn response is the one-turn
episode: ``SingleTurn`` asks the engine once. Multi-turn tool use (``rollout.multi_turn``) is
``agent.runner.MultiTurn``: each episode goes on its own (its next model turn sent the moment its
own tool answers are in, never waiting for another episode's turns or tools), built by the driver
and handed to the manager, so there is one scheduler for both.

Routing is the manager's and nothing else's: a unit goes to the least-loaded engine (the fewest
calls in flight, within its concurrency limit), and every turn of its episodes goes to that same
engine while the call runs (sticky: its prefix cache holds the episodes, and a group shares its
prompt). A call that ends before its episodes do (its engine failed, went down or hung, or a
pause aborted it) has its unit re-issued like any other, to the least-loaded engine then, each
episode continued from the tokens it holds (``rollout.partial``) or started over.

``stop`` is set when the manager aborts the engine for this call (the batch is full, a weight-sync
pause, a time-out): the engine returns what it has as "abort", and a runner that would start
another turn returns instead, its unfinished episodes as "abort" with their tokens so far.
``on_result`` is handed each episode the moment it ends (its last turn, or a budget spent), so
the manager scores it while the call's other episodes still run.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

from megatron_dapo.rollout.engine import OnResult
from megatron_dapo.rollout.types import GenerationRequest, GenerationResult


class EpisodeRunner(Protocol):
    def run(
        self,
        engine: Any,
        requests: Sequence[GenerationRequest],
        stop: threading.Event,
        on_result: OnResult | None = None,
    ) -> list[GenerationResult]:
        """One result per request, in request order (the engine protocol's contract);
        ``on_result`` gets each finished episode as soon as it is (its reward can start)."""
        ...


class SingleTurn:
    """One ``engine.generate`` per call: each response is one model turn."""

    def run(
        self,
        engine: Any,
        requests: Sequence[GenerationRequest],
        stop: threading.Event,
        on_result: OnResult | None = None,
    ) -> list[GenerationResult]:
        del stop  # the engine's own abort ends its call
        return engine.generate(requests, on_result=on_result)


def reward_input(
    result: GenerationResult, tokenizer: Any, extra_info: dict | None
) -> tuple[str, dict | None]:
    """The text a reward function scores for ``result`` and the ``extra_info`` it is given.

    A single-turn response is scored on its text. A multi-turn episode is scored on its last model
    turn (the final answer; what a tool printed never is), with the whole episode in
    ``extra_info["turns"]`` (role and text of every turn) and the number of tool calls in
    ``extra_info["tool_calls"]``: verl's ``compute_score(data_source, solution_str, ground_truth,
    extra_info)`` signature, so a reward function written for one turn works unchanged."""
    if result.episode is None:
        return tokenizer.decode(result.output_ids, skip_special_tokens=True), extra_info
    turns = [
        {
            "role": t.role,
            "content": tokenizer.decode(result.output_ids[t.start : t.end], skip_special_tokens=True),
        }
        for t in result.episode.turns
    ]
    final = next((t["content"] for t in reversed(turns) if t["role"] == "assistant"), "")
    calls = sum(t.calls for t in result.episode.turns if t.role == "assistant")
    return final, {**(extra_info or {}), "turns": turns, "tool_calls": calls}


def tools_kwargs(prompt: Any) -> dict | None:
    """verl's per-sample tool arguments of a prompt row: its ``extra_info["tools_kwargs"]``
    (``{tool name: {"create_kwargs": {...}, "execute_kwargs": {...}}}``), None when it has none.
    The episode runner hands them to the tools, and each verl class tool's ``create`` gets its
    ``create_kwargs`` (the ground truth a gsm8k-style tool checks answers against)."""
    value = (getattr(prompt, "extra_info", None) or {}).get("tools_kwargs")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(
            f"extra_info.tools_kwargs of prompt {getattr(prompt, 'problem_id', getattr(prompt, 'index', '?'))} "
            f"is a {type(value).__name__}; "
            "it must be an object {tool name: {create_kwargs: {...}, execute_kwargs: {...}}} (verl's layout)"
        )
    return value


def sampled_length(result: GenerationResult) -> int:
    """The response tokens the model sampled (what overlong shaping and length metrics count)."""
    return len(result.output_ids) if result.loss_mask is None else sum(result.loss_mask)
