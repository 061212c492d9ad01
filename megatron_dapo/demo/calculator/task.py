"""Products the tiny model cannot compute in its head: "Compute 347 * 48." (3-digit times 2-digit,
five-digit products).

Train and validation are disjoint in (a, b), as in the arithmetic demo's task: every pair belongs
to exactly one split, so the held-out accuracy is measured on products the model never saw. Rows
are verl's parquet layout with data_source math_dapo: the reward is the math_dapo rule on the
episode's final turn ("Answer: 16656"), whatever the tool printed before it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

A_RANGE = range(100, 1000)
B_RANGE = range(10, 100)
# Five-digit products only (83% of the pairs): the reply then copies the tool's answer from one
# offset. With the 4-digit ones too, the warm start needed ~1400 steps instead of ~300 to copy
# both lengths, most of the demo's time budget (docs/results.md, the calculator demo).
MIN_PRODUCT = 10_000
# One wording: the task is using the tool, not reading; the call copies the operands from it.
TEMPLATE = "Compute {a} * {b}."


@dataclass(frozen=True)
class Product:
    a: int
    b: int

    @property
    def question(self) -> str:
        return TEMPLATE.format(a=self.a, b=self.b)

    @property
    def answer(self) -> int:
        return self.a * self.b

    @property
    def expression(self) -> str:
        """What the model's call asks the calculator for: "347 * 48", the question's own text, so
        the call copies one run of characters at one offset. Without the spaces ("347*48") the two
        operands sit at different offsets, and the warm start took ~1100 steps instead of ~300 to
        copy them (docs/results.md, the calculator demo)."""
        return f"{self.a} * {self.b}"


def split_pairs(seed: int, num_val: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Partition every (a, b) into (train, val), val holding ``num_val`` pairs."""
    pairs = [(a, b) for a in A_RANGE for b in B_RANGE if a * b >= MIN_PRODUCT]
    if not 0 < num_val < len(pairs):
        raise ValueError(f"num_val must be in (0, {len(pairs)}), got {num_val}")
    random.Random(seed).shuffle(pairs)
    return pairs[num_val:], pairs[:num_val]


def make_products(
    seed: int = 0, num_train: int = 4000, num_val: int = 200
) -> tuple[list[Product], list[Product]]:
    """Deterministic (train, val): ``num_train`` distinct training pairs, ``num_val`` held-out ones."""
    train_pairs, val_pairs = split_pairs(seed, num_val)
    if not 0 < num_train <= len(train_pairs):
        raise ValueError(f"num_train must be in (0, {len(train_pairs)}], got {num_train}")
    return [Product(*p) for p in train_pairs[:num_train]], [Product(*p) for p in val_pairs]
