"""Sample-based accuracy metrics over k responses per problem (pure python).

- avg@k: mean correctness over all k samples, averaged over problems (the DAPO paper's AIME
  figure is avg@32).
- pass@k: the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k), for k <= n.
- maj@k: correct when the most common extracted answer among the first k samples is a correct
  one; ties are broken by first appearance so the result is deterministic.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from math import comb


@dataclass
class ProblemSamples:
    """All scored responses of one problem."""

    problem_id: str
    correct: list[bool] = field(default_factory=list)
    preds: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)


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


def aggregate(problems: list[ProblemSamples], ks: tuple[int, ...] = (1,)) -> dict[str, float]:
    """Dataset-level metrics: mean over problems of avg@n, pass@k and maj@k for each k <= n."""
    if not problems:
        raise ValueError("no problems to evaluate")
    n = min(len(p.correct) for p in problems)
    out: dict[str, float] = {f"avg@{n}": sum(avg_at_k(p.correct) for p in problems) / len(problems)}
    for k in sorted({k for k in (*ks, n) if 1 <= k <= n}):
        out[f"pass@{k}"] = sum(pass_at_k(p.correct, k) for p in problems) / len(problems)
        out[f"maj@{k}"] = sum(maj_at_k(p.correct, p.preds, k) for p in problems) / len(problems)
    lengths = [x for p in problems for x in p.lengths]
    if lengths:
        out["response_length/mean"] = sum(lengths) / len(lengths)
    trunc = [x for p in problems for x in p.truncated]
    if trunc:
        out["truncated_ratio"] = sum(trunc) / len(trunc)
    out["num_problems"] = float(len(problems))
    out["samples_per_problem"] = float(n)
    return out
