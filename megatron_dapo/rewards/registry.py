"""Which reward function scores which data_source; loading custom ``file.py:function`` rewards.

Built-in: the DAPO math rule (:mod:`megatron_dapo.rewards.math_dapo`) for ``math_dapo``,
``math``, ``math_dapo_reasoning``, ``BytedTsinghua-SIA/DAPO-Math-17k`` and any data_source whose
name starts with ``aime`` or ``dapo`` (case-insensitive: ``aime24``, ``DAPO-17k``, ...).

A custom reward has verl's signature ``fn(data_source, solution_str, ground_truth, extra_info)
-> float | dict``; a dict needs ``"score"`` and may carry ``"acc"`` (else ``score > 0``) and
``"pred"``. As in verl, a custom reward replaces the built-in dispatch for every data_source.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from megatron_dapo.pyfile import import_file
from megatron_dapo.rewards import math_dapo

MATH_DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning", "BytedTsinghua-SIA/DAPO-Math-17k")
MATH_DAPO_PREFIXES = ("aime", "dapo")

RewardFn = Callable[[str, str, str, dict], "float | dict"]


class UnknownDataSourceError(ValueError):
    """No built-in reward for a data_source and no custom reward given."""


def is_math_dapo_source(data_source: str) -> bool:
    """True for the data_sources the DAPO math rule scores."""
    return data_source in MATH_DAPO_SOURCES or data_source.lower().startswith(MATH_DAPO_PREFIXES)


def builtin_reward(data_source: str, boxed_fallback: bool = False) -> Callable[[str, str, dict], dict]:
    """The built-in scorer ``(solution_str, ground_truth, extra_info) -> dict`` for a data_source."""
    if not isinstance(data_source, str) or not is_math_dapo_source(data_source):
        raise UnknownDataSourceError(
            f"no built-in reward for data_source {data_source!r}. Built-in: {', '.join(MATH_DAPO_SOURCES)} "
            f"and names starting with {' or '.join(repr(p) for p in MATH_DAPO_PREFIXES)}. For anything else "
            "pass a custom reward 'path/to/file.py:function' with the signature "
            "fn(data_source, solution_str, ground_truth, extra_info) -> float | dict "
            "(Scorer(custom_fn=...), config key reward.custom_fn)"
        )

    def score(solution_str: str, ground_truth: str, extra_info: dict) -> dict:
        return math_dapo.compute_score(solution_str, ground_truth, boxed_fallback=boxed_fallback)

    return score


def load_custom_fn(spec: str) -> RewardFn:
    """Import ``function`` from ``path/to/file.py`` given as ``"path/to/file.py:function"``."""
    path_str, sep, name = spec.rpartition(":")
    if not sep or not path_str or not name:
        raise ValueError(f"custom reward {spec!r} must look like 'path/to/file.py:function'")
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"custom reward file {str(path)!r} (from {spec!r}) does not exist")
    try:
        module = import_file(path, "custom_reward")
    except ImportError as e:
        raise ValueError(f"custom reward file {str(path)!r} cannot be imported as a Python module") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"{str(path)!r} has no function {name!r}; callables there: {found}")
    return fn


def reward_fields(value) -> tuple[float, bool, str]:
    """``(score, acc, pred)`` from a reward function's float or dict return value.

    Raises ValueError/TypeError for a value that breaks the contract, naming what is wrong.
    """
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward dict has no 'score' key (keys: {sorted(value)})")
        score = _as_score(value["score"])
        acc = bool(value["acc"]) if "acc" in value else score > 0
        pred = value.get("pred", "")
        return score, acc, "" if pred is None else str(pred)
    score = _as_score(value)
    return score, score > 0, ""


def _as_score(x) -> float:
    if isinstance(x, str) or not hasattr(x, "__float__"):
        raise TypeError(f"reward score must be a number, got {type(x).__name__} {x!r:.80}")
    score = float(x)
    if not math.isfinite(score):
        raise ValueError(f"reward score must be finite, got {score}")
    return score
