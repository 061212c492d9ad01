"""The lazy teacher's episodes, and the checks of what the warm start learnt from them.

An episode is built as the rollout builds one (``agent.runner.MultiTurn``): the prompt and the
tool answers are the chat-template bridge's tokens (``agent.bridge.ChatBridge``), a model turn is
its text's tokens and the end-of-turn token. So the warm start trains on exactly the token
sequences the RL run later samples and scores, the environment's tokens with loss mask 0.

The teacher calls the calculator in a ``tool_rate`` share of the examples and copies its answer
("[347 * 48]", tool "16656", "Answer: 16656"); otherwise it answers at once with a guess of the
product's size, wrong: the model cannot multiply, and a teacher that could would teach it to
try. The warm-started policy calls the tool at about that rate and copies well, so its accuracy is
about tool_rate x copy accuracy, and only the reward tells it that the call is what pays.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_dapo.agent.bridge import ChatBridge
from megatron_dapo.agent.calls import ToolCall
from megatron_dapo.agent.runner import AppendOnly, MultiTurn, MultiTurnSettings
from megatron_dapo.agent.tools.host import ToolHost
from megatron_dapo.agent.tools.spec import load_tool_config
from megatron_dapo.demo.calculator.calls import CompactCalls
from megatron_dapo.demo.calculator.task import Product
from megatron_dapo.rewards.math_dapo import compute_score
from megatron_dapo.rollout.episodes import reward_input
from megatron_dapo.rollout.hf_engine import HFEngine
from megatron_dapo.rollout.types import GenerationRequest, SamplingParams


@contextmanager
def tools_of(tool_config: str | Path) -> Iterator[ToolHost]:
    """The tools of the run's tool YAML, run as the run runs them (tool processes)."""
    host = ToolHost(load_tool_config(tool_config), timeout_s=30.0, workers=1, memory_mb=2048)
    try:
        yield host
    finally:
        host.close()


def calculator(tools: Any) -> Callable[[str], str]:
    """``expression -> answer`` by ``tools``' calculator: the teacher's tool turns are then the
    tokens the RL episodes get."""

    def calculate(expression: str) -> str:
        result = tools.call("warm-start", ToolCall("calculator", {"expression": expression}))
        if result.status != "ok":
            raise RuntimeError(f"the calculator answered {expression!r} with {result.text!r}")
        return result.text

    return calculate


@dataclass(frozen=True)
class CallingEpisode:
    """The token pieces of one episode that uses the tool."""

    prompt: list[int]
    call: list[int]  # "[347 * 48]<|end|>"
    tool: list[int]  # "<|tool|>16656<|assistant|>" (the environment's)
    reply: list[int]  # "Answer: 16656<|end|>"


class Teacher:
    """Episodes of ``problems`` for a tokenizer with the calculator template.

    Args:
        tokenizer: ``demo.tokenizer.build_calculator_tokenizer()`` or a saved copy.
        tools: the tool schemas the prompts list (what the run's tool YAML gives).
        calculate: ``expression -> text``, the calculator's answer as the tool process prints it.
        seed: seeds the wrong guesses.
    """

    def __init__(self, tokenizer: Any, tools: Sequence[dict], calculate: Callable[[str], str], seed: int = 0):
        self.tokenizer = tokenizer
        self.bridge = ChatBridge(tokenizer)
        self.tools = list(tools)
        self.calculate = calculate
        self.seed = seed
        self.eot = list(self.bridge.end_of_turn_ids)

    def prompt(self, problem: Product) -> list[int]:
        return self.bridge.prompt_ids([{"role": "user", "content": problem.question}], self.tools)

    def _turn(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) + self.eot

    def calling(self, problem: Product) -> CallingEpisode:
        answer = self.calculate(problem.expression)
        return CallingEpisode(
            self.prompt(problem),
            self._turn(f"[{problem.expression}]"),
            self.bridge.env_ids([{"role": "tool", "content": answer}]),
            self._turn(f"Answer: {answer}"),
        )

    def guess(self, problem: Product) -> int:
        """A wrong number with as many digits as the product, the same for the same problem and seed."""
        digits = len(str(problem.answer))
        rng = random.Random(f"guess-{self.seed}-{problem.a}-{problem.b}")
        while True:
            value = rng.randrange(10 ** (digits - 1), 10**digits)
            if value != problem.answer:
                return value

    def encode(self, problem: Product, lazy: bool) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids, response ids, response loss mask): the whole episode, 1 on the model's tokens."""
        if lazy:
            reply = self._turn(f"Answer: {self.guess(problem)}")
            return self.prompt(problem), reply, [1] * len(reply)
        ep = self.calling(problem)
        response = ep.call + ep.tool + ep.reply
        return ep.prompt, response, [1] * len(ep.call) + [0] * len(ep.tool) + [1] * len(ep.reply)


def tool_use_accuracy(model: Any, teacher: Teacher, problems: Sequence[Product]) -> float:
    """Share of ``problems`` whose greedy call, after the teacher's ``[``, is the teacher's, and
    whose greedy reply after the tool's answer is the teacher's: what the warm start learnt of
    using the tool, whether or not it would choose to (greedy, it mostly answers at once)."""
    engine = HFEngine(model=model, max_batch_size=1024)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    episodes = [teacher.calling(p) for p in problems]
    requests = []
    for i, ep in enumerate(episodes):
        requests.append(GenerationRequest(f"call-{i}", ep.prompt + ep.call[:1], greedy))
        requests.append(GenerationRequest(f"reply-{i}", ep.prompt + ep.call + ep.tool, greedy))
    results = engine.generate(requests)
    right = sum(
        results[2 * i].output_ids == ep.call[1:] and results[2 * i + 1].output_ids == ep.reply
        for i, ep in enumerate(episodes)
    )
    return right / len(problems)


class _Borrowed:
    """Tools the episode loop uses but does not own: its close() leaves them running."""

    def __init__(self, tools: Any):
        self.tools = tools
        self.workers = tools.workers

    def call(self, episode_id: str, call: Any, *, tools_kwargs: dict | None = None) -> Any:
        return self.tools.call(episode_id, call, tools_kwargs=tools_kwargs)

    def release(self, episode_id: str) -> None:
        self.tools.release(episode_id)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class EpisodeAccuracy:
    """avg@k of sampled episodes, and the share of them whose first turn called the tool."""

    mean: float
    call_rate: float
    num_problems: int
    samples_per_problem: int


def sampled_episodes(
    model: Any,
    teacher: Teacher,
    tools: Any,
    problems: Sequence[Product],
    *,
    k: int,
    temperature: float,
    top_p: float,
    max_response_length: int,
    settings: MultiTurnSettings,
    seed: int,
) -> EpisodeAccuracy:
    """Sample ``k`` episodes per problem through the rollout's episode loop (``MultiTurn``, the HF
    engine, ``tools`` a ``ToolHost``) and score each final turn by the math_dapo rule, as the run's
    validation does."""
    engine = HFEngine(model=model, max_batch_size=1024)
    runner = MultiTurn(
        settings, AppendOnly(teacher.bridge), _Borrowed(tools), CompactCalls(), teacher.tokenizer
    )
    sampling = dict(temperature=temperature, top_p=top_p, max_new_tokens=max_response_length)
    requests = [
        GenerationRequest(
            f"{i}-{j}", teacher.prompt(p), SamplingParams(**sampling, seed=seed * 1_000_003 + i * k + j)
        )
        for i, p in enumerate(problems)
        for j in range(k)
    ]
    try:
        results = runner.run(engine, requests, threading.Event())
    finally:
        runner.close()
    truths = [str(p.answer) for p in problems for _ in range(k)]
    correct = calls = 0
    for result, truth in zip(results, truths):
        final, _ = reward_input(result, teacher.tokenizer, None)
        correct += compute_score(final, truth)["acc"]
        first = next((t for t in result.episode.turns if t.role == "assistant"), None)
        calls += bool(first and first.calls)
    n = len(results)
    return EpisodeAccuracy(correct / n, calls / n, len(problems), k)
