"""algorithm.use_kl_in_reward: a KL penalty to the reference policy in each response's reward.

As verl's ``apply_kl_penalty`` for outcome rewards: after the rollout, the actor scores the batch
under pi_old and the reference (one micro-batch plan, ``ActorWorker.score_old_and_ref``); each
response's score becomes ``score - coef * sum_t kl_t`` over its tokens, and the advantages are
computed again from the penalised scores. ``coef`` comes from the controller
(``algorithm.kl_ctrl``: fixed, or adaptive toward ``target_kl``), which is then updated with the
batch's mean KL and its number of responses; its value is part of the run's state (saved with
every checkpoint, restored on resume).

The group filter (dynamic sampling) ran before, on the scores without the penalty: the penalty
needs the actor's log-probs of the whole batch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from megatron_dapo.actor.batch import ActorBatch
from megatron_dapo.algo import kl_controller, kl_reward_penalty
from megatron_dapo.driver.batch_builder import advantage_metrics, response_advantages


class KLInReward:
    """The penalty and its controller, built from the run's ``algorithm`` section."""

    def __init__(self, algorithm: Any):
        ctrl = algorithm.kl_ctrl
        self.kind = algorithm.kl_penalty
        self.adv_estimator = algorithm.adv_estimator
        self.norm_adv_by_std = algorithm.norm_adv_by_std_in_grpo
        self.controller = kl_controller(ctrl.type, ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)

    def apply(
        self, batch: ActorBatch, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor
    ) -> tuple[ActorBatch, dict[str, float]]:
        """The batch with penalised scores, new advantages and both log-probs attached (the
        update then scores neither again), and the step's metrics under verl's names."""
        if batch.scores is None:
            raise ValueError(
                "a KL penalty in the reward needs the batch's scores (build_actor_batch sets them)"
            )
        # every token the model sampled: overlong-filtered ones too, the environment's never
        sampled = batch.sampled_tokens()
        coef = self.controller.value
        penalty = kl_reward_penalty(
            batch.scores, old_logprobs, ref_logprobs, sampled, kind=self.kind, coef=coef
        )
        advantages = response_advantages(
            penalty.scores, batch.group_index, sampled, self.adv_estimator, self.norm_adv_by_std
        )
        self.controller.update(penalty.current_kl, n_steps=len(batch))
        batch = replace(
            batch,
            scores=penalty.scores,
            advantages=advantages,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
        )
        metrics = {
            "actor/reward_kl_penalty": penalty.current_kl,
            "actor/reward_kl_penalty_coeff": coef,
            **advantage_metrics(advantages),
        }
        return batch, metrics

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state)
