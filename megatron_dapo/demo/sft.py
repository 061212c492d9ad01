"""Supervised warm start: teach the tiny model the answer format and the arithmetic, with a lazy teacher.

Plain torch on CPU, loss on the response tokens only. The worked line ("47 + 8 = 55") is always
right, but a ``lazy_rate`` share of the examples end with the first operand as the final answer
("Answer: 47"), the shortcut a careless teacher takes. The warm-started policy therefore computes
the sum but commits to it only part of the time, and only the reward tells it which final line
pays: the situation RL with a verifier is for, and room for DAPO to lift it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_dapo.demo.task import Problem


@dataclass(frozen=True)
class SFTConfig:
    """Warm-start schedule: linear warm-up then constant learning rate.

    ``steps`` is the most steps run. With ``stop_accuracy`` set, a probe (see
    ``supervised_warm_start``) is scored every ``check_every`` steps from ``min_steps`` on and
    training stops at the first check that reaches it: how many steps a tiny model needs to
    pick up the arithmetic varies a lot with the seed, a target accuracy does not.
    """

    steps: int = 150
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.0
    seed: int = 0
    stop_accuracy: float | None = None
    check_every: int = 25
    min_steps: int = 0
    lazy_rate: float = 0.0  # share of examples whose final line is the first operand, not the result


@dataclass(frozen=True)
class SFTResult:
    """Steps actually run, the last loss, wall time, and the last probe accuracy (None: no probe)."""

    steps: int
    final_loss: float
    seconds: float
    probe_accuracy: float | None = None


def teacher_solution(problem: Problem, lazy: bool) -> str:
    """The reference solution, or its lazy variant: the right worked line, then the first operand as the answer."""
    if not lazy:
        return problem.solution
    return f"{problem.a} {problem.op} {problem.b} = {problem.answer}\nAnswer: {problem.a}"


def encode_example(tokenizer, problem: Problem, lazy: bool = False) -> tuple[list[int], list[int]]:
    """(prompt ids via the chat template, response ids ending with EOS)."""
    prompt = prompt_ids(tokenizer, problem.question)
    text = teacher_solution(problem, lazy)
    response = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt, response


def prompt_ids(tokenizer, question: str) -> list[int]:
    """Token ids of the generation prompt for one question, exactly as the data layer builds it."""
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(enc["input_ids"])


def _collate(examples: list[tuple[list[int], ...]], pad_id: int):
    """Right-padded input ids, attention mask and labels (-100 outside the response, and where
    an example's optional third element, a response loss mask, is 0: a multi-turn episode's
    environment tokens are context, never targets)."""
    import torch

    width = max(len(e[0]) + len(e[1]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    attn = torch.zeros_like(ids)
    for row, (p, r, *mask) in enumerate(examples):
        seq = p + r
        ids[row, : len(seq)] = torch.tensor(seq)
        target = r if not mask else [t if m else -100 for t, m in zip(r, mask[0], strict=True)]
        labels[row, len(p) : len(seq)] = torch.tensor(target)
        attn[row, : len(seq)] = 1
    return ids, attn, labels


def supervised_warm_start(
    model,
    tokenizer,
    problems: list[Problem],
    config: SFTConfig,
    on_step: Callable[[int, float], None] | None = None,
    probe: Callable[[object], float] | None = None,
    encode: Callable[[Any, bool], tuple[list[int], ...]] | None = None,
) -> SFTResult:
    """Train ``model`` in place on the worked solutions of ``problems`` for up to ``config.steps`` steps.

    Deterministic for a given seed on a given machine: batches come from ``random.Random(seed)``
    and torch is seeded. ``on_step(step, loss)`` is called after every optimizer step.
    ``probe(model) -> accuracy`` (model in eval mode) is what ``config.stop_accuracy`` is
    checked against; it should score problems the same way the demo's held-out check does.
    ``encode(problem, lazy)`` -> (prompt ids, response ids[, response loss mask]) makes the
    examples (default: ``encode_example``, the arithmetic demo's).
    """
    import torch

    if config.steps < 0 or config.batch_size <= 0:
        raise ValueError(f"SFTConfig needs steps >= 0 and batch_size > 0, got {config}")
    if not 0.0 <= config.lazy_rate < 1.0:
        raise ValueError(f"SFTConfig.lazy_rate must be in [0, 1), got {config.lazy_rate}")
    if config.stop_accuracy is not None and (probe is None or config.check_every <= 0):
        raise ValueError(
            "SFTConfig.stop_accuracy needs a probe function and check_every > 0; "
            f"got probe={probe!r}, check_every={config.check_every}"
        )
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    # Which examples are lazy is fixed per example by its own stream, so batches (drawn from ``rng``)
    # are the same whatever the rate.
    lazy_rng = random.Random(f"lazy-{config.seed}")
    if encode is None:

        def encode(problem: Any, lazy: bool) -> tuple[list[int], ...]:
            return encode_example(tokenizer, problem, lazy)

    examples = [encode(p, lazy_rng.random() < config.lazy_rate) for p in problems]
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    model.train()
    start = time.perf_counter()
    loss_value = float("nan")
    probe_accuracy = None
    step = 0
    for step in range(1, config.steps + 1):
        scale = min(1.0, step / max(1, config.warmup_steps))
        for group in opt.param_groups:
            group["lr"] = config.lr * scale
        ids, attn, labels = _collate(rng.sample(examples, min(config.batch_size, len(examples))), 0)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = loss.item()
        if on_step is not None:
            on_step(step, loss_value)
        if config.stop_accuracy is not None and step >= config.min_steps and step % config.check_every == 0:
            model.eval()
            probe_accuracy = probe(model)
            model.train()
            if probe_accuracy >= config.stop_accuracy:
                break
    model.eval()
    return SFTResult(
        steps=step, final_loss=loss_value, seconds=time.perf_counter() - start, probe_accuracy=probe_accuracy
    )
