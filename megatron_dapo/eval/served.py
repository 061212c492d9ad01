"""Evaluation scored by a served reward model (``reward.model``) and ``reward.combine``, as
training scores its rollouts.

Every completion of the evaluation goes to the reward model in batches of ``batch_size``
(``score_many``: the servers hold up to ``reward.model.max_in_flight`` requests each). A
completion the model could not score (timeout, 5xx, unparseable verdict, server down) comes back
*unscored* with its reason, and the metrics leave it out of its problem (metrics.py); a 4xx or a
server down past ``reward.model.down_grace_s`` raises, in one line, and ends the evaluation.

The rule reward runs only for ``reward.combine`` (its ``rule_score``), and only for the
data_sources it knows (with ``reward.custom_fn``, every one); for the others ``rule_score`` is None.
Without ``reward.combine`` the reward is the model's score and a response is correct when it is
> 0 (the ±1 ``yes_no`` judge: a "yes").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_dapo.rewards.served import Combiner, RewardSample, ScoreOutcome

# Completions per score_many call: the in-flight slots of 16 servers at the default 32 each, and
# few enough that a 4xx or a dead server stops the evaluation before it sends the whole set.
DEFAULT_BATCH = 512


@dataclass(frozen=True)
class ServedScore:
    """One completion's result: ``score``/``acc``/``pred`` (the reward after ``reward.combine``),
    or ``unscored`` with its reason."""

    score: float | None
    acc: bool
    pred: str
    unscored: str | None = None
    model_score: float | None = None
    rule_score: float | None = None
    detail: str = ""
    verdict: str | None = None

    def dump(self) -> dict[str, Any]:
        """The fields ``eval --dump`` adds to a completion's line."""
        row = {
            "score": self.score,
            "model_score": self.model_score,
            "rule_score": self.rule_score,
            "unscored": self.unscored,
        }
        if self.unscored:
            row["detail"] = self.detail
        if self.verdict is not None:
            row["verdict"] = self.verdict
        return row


class ServedScorer:
    """The scorer ``evaluate`` takes for a served reward model.

    Args:
        open_model: returns the reward model (``score_many(list[RewardSample]) ->
            list[ScoreOutcome]``, ``close()``), called at the first batch, so that servers the
            evaluation starts itself come up after the policy's generation has freed the GPUs.
        combine: ``reward.combine`` (``"path.py:fn"``) or None; loaded here, so that a broken file
            fails before anything is sampled.
        rule: the rule reward (a :class:`megatron_dapo.rewards.scorer.Scorer`), needed with
            ``combine``.
        batch_size: completions per ``score_many``.
    """

    def __init__(
        self,
        open_model: Callable[[], Any],
        *,
        combine: str | None = None,
        rule=None,
        batch_size: int = DEFAULT_BATCH,
    ):
        if combine is not None and rule is None:
            raise ValueError("reward.combine needs the rule reward's scorer (its rule_score)")
        self.open_model = open_model
        self.combiner = Combiner(combine)
        self.rule = rule if combine is not None else None
        self.batch_size = int(batch_size)
        self.model = None

    def score_batch(self, pairs: Sequence[tuple[Any, Any]]) -> list[ServedScore]:
        """``(EvalProblem, Completion)`` pairs -> one :class:`ServedScore` each, in order."""
        seen: dict[str, int] = {}
        samples_all = []
        for prob, c in pairs:
            j = seen[prob.problem_id] = seen.get(prob.problem_id, -1) + 1
            samples_all.append(_sample(prob, j, c))
        if self.model is None:
            self.model = self.open_model()
        out: list[ServedScore] = []
        for start in range(0, len(samples_all), self.batch_size):
            samples = samples_all[start : start + self.batch_size]
            outcomes = self.model.score_many(samples)
            rules = self._rule_scores(samples, outcomes)
            out.extend(self._combine(s, o, r) for s, o, r in zip(samples, outcomes, rules))
        return out

    def _rule_scores(self, samples: list[RewardSample], outcomes: list[ScoreOutcome]):
        """The rule reward's result of each scored sample it can score; None for the others."""
        results: list[Any] = [None] * len(samples)
        if self.rule is None:
            return results
        wanted = [
            i
            for i, (s, o) in enumerate(zip(samples, outcomes))
            if o.scored and self.rule.knows(s.data_source)
        ]
        scored = self.rule.score_many(
            [
                (samples[i].data_source, samples[i].response, samples[i].ground_truth, samples[i].extra_info)
                for i in wanted
            ]
        )
        for i, r in zip(wanted, scored):
            results[i] = r
        return results

    def _combine(self, sample: RewardSample, outcome: ScoreOutcome, rule) -> ServedScore:
        if not outcome.scored:
            return ServedScore(
                None, False, "", outcome.unscored, detail=outcome.detail, verdict=outcome.verdict
            )
        rule_score = None if rule is None else float(rule.score)
        reward = self.combiner(sample, rule_score, outcome.score)
        # a combine that gives no extracted answer votes with the rule's (maj@k)
        pred = reward.pred or ("" if rule is None else rule.pred)
        return ServedScore(
            reward.score,
            reward.acc,
            pred,
            model_score=outcome.score,
            rule_score=rule_score,
            verdict=outcome.verdict,
        )

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _sample(problem, j: int, completion) -> RewardSample:
    if not problem.messages:
        raise ValueError(
            f"problem {problem.problem_id} has no chat messages; a served reward model reads the prompt's "
            "messages (EvalProblem.messages), not its rendered text"
        )
    extra = problem.extra_info if completion.extra_info is None else completion.extra_info
    return RewardSample(
        # how a 4xx line names it: the problem's row and which of its k responses
        sample_id=f"problem {problem.problem_id} response {j}",
        messages=list(problem.messages),
        response=completion.text,
        ground_truth=str(problem.ground_truth),
        data_source=problem.data_source,
        extra_info=dict(extra or {}),
    )
