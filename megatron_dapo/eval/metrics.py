"""Sample-based accuracy metrics over k responses per problem (pure python).

- avg@k: mean correctness over all k samples, averaged over problems (the DAPO paper's AIME
  figure is avg@32).
- pass@k: the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k), for k <= n.
- maj@k: correct when the most common extracted answer among the first k samples is a correct
  one; ties are broken by first appearance so the result is deterministic.

Unscored samples (a served reward model that timed out, failed or gave no verdict; a multi-turn
episode whose token check broke, which no one scores): a failed score is not a wrong answer, so an unscored sample is left out of its problem, never counted as
incorrect. Every metric of a problem is computed on its *scored* samples, in the order they were
sampled, as if they were all it had: avg@k is the mean correctness of its scored samples; pass@k
and maj@k need k scored samples, and a problem with fewer is left out of them (counted in
``problems_below@k``). A problem with no scored sample is left out of every metric (counted in
``problems_unscored``). ``unscored`` counts the samples, ``unscored/<reason>`` by reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import comb


@dataclass
class ProblemSamples:
    """All responses of one problem: correctness, answer and score of the scored ones, length and
    truncation of every one.

    ``unscored`` holds the reason of each unscored response; None when the scorer cannot leave a
    response unscored (the rule reward), which also keeps the unscored counts out of the metrics.
    ``scores``: the reward of each scored response, when the scorer reports one (a served model).
    """

    problem_id: str
    correct: list[bool] = field(default_factory=list)
    preds: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    unscored: list[str] | None = None
    scores: list[float] = field(default_factory=list)

    @property
    def sampled(self) -> int:
        return len(self.correct) + len(self.unscored or [])


def avg_at_k(correct: list[bool]) -> float:
    if not correct:
        raise ValueError("avg@k of a problem with no samples")
    return sum(correct) / len(correct)


def pass_at_k(correct: list[bool], k: int) -> float:
    n, c = len(correct), sum(correct)
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples (n={n})")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def maj_at_k(correct: list[bool], preds: list[str], k: int) -> float:
    if len(preds) != len(correct):
        raise ValueError("maj@k needs one extracted answer per sample")
    if not 1 <= k <= len(preds):
        raise ValueError(f"maj@{k} needs 1 <= k <= n samples (n={len(preds)})")
    counts = Counter(preds[:k])
    first_seen = {p: i for i, p in reversed(list(enumerate(preds[:k])))}
    winner = max(counts, key=lambda p: (counts[p], -first_seen[p]))
    return float(correct[preds.index(winner)])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def aggregate(
    problems: list[ProblemSamples], ks: tuple[int, ...] = (1,), vote: bool = True
) -> dict[str, float]:
    """Dataset-level metrics: mean over problems of avg@n, pass@k and maj@k for each k <= n, where
    n is the samples drawn per problem (see the module's docstring for unscored samples).

    ``vote``: report maj@k; False when the answers are not comparable (a served reward model whose
    ``reward.combine`` gives no extracted answer to vote on)."""
    if not problems:
        raise ValueError("no problems to evaluate")
    n = min(p.sampled for p in problems)
    tracked = any(p.unscored is not None for p in problems)
    scored = [p for p in problems if p.correct]
    out: dict[str, float] = {}
    if scored:
        out[f"avg@{n}"] = _mean([avg_at_k(p.correct) for p in scored])
    for k in sorted({k for k in (*ks, n) if 1 <= k <= n}):
        enough = [p for p in scored if len(p.correct) >= k]
        if enough:
            out[f"pass@{k}"] = _mean([pass_at_k(p.correct, k) for p in enough])
            if vote:
                out[f"maj@{k}"] = _mean([maj_at_k(p.correct, p.preds, k) for p in enough])
        if tracked:
            out[f"problems_below@{k}"] = float(len(scored) - len(enough))
    lengths = [x for p in problems for x in p.lengths]
    if lengths:
        out["response_length/mean"] = _mean(lengths)
    trunc = [x for p in problems for x in p.truncated]
    if trunc:
        out["truncated_ratio"] = _mean(trunc)
    out["num_problems"] = float(len(problems))
    out["samples_per_problem"] = float(n)
    if tracked:
        reasons = Counter(r for p in problems for r in p.unscored or [])
        out["unscored"] = float(sum(reasons.values()))
        for reason, count in sorted(reasons.items()):
            out[f"unscored/{reason}"] = float(count)
        out["problems_unscored"] = float(len(problems) - len(scored))
        scores = [s for p in problems for s in p.scores]
        if scores:
            out["score/mean"] = _mean(scores)
    return out
