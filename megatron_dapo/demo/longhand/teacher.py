"""The longhand demo's teacher (examples in both styles) and what is measured of a warm start:
whether its work is right in each style, and the length of its sampled responses."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from megatron_dapo.demo.longhand.task import Problem, concise_solution, longhand_solution, solution
from megatron_dapo.demo.sft import prompt_ids
from megatron_dapo.rewards.math_dapo import compute_score


class Teacher:
    """``encode(problem, lazy)`` for ``supervised_warm_start``: each example's style is drawn from
    its own seeded stream, independent of the lazy draw, so the two rates do not interact."""

    def __init__(self, tokenizer, longhand_rate: float, seed: int):
        if not 0.0 <= longhand_rate <= 1.0:
            raise ValueError(f"longhand_rate must be in [0, 1], got {longhand_rate}")
        self.tokenizer = tokenizer
        self.longhand_rate = longhand_rate
        self._rng = random.Random(f"longhand-{seed}")

    def encode(self, problem: Problem, lazy: bool) -> tuple[list[int], list[int]]:
        longhand = self._rng.random() < self.longhand_rate
        text = solution(problem, longhand=longhand, lazy=lazy)
        response = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return prompt_ids(self.tokenizer, problem.question), response


def _generate(
    model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, top_p: float
):
    """Sampled (temperature > 0) or greedy continuations of left-padded prompts, cut after EOS."""
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        attn[row, width - len(p) :] = 1
    sample = temperature > 0
    with torch.no_grad():
        gen = model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=temperature if sample else None,
            top_p=top_p if sample else None,
            top_k=0 if sample else None,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    eos = tokenizer.eos_token_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in gen[:, width:].tolist()]


def work_accuracy(model, tokenizer, problems: list[Problem], max_new_tokens: int = 72) -> float:
    """Share of (problem, style) pairs whose greedy work is exactly the teacher's, with each style
    forced by its first characters ("47+" longhand, "47 " concise). The warm start's stop probe:
    the model must know both ways before RL picks between them."""
    prompts, expected = [], []
    for p in problems:
        base = prompt_ids(tokenizer, p.question)
        for work in (longhand_solution(p), concise_solution(p)):
            forced = work[: len(str(p.a)) + 1]
            prompts.append(base + tokenizer(forced, add_special_tokens=False)["input_ids"])
            expected.append(work[len(forced) :] + "\n")
    outs = _generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0)
    decoded = (tokenizer.decode(o, skip_special_tokens=True) for o in outs)
    return sum(d.startswith(e) for d, e in zip(decoded, expected)) / len(expected)


@dataclass(frozen=True)
class LengthStats:
    """Sampled responses of a policy under the response budget (lengths in tokens, EOS included)."""

    samples: int
    mean: float
    p50: float
    p90: float
    truncated: float  # share cut at the budget (no EOS)
    longhand: float  # share that chose the longhand style
    accuracy: float  # share scored correct by math_dapo


def percentile(values: list[int], q: float) -> float:
    """The q-quantile by linear interpolation (numpy's default), values non-empty."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def length_stats(
    model,
    tokenizer,
    problems: list[Problem],
    *,
    k: int,
    budget: int,
    temperature: float,
    top_p: float,
    seed: int,
) -> LengthStats:
    """Sample ``k`` responses per problem within ``budget`` tokens and measure them."""
    import torch

    torch.manual_seed(seed)
    prompts = [prompt_ids(tokenizer, p.question) for p in problems for _ in range(k)]
    outs = []
    for start in range(0, len(prompts), 256):
        outs += _generate(
            model,
            tokenizer,
            prompts[start : start + 256],
            max_new_tokens=budget,
            temperature=temperature,
            top_p=top_p,
        )
    owners = [p for p in problems for _ in range(k)]
    texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outs]
    lengths = [len(o) for o in outs]
    return LengthStats(
        samples=len(outs),
        mean=statistics.fmean(lengths),
        p50=percentile(lengths, 0.5),
        p90=percentile(lengths, 0.9),
        truncated=sum(tokenizer.eos_token_id not in o for o in outs) / len(outs),
        longhand=sum(t.startswith(f"{p.a}{p.op}") for t, p in zip(texts, owners)) / len(outs),
        accuracy=sum(compute_score(t, str(p.answer))["acc"] for t, p in zip(texts, owners)) / len(outs),
    )
