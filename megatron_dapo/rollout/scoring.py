"""Scoring, the DAPO part of a rollout: the reward of each response, the soft overlong
punishment added to it, and the group filter of dynamic sampling (a group is kept when its
filter metric has spread, ``mixed_group_mask``).

The reward is the rule reward (``reward.custom_fn`` or the registry), or with ``reward.model`` the
served reward model's score (``rewards/served``): alone, or mixed with the rule reward by
``reward.combine``. A response the model could not score (time-out, 5xx, unparseable verdict,
server down) is marked ``unscored``, never given a score: it leaves its group.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron_dapo.algo import mixed_group_mask, overlong_penalty
from megatron_dapo.rewards.served import Combiner, RewardSample, ScoreOutcome
from megatron_dapo.rollout.episodes import reward_input, sampled_length
from megatron_dapo.rollout.types import GenerationResult, RolloutSample
from megatron_dapo.rollout.units import Unit

logger = logging.getLogger(__name__)


@dataclass
class SampleReward:
    """One response's reward: ``score`` (NaN when unscored), ``acc``, ``pred``, the rule's error,
    why the model left it unscored, and the two components (None where not computed)."""

    score: float
    acc: bool
    pred: str
    error: str | None = None
    unscored: str | None = None
    rule_score: float | None = None
    model_score: float | None = None


class ModelScorer(Protocol):
    """A served reward model (``rewards.served.BlockingRewardModel``)."""

    kind: str  # reward.model.kind: "classifier" or "judge" (names its reward/<kind>_* metrics)

    def score_many(self, samples: Sequence[RewardSample]) -> list[ScoreOutcome]: ...

    def check_down(self) -> None: ...


class GroupScoring:
    """Scores a finished call's groups and judges each for the filter.

    Args:
        cfg: the manager's config (``n``, the overlong buffer, the filter's switch and metric).
        scorer: a :class:`~megatron_dapo.rewards.scorer.Scorer` (``score_many``): the rule reward.
        tokenizer: decodes response ids to text for the reward (``decode(ids, skip_special_tokens=True)``).
        model: ``reward.model``'s client, or None; ``combiner``: ``reward.combine`` (with a model:
            the rule reward is computed only when a combine function mixes it in).
    """

    def __init__(
        self,
        cfg: Any,
        scorer: Any,
        tokenizer: Any,
        model: ModelScorer | None = None,
        combiner: Combiner | None = None,
    ):
        self.cfg = cfg
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.model = model
        self.combiner = combiner or Combiner(None)
        self._logged: set[str | None] = set()

    def score(
        self,
        unit: Unit,
        by_id: dict[str, GenerationResult],
        outcomes: list[tuple[str, ScoreOutcome]] | None = None,
    ) -> list[list[RolloutSample]]:
        """The scored samples of each of ``unit``'s groups (``by_id``: every request's full
        response): reward from the text, plus the overlong penalty from the length. With a
        reward model, each of its outcomes is appended to ``outcomes`` as ``(kind, outcome)``
        (the step's ``reward/<kind>_*`` metrics: requests, retries, latency).

        A multi-turn episode is scored on its last model turn's text (the final answer; a tool's
        output never is), with the whole episode in ``extra_info["turns"]`` (role and text per
        turn) and ``extra_info["tool_calls"]``: verl's reward signature, so existing reward
        functions see what they always saw. Its overlong penalty counts the tokens the model
        sampled, not the environment's."""
        cfg = self.cfg
        per_group: list[list[tuple[GenerationResult, str]]] = []
        items = []
        for gi, g in enumerate(unit.groups):
            rows = []
            for j in range(cfg.n):
                rid = unit.requests[gi * cfg.n + j].request_id
                res = by_id[rid]
                text, extra = reward_input(res, self.tokenizer, g.prompt.extra_info)
                held = unit.held.get(rid)
                # the whole response (every turn) for the dump; the reward's text is the answer
                whole = (
                    text
                    if res.episode is None
                    else self.tokenizer.decode(res.output_ids, skip_special_tokens=True)
                )
                rows.append((res, whole, held.interrupted if held is not None else 0))
                items.append((g.prompt.data_source, text, g.prompt.ground_truth, extra))
            per_group.append(rows)
        rewards = self._rewards(unit, items, outcomes)
        lengths = torch.tensor(
            [sampled_length(r) for rows in per_group for r, _, _ in rows], dtype=torch.float64
        )
        if cfg.overlong_buffer_enable:
            penalties = overlong_penalty(
                lengths, cfg.max_response_length, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
            ).tolist()
        else:
            penalties = [0.0] * len(lengths)
        out, k = [], 0
        for g, rows in zip(unit.groups, per_group):
            samples = []
            for res, text, interrupted in rows:
                rw, pen = rewards[k], float(penalties[k])
                k += 1
                samples.append(
                    RolloutSample(
                        group_id=g.serial,
                        prompt=g.prompt,
                        response_ids=res.output_ids,
                        rollout_logprobs=res.logprobs,
                        response_text=text,
                        finish_reason=res.finish_reason,
                        score=float(rw.score),
                        acc=bool(rw.acc),
                        pred=rw.pred,
                        overlong_penalty=pen,
                        # an unscored response has no reward (NaN): it leaves its group
                        final_reward=float(rw.score) + pen,
                        weight_version=res.weight_version,
                        truncated=res.finish_reason == "length",
                        reward_error=rw.error,
                        token_versions=res.token_versions,
                        routed_experts=res.routed_experts,
                        interrupted=interrupted,
                        loss_mask=res.loss_mask,
                        episode=None if res.episode is None else res.episode.as_dict(),
                        unscored=rw.unscored,
                        rule_score=rw.rule_score,
                        model_score=rw.model_score,
                    )
                )
            out.append(samples)
        return out

    def _rewards(
        self, unit: Unit, items: list[tuple], record: list[tuple[str, ScoreOutcome]] | None
    ) -> list[SampleReward]:
        """Each response's reward: the rule's, or the reward model's (combined with the rule's)."""
        if self.model is None:
            return [
                SampleReward(r.score, r.acc, r.pred, r.error, rule_score=float(r.score))
                for r in self.scorer.score_many(items)
            ]
        rule: list[Any] = [None] * len(items)
        if self.combiner.fn is not None:  # the rule's score where it has a reward for the data_source
            known = [i for i, item in enumerate(items) if self.scorer.knows(item[0])]
            for i, r in zip(known, self.scorer.score_many([items[i] for i in known])):
                rule[i] = r
        prompts = [g.prompt for g in unit.groups for _ in range(self.cfg.n)]
        ids = [q.request_id for q in unit.requests]
        samples = [
            RewardSample(rid, list(p.messages), text, str(gt), source, dict(extra or {}))
            for rid, p, (source, text, gt, extra) in zip(ids, prompts, items)
        ]
        outcomes = self.model.score_many(samples)
        if record is not None:
            record.extend((self.model.kind, o) for o in outcomes)
        self.model.check_down()  # a server down past reward.model.down_grace_s stops the run
        out = []
        for sample, outcome, r in zip(samples, outcomes, rule):
            rule_score = None if r is None else float(r.score)
            if not outcome.scored:
                self._log_unscored(outcome)
                out.append(SampleReward(float("nan"), False, "", None, outcome.unscored, rule_score, None))
                continue
            mixed = self.combiner(sample, rule_score, outcome.score)
            out.append(
                SampleReward(mixed.score, mixed.acc, mixed.pred, None, None, rule_score, outcome.score)
            )
        return out

    def _log_unscored(self, outcome: ScoreOutcome) -> None:
        """Each reason once per run at warning level (the count is the reward/unscored metric)."""
        if outcome.unscored not in self._logged:
            self._logged.add(outcome.unscored)
            logger.warning(
                "reward model left sample %s unscored (%s: %s); it leaves its group (counted in reward/unscored)",
                outcome.sample_id,
                outcome.unscored,
                outcome.detail,
            )

    def judge(self, samples: list[RolloutSample]) -> tuple[str, bool]:
        """The group filter: "kept", or why the group is dropped ("all_correct", "all_wrong",
        "other", "unscored": the reward model left it fewer than two scored responses, so its
        advantages would have no baseline); and whether the filter metric has spread among the
        scored responses (measured whether or not the filter is on)."""
        scored = [s for s in samples if s.unscored is None]
        if len(scored) < len(samples) and len(scored) < 2:
            return "unscored", False
        samples = scored
        spread = bool(self._keep_mask(samples).all())
        if not self.cfg.filter_groups_enable or spread:
            return "kept", spread
        if all(s.acc for s in samples):
            return "all_correct", spread
        if not any(s.acc for s in samples):
            return "all_wrong", spread
        return "other", spread

    def _keep_mask(self, samples: list[RolloutSample]) -> torch.Tensor:
        metric = self.cfg.filter_metric
        values = [
            float(s.acc) if metric == "acc" else s.score if metric == "score" else s.final_reward
            for s in samples
        ]
        return mixed_group_mask(torch.tensor(values, dtype=torch.float64), [0] * len(samples))
