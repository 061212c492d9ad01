"""Scoring, the DAPO part of a rollout: the reward of each response, the soft overlong
punishment added to it, and the group filter of dynamic sampling (a group is kept when its
filter metric has spread, ``mixed_group_mask``).

The reward is the rule reward (``reward.custom_fn`` or the registry), or with ``reward.model`` the
served reward model's score (``rewards/served``): alone, or mixed with the rule reward by
``reward.combine``. A response the model could not score (time-out, 5xx, unparseable verdict,
server down) is marked ``unscored``, never given a score: it leaves its group.

A reward is a function of one response (its tokens, its episode, its prompt), so the manager
asks for it the moment the engine hands the response over (``RolloutEngine.generate``'s
``on_result``), while the rest of the call still generates; the group's samples are built once
every response of the call is in.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron_dapo.algo import mixed_group_mask, overlong_penalty
from megatron_dapo.rewards.served import Combiner, RewardSample, ScoreOutcome
from megatron_dapo.rollout.episodes import reward_input, sampled_length
from megatron_dapo.rollout.types import GenerationResult, RolloutSample
from megatron_dapo.rollout.units import Unit

logger = logging.getLogger(__name__)
# the unscored reason of an episode the multi-turn token check broke (reward/unscored_broken_episode)
BROKEN_EPISODE = "broken_episode"

# more than this share of a step's responses failing in the reward stops the run (check_step)
REWARD_ERROR_SHARE = 0.5


class RewardFunctionError(RuntimeError):
    """Most of a step's responses failed in the reward itself; the message names the first failure."""


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
    text: str = ""  # the whole response (every turn of an episode), decoded once, for the dump


class ModelScorer(Protocol):
    """A served reward model (``rewards.served.BlockingRewardModel``)."""

    kind: str  # reward.model.kind: "classifier" or "judge" (names its reward/<kind>_* metrics)
    concurrency: int  # samples its servers score at once (the scoring threads to keep them busy)

    def score(self, sample: RewardSample) -> ScoreOutcome: ...

    def check_down(self) -> None: ...  # raises when a server is down past its grace, or lost

    # optional: ``submit(sample, deadline) -> Future[ScoreOutcome]`` (scoring as a coroutine on
    # the client's loop, no thread held per response) and ``step_timeout_s`` (begin_step)


class GroupScoring:
    """Scores responses one by one as they complete, builds a finished call's groups from them,
    and judges each group for the filter.

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
        self._deadline: float | None = None  # the step's scoring deadline (begin_step)

    def reward(
        self, unit: Unit, request_id: str, result: GenerationResult, outcomes: list[tuple[str, ScoreOutcome]]
    ) -> SampleReward:
        """One response's reward, on a scoring thread: the rule's, or the reward model's (mixed
        with the rule's by ``reward.combine``). It depends only on the response's tokens and
        episode and its prompt, so it can run the moment the response completes, while the
        rest of its call still generates. A reward model's outcome is appended to ``outcomes``
        as ``(kind, outcome)`` (the step's ``reward/<kind>_*`` metrics).

        A multi-turn episode is scored on its last model turn's text (the final answer; a tool's
        output never is), with the whole episode in ``extra_info["turns"]`` (role and text per
        turn) and ``extra_info["tool_calls"]``: verl's reward signature, so existing reward
        functions see what they always saw."""
        broken = self._broken(result)
        if broken is not None:
            return broken
        prompt, text, extra, whole = self._inputs(unit, request_id, result)
        if self.model is None:
            r = self.scorer.score_many([(prompt.data_source, text, prompt.ground_truth, extra)])[0]
            return SampleReward(r.score, r.acc, r.pred, r.error, rule_score=float(r.score), text=whole)
        sample, rule = self._model_input(request_id, prompt, text, extra)
        return self._from_outcome(sample, rule, self.model.score(sample), outcomes, whole)

    def start(
        self,
        unit: Unit,
        request_id: str,
        result: GenerationResult,
        outcomes: list[tuple[str, ScoreOutcome]],
        pool: Executor,
    ) -> Future:
        """One response's reward, started; a future of its :class:`SampleReward`. The rule's part
        (decoding, the rule reward) runs on ``pool``; a served model's score is then a coroutine
        on its client's loop (``submit``), so no thread waits on a response being scored, and
        past the step's deadline (:meth:`begin_step`) it comes back unscored. Cancelling the
        future cancels the request. ``pool.submit`` raises RuntimeError once it is shut."""
        submit = getattr(self.model, "submit", None)
        if submit is None:
            return pool.submit(self.reward, unit, request_id, result, outcomes)
        out: Future = Future()
        broken = self._broken(result)
        if broken is not None:
            out.set_result(broken)
            return out

        def prepare() -> None:
            try:
                prompt, text, extra, whole = self._inputs(unit, request_id, result)
                sample, rule = self._model_input(request_id, prompt, text, extra)
                inner = submit(sample, self._deadline)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, raised there
                _settle(out, error=e)
                return

            def finish(f: Future) -> None:  # on the client's loop thread: quick, never blocks
                if f.cancelled():
                    out.cancel()
                    return
                try:
                    _settle(out, self._from_outcome(sample, rule, f.result(), outcomes, whole))
                except BaseException as e:  # noqa: BLE001 - a server lost, a combine that raised
                    _settle(out, error=e)

            out.add_done_callback(lambda o: inner.cancel() if o.cancelled() else None)
            inner.add_done_callback(finish)

        pool.submit(prepare)
        return out

    def begin_step(self) -> None:
        """A rollout step starts: its scoring's deadline is ``reward.model.step_timeout_s`` from now."""
        limit = getattr(self.model, "step_timeout_s", None)
        self._deadline = None if limit is None else time.monotonic() + float(limit)

    def _broken(self, result: GenerationResult) -> SampleReward | None:
        """An episode whose token check failed: its tokens are not what was sampled or rendered,
        so it is scored by no one and leaves its group (every token of it is masked)."""
        if result.episode is None or not result.episode.broken:
            return None
        text = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        return SampleReward(float("nan"), False, "", None, BROKEN_EPISODE, text=text)

    def _inputs(self, unit: Unit, request_id: str, result: GenerationResult):
        prompt = unit.groups[unit.position(request_id) // self.cfg.n].prompt
        text, extra = reward_input(result, self.tokenizer, prompt.extra_info)
        whole = (
            text
            if result.episode is None
            else self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        )
        return prompt, text, extra, whole

    def _model_input(self, request_id: str, prompt: Any, text: str, extra: dict | None):
        """The reward model's sample, and the rule's result where ``reward.combine`` mixes it in."""
        rule = None
        if self.combiner.fn is not None and self.scorer.knows(prompt.data_source):
            # the rule's score, where it has a reward for the data_source, for the combine function
            rule = self.scorer.score_many([(prompt.data_source, text, prompt.ground_truth, extra)])[0]
        sample = RewardSample(
            request_id,
            list(prompt.messages),
            text,
            str(prompt.ground_truth),
            prompt.data_source,
            dict(extra or {}),
        )
        return sample, rule

    def _from_outcome(
        self,
        sample: RewardSample,
        rule: Any,
        outcome: ScoreOutcome,
        outcomes: list[tuple[str, ScoreOutcome]],
        whole: str,
    ) -> SampleReward:
        outcomes.append((self.model.kind, outcome))
        self.model.check_down()  # a server down past reward.model.down_grace_s (or lost) stops the run
        rule_score = None if rule is None or rule.error is not None else float(rule.score)
        if not outcome.scored:
            self._log_unscored(outcome)
            return SampleReward(float("nan"), False, "", None, outcome.unscored, rule_score, None, whole)
        if rule is not None and rule.error is not None:
            # the rule failed: its failure value stands, as without a model (a reward error,
            # counted), never mixed into a combined score as if the rule had scored
            return SampleReward(rule.score, rule.acc, rule.pred, rule.error, None, None, outcome.score, whole)
        mixed = self.combiner(sample, rule_score, outcome.score)
        return SampleReward(mixed.score, mixed.acc, mixed.pred, None, None, rule_score, outcome.score, whole)

    def samples(
        self, unit: Unit, by_id: dict[str, GenerationResult], rewards: dict[str, SampleReward]
    ) -> list[list[RolloutSample]]:
        """The scored samples of each of ``unit``'s groups from every request's full response
        (``by_id``) and its reward: plus the overlong penalty, which counts the tokens the model
        sampled (an episode's environment tokens are not its length)."""
        cfg = self.cfg
        out = []
        for gi, g in enumerate(unit.groups):
            samples = []
            for j in range(cfg.n):
                rid = unit.requests[gi * cfg.n + j].request_id
                res, rw = by_id[rid], rewards[rid]
                held = unit.held.get(rid)
                pen = self._penalty(sampled_length(res))
                samples.append(
                    RolloutSample(
                        group_id=g.serial,
                        prompt=g.prompt,
                        response_ids=res.output_ids,
                        rollout_logprobs=res.logprobs,
                        response_text=rw.text,
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
                        interrupted=held.interrupted if held is not None else 0,
                        loss_mask=res.loss_mask,
                        episode=None if res.episode is None else res.episode.as_dict(),
                        unscored=rw.unscored,
                        rule_score=rw.rule_score,
                        model_score=rw.model_score,
                    )
                )
            out.append(samples)
        return out

    def _penalty(self, length: int) -> float:
        cfg = self.cfg
        if not cfg.overlong_buffer_enable:
            return 0.0
        lengths = torch.tensor([length], dtype=torch.float64)
        return float(
            overlong_penalty(
                lengths, cfg.max_response_length, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
            )[0]
        )

    def check_step(
        self, generated: list[RolloutSample], filtered: dict[str, int], unscored: dict[str, int]
    ) -> None:
        """Stop the run when the step's responses failed mostly in the reward itself, naming that
        failure, rather than train on it or blame the data: more than half of them with a reward
        error (raised, timed out), or (``filtered``/``unscored``: the ledger's) more than half of
        the dropped groups dropped because the reward model left them unscored."""
        errors = [s.reward_error for s in generated if s.reward_error is not None]
        if generated and len(errors) > REWARD_ERROR_SHARE * len(generated):
            spec = getattr(self.scorer, "custom_fn", None)
            which = f"reward.custom_fn={spec}" if spec else "the built-in reward"
            raise RewardFunctionError(
                f"rollout: {len(errors)} of the step's {len(generated)} responses failed in the reward function "
                f"({which}), the first with: {errors[0]}; they would train as wrong answers (a group whose every "
                "response failed is dropped as all-wrong): fix the reward function"
            )
        dropped = sum(filtered.values())
        if dropped and filtered.get("unscored", 0) > REWARD_ERROR_SHARE * dropped:
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(unscored.items()))
            raise RewardFunctionError(
                f"rollout: {filtered['unscored']} of the step's {dropped} dropped groups were dropped because the "
                f"reward model left them unscored (responses by reason: {reasons}); the reward model, not the "
                "data, is the cause: read its server's log and the reward/unscored_* metrics"
            )

    def metrics(self) -> dict[str, float]:
        """``reward/server_restarts``: restarts of the run's reward servers so far (the run stops
        past ``reward.model.max_restarts`` of one server)."""
        restarts = getattr(self.model, "restarts", None)
        return {} if restarts is None else {"reward/server_restarts": float(restarts)}

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


def _settle(out: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Settle ``out`` unless its waiter cancelled it meanwhile."""
    if out.set_running_or_notify_cancel():
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(result)
