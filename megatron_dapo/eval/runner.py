"""Run an evaluation: k samples per problem from some generator, scored with the DAPO reward.

The generator is a function, so the same code serves the trainer's periodic validation (the
rollout engines), `megatron-dapo eval` on an HF checkpoint, and any OpenAI-compatible endpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.eval.metrics import ProblemSamples, aggregate


@dataclass
class Completion:
    """One sampled response: its text, its length in tokens (the stop token included when it
    stopped on one, as the trainer counts a response) and whether it hit the length limit."""

    text: str
    num_tokens: int
    truncated: bool
    # a multi-turn episode's extra_info for the reward (its turns, tool calls); None: the problem's
    extra_info: dict | None = None


@dataclass
class EvalProblem:
    problem_id: str
    prompt_text: str
    prompt_ids: list[int]
    data_source: str
    ground_truth: str
    extra_info: dict


# generator(problems, k) -> for each problem, k completions
Generator = Callable[[Sequence[EvalProblem], int], list[list[Completion]]]


def dedupe_problems(problems: Sequence[EvalProblem]) -> list[EvalProblem]:
    """One entry per distinct prompt: the AIME parquet repeats each problem 32 times for avg@32,
    and sampling k per distinct prompt is the same measurement with less bookkeeping."""
    seen: dict[str, EvalProblem] = {}
    for p in problems:
        seen.setdefault(p.prompt_text, p)
    return list(seen.values())


def evaluate(
    problems: Sequence[EvalProblem],
    generate: Generator,
    scorer,
    *,
    k: int,
    pass_ks: tuple[int, ...] = (1,),
    dump_path: str | Path | None = None,
    prefix: str = "val/",
) -> dict[str, float]:
    """avg@k, pass@k, maj@k (and per data_source avg@k) of `generate` on `problems`."""
    problems = dedupe_problems(problems)
    completions = generate(problems, k)
    if len(completions) != len(problems) or any(len(c) != k for c in completions):
        raise RuntimeError(
            f"evaluation generator returned {[len(c) for c in completions][:5]}... completions for "
            f"{len(problems)} problems; expected {k} each"
        )
    per_problem: list[ProblemSamples] = []
    by_source: dict[str, list[ProblemSamples]] = {}
    dump = []
    for prob, comps in zip(problems, completions):
        samples = ProblemSamples(prob.problem_id)
        for c in comps:
            extra = prob.extra_info if c.extra_info is None else c.extra_info
            r = scorer.score(prob.data_source, c.text, prob.ground_truth, extra)
            samples.correct.append(bool(r.acc))
            samples.preds.append(r.pred)
            samples.lengths.append(c.num_tokens)
            samples.truncated.append(c.truncated)
            if dump_path:
                dump.append(
                    {
                        "problem": prob.problem_id,
                        "response": c.text,
                        "tokens": c.num_tokens,
                        "truncated": c.truncated,
                        "acc": bool(r.acc),
                        "pred": r.pred,
                    }
                )
        per_problem.append(samples)
        by_source.setdefault(prob.data_source, []).append(samples)
    out = {f"{prefix}{key}": v for key, v in aggregate(per_problem, pass_ks).items()}
    if len(by_source) > 1:
        for source, group in by_source.items():
            out[f"{prefix}{source}/avg@{k}"] = aggregate(group)[f"avg@{k}"]
    if dump_path:
        Path(dump_path).write_text("".join(json.dumps(d) + "\n" for d in dump))
    return out
