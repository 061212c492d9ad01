"""``reward.combine``: how a sample's rule reward and model score make its reward.

A combine function has verl's reward signature plus the two scores, by keyword::

    def combine(data_source, solution_str, ground_truth, extra_info, rule_score, model_score):
        return 0.5 * rule_score + 0.5 * model_score        # or {"score": ..., "acc": ..., "pred": ...}

``rule_score`` is the rule reward's score (None when the caller has none for this data_source),
``model_score`` the reward model's (a scored sample's; an unscored one is never combined). The
return value follows ``reward.custom_fn``'s contract (a float, or a dict with ``score`` and
optionally ``acc``, ``pred``). Without ``reward.combine`` the reward is the model score alone,
``acc`` is ``score > 0`` (as for the ±1 rule and the ±1 ``yes_no`` judge).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from megatron_dapo.rewards.registry import load_custom_fn, reward_fields
from megatron_dapo.rewards.served.outcome import RewardModelError, RewardSample


@dataclass(frozen=True)
class CombinedReward:
    """A sample's reward: ``score``, ``acc`` (what dynamic sampling's acc metric reads), ``pred``."""

    score: float
    acc: bool
    pred: str = ""


class Combiner:
    """``reward.combine`` loaded once: a ``"path.py:fn"``, a callable, or None (the model score)."""

    def __init__(self, spec: str | Callable | None = None):
        self.spec = spec if isinstance(spec, str) or spec is None else getattr(spec, "__name__", "combine")
        self.fn = load_custom_fn(spec) if isinstance(spec, str) else spec

    def __call__(self, sample: RewardSample, rule_score: float | None, model_score: float) -> CombinedReward:
        if model_score is None or not math.isfinite(model_score):
            raise ValueError(
                f"sample {sample.sample_id}: model_score={model_score} cannot be combined; an unscored "
                "sample leaves its group instead"
            )
        if self.fn is None:
            return CombinedReward(float(model_score), model_score > 0)
        try:
            value = self.fn(
                sample.data_source,
                sample.response,
                sample.ground_truth,
                sample.extra_info,
                rule_score=rule_score,
                model_score=model_score,
            )
            score, acc, pred = reward_fields(value)
        except Exception as e:  # a user function's bug: one line naming it and the sample
            raise RewardModelError(
                f"reward.combine={self.spec} failed for sample {sample.sample_id} (rule_score={rule_score}, "
                f"model_score={model_score}): {type(e).__name__}: {e}; it is called as fn(data_source, "
                "solution_str, ground_truth, extra_info, rule_score=..., model_score=...)"
            ) from e
        return CombinedReward(score, acc, pred)
