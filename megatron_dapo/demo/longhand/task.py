"""Longhand addition and subtraction: "What is 47 + 8?" solved either in one line or by counting.

Why this task. On the arithmetic demo every response is 21-25 tokens against a 32-token budget, so
nothing is ever truncated and the length pieces of DAPO (overlong filtering, soft overlong
punishment, token-level loss) have nothing to act on. Here the same problems (2-digit +- 1-digit,
the same train/held-out split, the math_dapo +1/-1 reward on the final answer only) have two
worked solutions:

    concise   "47 + 8 = 55\nAnswer: 55"                              23 tokens with EOS, any b
    longhand  "47+8\n48+7\n49+6\n...\n55+0\nAnswer: 55"              16 + 5b tokens (b = 1..9)

The longhand solution counts one unit at a time: each line moves one from the right operand to the
left one, until the right one is 0. Every line follows from the line before it by a local rule
(add or take one from a number, take one from a digit), so a ~100k-parameter model learns it as
easily as the one-line sum; and its length grows with the problem, from 21 tokens (b=1) to 61
(b=9). With a 40-token response budget a longhand solution of b >= 5 cannot finish: it is cut
at the budget, has no answer line and scores -1. The warm start's teacher writes half of its
examples in each style (``teacher.py``), so at step 0 a good share of responses overrun the
budget and RL has to learn to be concise on the long problems, on the reward alone (a cut
response scores -1 like a wrong one): where overlong filtering, soft overlong punishment and
token-level loss act.

Measured (the warm starts of seeds 0, 1, 2, 3; 200 held-out problems x 4 responses sampled as
the rollouts sample, T=1.0, top_p=1.0, within the 40-token budget): mean 28.8 / 29.4 / 28.4 /
29.6 tokens, p50 23 / 23 / 23 / 23.5, p90 40 on every seed, 26.8% / 30.1% / 23.6% / 31.8% cut at
the budget, 48% / 50% / 45% / 54% longhand; held-out avg@4 (top_p 0.7) 48.9% / 44.2% / 50.8% /
41.1% (docs/results.md, the DAPO ladder on the longhand task).
"""

from __future__ import annotations

from megatron_dapo.demo.task import Problem, make_problems

__all__ = ["Problem", "concise_solution", "final_line", "longhand_solution", "make_problems", "solution"]


def _step(problem: Problem, k: int) -> str:
    """The k-th counting line: k units moved from the right operand to the left."""
    left = problem.a + k if problem.op == "+" else problem.a - k
    return f"{left}{problem.op}{problem.b - k}"


def longhand_solution(problem: Problem) -> str:
    """The counting lines "a op b", ..., "result op 0" (b + 1 lines), without the answer line."""
    return "\n".join(_step(problem, k) for k in range(problem.b + 1))


def concise_solution(problem: Problem) -> str:
    """The one worked line "a op b = result", without the answer line (the arithmetic demo's)."""
    return f"{problem.a} {problem.op} {problem.b} = {problem.answer}"


def final_line(problem: Problem, lazy: bool) -> str:
    """The math_dapo answer line: the result, or the lazy teacher's first operand."""
    return f"Answer: {problem.a if lazy else problem.answer}"


def solution(problem: Problem, longhand: bool, lazy: bool = False) -> str:
    """A whole teacher response (without EOS) in one style."""
    work = longhand_solution(problem) if longhand else concise_solution(problem)
    return f"{work}\n{final_line(problem, lazy)}"
