"""Seeded arithmetic word problems for the CPU demo, in verl's parquet row layout.

Each problem adds a 1-digit number to a 2-digit one or takes it away ("What is 47 + 8?"). Train and validation are disjoint in the
underlying arithmetic, not just in wording: every (operation, a, b) triple belongs to exactly one
split, so validation accuracy measures arithmetic the model never saw, not memorised stories.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "math_dapo"
ABILITY = "MATH"
# a is 2-digit, b 1-digit: small enough for a ~100k-parameter model to learn in seconds, and still
# real generalisation, because every held-out (a, b) reuses unit-digit facts seen with other tens.
A_RANGE = range(10, 100)
B_RANGE = range(1, 10)

# Compact wordings: a ~100k-parameter model learns to read these in a few hundred SFT steps, where
# story-style prompts ("Tom has 23 apples and buys ...") took several times longer on 2 cores.
TEMPLATES = (
    "What is {a} {op} {b}?",
    "Compute {a} {op} {b}.",
    "Find {a} {op} {b}.",
)


@dataclass(frozen=True)
class Problem:
    """One word problem, its reference worked solution and its integer answer."""

    question: str
    op: str
    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def solution(self) -> str:
        """The worked solution the warm start imitates; its last line is the math_dapo answer."""
        return f"{self.a} {self.op} {self.b} = {self.answer}\nAnswer: {self.answer}"


def _all_triples() -> list[tuple[str, int, int]]:
    return [(op, a, b) for op in ("+", "-") for a in A_RANGE for b in B_RANGE]


def split_triples(seed: int, num_val: int) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """Partition every (op, a, b) into (train, val), val holding ``num_val`` triples."""
    triples = _all_triples()
    if not 0 < num_val < len(triples):
        raise ValueError(f"num_val must be in (0, {len(triples)}), got {num_val}")
    random.Random(seed).shuffle(triples)
    return triples[num_val:], triples[:num_val]


def _dress(triple: tuple[str, int, int], rng: random.Random) -> Problem:
    op, a, b = triple
    question = rng.choice(TEMPLATES).format(a=a, op=op, b=b)
    return Problem(question=question, op=op, a=a, b=b)


def make_problems(
    seed: int = 0, num_train: int = 4000, num_val: int = 200
) -> tuple[list[Problem], list[Problem]]:
    """Deterministic (train, val) problem lists; same seed, same problems, same order.

    Train draws ``num_train`` triples (with replacement, different wordings) from the train
    partition; val uses each of its ``num_val`` triples once.
    """
    if num_train <= 0:
        raise ValueError(f"num_train must be > 0, got {num_train}")
    train_triples, val_triples = split_triples(seed, num_val)
    rng = random.Random(seed + 1)
    train = [_dress(rng.choice(train_triples), rng) for _ in range(num_train)]
    val = [_dress(t, rng) for t in val_triples]
    return train, val


def to_rows(problems: list, split: str) -> list[dict]:
    """verl parquet rows: data_source, prompt (chat messages), ability, reward_model, extra_info,
    for any problems with ``question`` and ``answer`` (this task's, the calculator's)."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": p.question}],
            "ability": ABILITY,
            "reward_model": {"ground_truth": str(p.answer), "style": "rule"},
            "extra_info": {"index": i, "split": split},
        }
        for i, p in enumerate(problems)
    ]


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    """Write rows to ``path`` with pyarrow (nested columns as structs/lists, as verl reads them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
