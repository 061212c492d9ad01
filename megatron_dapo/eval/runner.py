"""Run an evaluation: k samples per problem from some generator, scored with the DAPO reward.

The generator is a function, so the same code serves the trainer's periodic validation (the
rollout engines), `megatron-dapo eval` on an HF checkpoint, and any OpenAI-compatible endpoint.

The scorer is the rule reward (``score(data_source, text, ground_truth, extra_info)``, one call a
response) or a served reward model (:class:`megatron_dapo.eval.served.ServedScorer`:
``score_batch`` takes every response at once, so the reward servers work on many concurrently,
and may leave a response unscored).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_dapo.eval.metrics import ProblemSamples, aggregate
from megatron_dapo.eval.served import ServedScorer


@dataclass
class EpisodeCounts:
    """What a tool-use episode did, for the ``multiturn/*`` metrics (as the rollout's own)."""

    turns: int
    tool_calls: int
    tool_errors: int = 0
    tool_timeouts: int = 0


@dataclass
class Completion:
    """One sampled response: its text, its length in tokens (the stop token included when it
    stopped on one, as the trainer counts a response) and whether it hit the length limit."""

    text: str
    num_tokens: int
    truncated: bool
    # a multi-turn episode's extra_info for the reward (its turns, tool calls); None: the problem's
    extra_info: dict | None = None
    # a multi-turn episode's model turns, the tool calls it wrote, and the calls answered by an
    # error or a time-out; None for a single-turn response
    episode: EpisodeCounts | None = None
    # why the response is scored by no one, as training leaves it (an episode whose token check
    # broke: "broken_episode"); None: it is scored
    unscored: str | None = None


@dataclass
class EvalProblem:
    problem_id: str
    prompt_text: str
    prompt_ids: list[int]
    data_source: str
    ground_truth: str
    extra_info: dict
    # the prompt's chat messages (after the data template): what a served reward model reads
    messages: list[dict] = field(default_factory=list)


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
    """avg@k, pass@k, maj@k (and per data_source avg@k) of `generate` on `problems`; with a served
    reward model, or a completion the generator marks ``unscored`` (a broken episode, never
    handed to the scorer), also the unscored counts (metrics.py says how an unscored response is
    left out) and a served model's mean score; with tool-use episodes their model turns and tool
    calls per episode and the calls answered by an error or a time-out (``multiturn/*``)."""
    problems = dedupe_problems(problems)
    completions = generate(problems, k)
    if len(completions) != len(problems) or any(len(c) != k for c in completions):
        raise RuntimeError(
            f"evaluation generator returned {[len(c) for c in completions][:5]}... completions for "
            f"{len(problems)} problems; expected {k} each"
        )
    pairs = [(prob, c) for prob, comps in zip(problems, completions) for c in comps]
    to_score = [(prob, c) for prob, c in pairs if c.unscored is None]
    served = isinstance(scorer, ServedScorer)
    if served:
        scored = iter(scorer.score_batch(to_score))
    else:
        scored = iter(
            scorer.score(
                prob.data_source,
                c.text,
                prob.ground_truth,
                prob.extra_info if c.extra_info is None else c.extra_info,
            )
            for prob, c in to_score
        )
    results = [None if c.unscored is not None else next(scored) for _, c in pairs]
    # a rule scores every response it is given: unscored counts appear only when one was not
    track = served or len(to_score) < len(pairs)
    per_problem: list[ProblemSamples] = []
    by_source: dict[str, list[ProblemSamples]] = {}
    dump = []
    voted = False
    for i, prob in enumerate(problems):
        samples = ProblemSamples(prob.problem_id, unscored=[] if track else None)
        for c, r in zip(completions[i], results[i * k : (i + 1) * k]):
            unscored = c.unscored or (r.unscored if served else None)
            if unscored is not None:
                samples.unscored.append(unscored)
            else:
                samples.correct.append(bool(r.acc))
                samples.preds.append(r.pred)
                voted = voted or bool(r.pred)
                if served:
                    samples.scores.append(float(r.score))
            samples.lengths.append(c.num_tokens)
            samples.truncated.append(c.truncated)
            if dump_path:
                row = {
                    "problem": prob.problem_id,
                    "response": c.text,
                    "tokens": c.num_tokens,
                    "truncated": c.truncated,
                    "acc": None if unscored else bool(r.acc),
                    "pred": "" if r is None else r.pred,
                }
                if r is None:
                    row["unscored"] = unscored
                elif served:
                    row.update(r.dump())
                if c.episode is not None:
                    row.update(asdict(c.episode))
                dump.append(row)
        per_problem.append(samples)
        by_source.setdefault(prob.data_source, []).append(samples)
    # a served model's answers are voted on only when something extracts them (reward.combine's
    # pred): without, every vote would be for "" and maj@k the first sample's correctness
    vote = voted or not served
    out = {f"{prefix}{key}": v for key, v in aggregate(per_problem, pass_ks, vote=vote).items()}
    if len(by_source) > 1:
        for source, group in by_source.items():
            value = aggregate(group, vote=vote).get(f"avg@{k}")
            if value is not None:
                out[f"{prefix}{source}/avg@{k}"] = value
    out.update(
        {f"{prefix}{key}": v for key, v in episode_metrics([c for row in completions for c in row]).items()}
    )
    if dump_path:
        Path(dump_path).write_text("".join(json.dumps(d) + "\n" for d in dump))
    return out


def episode_metrics(completions: Sequence[Completion]) -> dict[str, float]:
    """``multiturn/*`` over the tool-use episodes among ``completions`` ({} when there are none):
    model turns and tool calls per episode (means), calls answered by an error or a time-out
    (totals), named as the rollout's ``rollout/multiturn/*``."""
    episodes = [c.episode for c in completions if c.episode is not None]
    if not episodes:
        return {}
    n = len(episodes)
    return {
        "multiturn/turns_mean": sum(e.turns for e in episodes) / n,
        "multiturn/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
        "multiturn/tool_errors": float(sum(e.tool_errors for e in episodes)),
        "multiturn/tool_timeouts": float(sum(e.tool_timeouts for e in episodes)),
    }
