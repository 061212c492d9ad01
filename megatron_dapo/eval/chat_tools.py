"""Tool-use episodes against any OpenAI-compatible chat endpoint (`eval --url` of a run with tools).

Each sample is an episode over `POST {base}/v1/chat/completions`: the problem's chat messages and
the tools' schemas (`tools`); a reply whose message has `tool_calls` gets each call run on the tool
processes (the same ``ToolHost`` as training, its time-out and limits) and answered with a `tool`
message (`tool_call_id`), and the next turn is asked for; a reply without calls is the episode's
final answer, which the reward scores (with every turn in ``extra_info["turns"]``, as training
scores an episode). The server renders the conversation with its chat template and parses the
calls with its own tool parser: start it with one for the model (SGLang `--tool-call-parser
qwen25`, vLLM `--enable-auto-tool-choice --tool-call-parser hermes`).

Budgets, as the episode loop's: at most ``max_assistant_turns`` model turns (an episode still
calling tools after the last ends there, its calls not run), each turn's `max_tokens` the least of
``max_turn_tokens`` and the response budget left, where the budget counts the model's tokens
(`usage.completion_tokens`) and the tool answers' tokens (their text in the tokenizer; the
template's markup around them is the server's and is not counted). A tool answer is cut to
``max_tool_response_tokens`` tokens; calls beyond ``max_parallel_calls`` in one turn are answered
with an error. The response length reported is the model's tokens, as the trainer's is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from megatron_dapo.eval.openai_endpoint import EndpointError, completions_url, post_with_retries
from megatron_dapo.eval.runner import Completion, EpisodeCounts, EvalProblem


def chat_url(base_url: str) -> str:
    """`{base}/v1/chat/completions` for a base URL given with or without `/v1`."""
    return completions_url(base_url).removesuffix("/completions") + "/chat/completions"


@dataclass
class ToolCall:
    """One call of a reply's `tool_calls`, as the tool host runs it (``agent.calls.ToolCall``'s
    fields: this package does not import the agent's)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_tool_call(item: Any) -> ToolCall:
    """One entry of a reply's `tool_calls` as a call to run; a malformed one carries its error
    (the model is shown it as the call's answer, as the episode loop does)."""
    fn = item.get("function") if isinstance(item, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        return ToolCall("", {}, error=f"a tool call without a function name: {str(item)[:80]}")
    raw = fn.get("arguments")
    if raw is None or raw == "":
        return ToolCall(fn["name"], {})  # a call without arguments
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            return ToolCall(fn["name"], {}, error=f"arguments of {fn['name']} are not JSON ({e})")
    if not isinstance(raw, dict):
        return ToolCall(fn["name"], {}, error=f"arguments of {fn['name']} must be a JSON object")
    return ToolCall(fn["name"], raw)


@dataclass
class _Episode:
    problem: EvalProblem
    key: str
    messages: list[dict]
    turns: list[dict] = field(default_factory=list)  # role and text of each turn, for the reward
    model_tokens: int = 0
    env_tokens: int = 0
    truncated: bool = False
    counts: EpisodeCounts = field(default_factory=lambda: EpisodeCounts(0, 0))

    @property
    def used(self) -> int:
        return self.model_tokens + self.env_tokens

    def completion(self) -> Completion:
        final = next((t["content"] for t in reversed(self.turns) if t["role"] == "assistant"), "")
        extra = {**(self.problem.extra_info or {}), "turns": self.turns, "tool_calls": self.counts.tool_calls}
        return Completion(final, self.model_tokens, self.truncated, extra_info=extra, episode=self.counts)


def make_chat_tool_generator(
    base_url: str,
    *,
    model: str,
    temperature: float,
    top_p: float,
    max_tokens: int,
    count_text: Callable[[str], int],
    tools: Any,
    schemas: Sequence[dict],
    settings: Any,
    truncate: Callable[[str], str],
    api_key: str | None = None,
    timeout_s: float = 600.0,
    concurrency: int = 16,
    max_retries: int = 2,
    backoff_s: float = 0.5,
):
    """A `Generator` for `evaluate`: k episodes per problem through the chat API with ``tools``.

    ``tools``: runs a call (``agent.tools.host.ToolHost``, which answers a malformed call with its
    error); ``settings``: ``agent.runner.MultiTurnSettings``; ``truncate(text)``: a tool answer cut
    to ``settings.max_tool_response_tokens`` tokens; ``count_text``: the tokenizer's count."""
    url = chat_url(base_url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def turn(client: httpx.Client, e: _Episode, index: int) -> dict:
        left = max_tokens - e.used
        if settings.max_turn_tokens is not None:
            left = min(left, settings.max_turn_tokens)
        payload = {
            "model": model,
            "messages": e.messages,
            "tools": list(schemas),
            "n": 1,
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": left,
        }
        what = f"problem {e.problem.problem_id}, {e.key} turn {index}"
        reply = post_with_retries(
            client,
            url,
            payload,
            headers=headers,
            what=what,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
        )
        choice = reply["choices"][0] if reply["choices"] else None
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            raise EndpointError(f"a reply without a message: {str(reply)[:200]!r} (POST {url}, {what})")
        content = message.get("content") or ""
        usage = reply.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            e.model_tokens += usage["completion_tokens"]
        else:
            e.model_tokens += count_text(content) + int(choice.get("finish_reason") in ("stop", "tool_calls"))
        e.turns.append({"role": "assistant", "content": content})
        e.counts.turns += 1
        return {
            "content": content,
            "calls": message.get("tool_calls") or [],
            "finish": choice.get("finish_reason"),
        }

    def answer(e: _Episode, calls: list, content: str) -> None:
        e.messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for i, item in enumerate(calls):
            call = parse_tool_call(item)
            if i >= settings.max_parallel_calls:
                text = (
                    f"Error: at most {settings.max_parallel_calls} tool calls per turn "
                    f"(rollout.multi_turn.max_parallel_calls); call {i + 1} was not run"
                )
                status = "error"
            else:
                result = tools.call(e.key, call)
                text, status = result.text, result.status
            e.counts.tool_errors += status == "error"
            e.counts.tool_timeouts += status == "timeout"
            text = truncate(text)
            e.env_tokens += count_text(text)
            call_id = item.get("id") if isinstance(item, dict) else None
            e.messages.append({"role": "tool", "tool_call_id": call_id, "name": call.name, "content": text})
            e.turns.append({"role": "tool", "content": text})

    def episode(client: httpx.Client, prob: EvalProblem, j: int) -> Completion:
        e = _Episode(prob, f"eval-{prob.problem_id}-{j}", [dict(m) for m in prob.messages])
        try:
            for index in range(settings.max_assistant_turns):
                if e.used >= max_tokens:
                    e.truncated = True
                    break
                got = turn(client, e, index)
                calls = [c for c in got["calls"] if c is not None]
                e.counts.tool_calls += len(calls)
                if got["finish"] == "length" and not calls:
                    e.truncated = True
                    break
                if not calls or index + 1 >= settings.max_assistant_turns:
                    break  # the final answer, or the turn limit (its calls are not run)
                answer(e, calls, got["content"])
                if e.used + 1 > max_tokens:
                    e.truncated = True  # no room left for a reply
                    break
        finally:
            tools.release(e.key)
        return e.completion()

    def generate(problems: Sequence[EvalProblem], k: int) -> list[list[Completion]]:
        with httpx.Client() as client:
            pool = ThreadPoolExecutor(concurrency)
            try:
                futures = [[pool.submit(episode, client, p, j) for j in range(k)] for p in problems]
                return [[f.result() for f in row] for row in futures]
            finally:
                # after a failure, the episodes not yet started are not started
                pool.shutdown(wait=True, cancel_futures=True)

    return generate
