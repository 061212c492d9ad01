"""Rollout samples -> the actor's batch: DAPO advantages, masks and rollout log-probs.

Advantages are computed from the final rewards (score + overlong penalty) of each group by
`algorithm.adv_estimator` (grpo, rloo, reinforce_plus_plus_baseline: `algo.outcome_advantages`),
as verl does; with `algorithm.overlong_filter` truncated responses are masked out of the loss
(they still count in the group statistics, and in reinforce_plus_plus_baseline's whitening over
the batch's response tokens, which is what DAPO's overlong filtering means).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_dapo.actor.batch import ActorBatch
from megatron_dapo.algo import outcome_advantages


def build_actor_batch(
    samples: Sequence,
    *,
    adv_estimator: str = "grpo",
    norm_adv_by_std: bool = True,
    overlong_filter: bool = False,
    groups_multiple: int = 1,
) -> tuple[ActorBatch, dict[str, float]]:
    """`samples`: RolloutSample-like objects (group_id, prompt.prompt_ids, response_ids,
    rollout_logprobs, final_reward, truncated). Returns the batch and advantage metrics.

    A partial batch (`algorithm.allow_partial_batch`) is cut to a whole number of optimizer
    mini-batches (`groups_multiple` groups each), dropping its last groups; the number dropped is
    reported as `train/partial_groups_dropped`.
    """
    if not samples:
        raise ValueError("no rollout samples to train on")
    order = list(dict.fromkeys(s.group_id for s in samples))
    usable = len(order) // groups_multiple * groups_multiple
    if usable == 0:
        raise ValueError(
            f"the rollout step kept {len(order)} groups, fewer than one optimizer mini-batch "
            f"(actor.ppo_mini_batch_size={groups_multiple}); raise algorithm.filter_groups.max_num_gen_batches "
            "or lower actor.ppo_mini_batch_size"
        )
    keep_groups = set(order[:usable])
    dropped = len(order) - usable
    # a response the reward model could not score leaves its group: its advantage would be
    # computed from a score it does not have (the group filter kept only groups that still have
    # two scored responses)
    unscored = sum(s.unscored is not None for s in samples if s.group_id in keep_groups)
    samples = [s for s in samples if s.group_id in keep_groups and s.unscored is None]
    # group ids may be any integers; make them dense so the actor can form mini-batches
    dense: dict[int, int] = {}
    group_index = torch.tensor([dense.setdefault(s.group_id, len(dense)) for s in samples], dtype=torch.int64)
    rewards = torch.tensor([float(s.final_reward) for s in samples], dtype=torch.float32)
    prompt_lens = torch.tensor([len(s.prompt.prompt_ids) for s in samples], dtype=torch.int64)
    response_lens = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.int64)
    if (response_lens < 1).any():
        i = int((response_lens < 1).nonzero()[0])
        raise ValueError(f"rollout sample {i} (group {samples[i].group_id}) has an empty response")
    width = int(response_lens.max())
    sampled = torch.arange(width).unsqueeze(0) < response_lens.unsqueeze(1)
    multi_turn = any(s.loss_mask is not None for s in samples)
    for i, s in enumerate(samples):
        if s.loss_mask is not None:  # multi-turn: the environment's tokens are not
            sampled[i, : len(s.loss_mask)] = torch.as_tensor(s.loss_mask, dtype=torch.bool)
    advantages = response_advantages(rewards, group_index, sampled, adv_estimator, norm_adv_by_std)
    truncated = torch.tensor([bool(s.truncated) for s in samples])
    mask = sampled.clone()
    if overlong_filter:
        mask &= ~truncated.unsqueeze(1)
    rollout_lp = torch.zeros(len(samples), width, dtype=torch.float32)
    for i, s in enumerate(samples):
        lp = s.rollout_logprobs
        if lp is not None and len(lp):
            rollout_lp[i, : len(lp)] = torch.as_tensor(lp, dtype=torch.float32)
    input_ids = [
        torch.tensor(list(s.prompt.prompt_ids) + list(s.response_ids), dtype=torch.int64) for s in samples
    ]
    batch = ActorBatch(
        input_ids=input_ids,
        prompt_lens=prompt_lens,
        response_lens=response_lens,
        response_mask=mask,
        advantages=advantages,
        group_index=group_index,
        rollout_logprobs=rollout_lp,
        scores=rewards,
        metadata=[{"group_id": s.group_id, "index": s.prompt.index} for s in samples],
        routed_experts=_routed_experts(samples),
        sampled_mask=sampled if multi_turn else None,
    )
    metrics = {
        **advantage_metrics(advantages),
        "train/overlong_filtered": float(truncated.sum()) if overlong_filter else 0.0,
        "train/num_samples": float(len(samples)),
        "train/num_groups": float(len(dense)),
        "train/partial_groups_dropped": float(dropped),
        "train/unscored_left_out": float(unscored),
        "rollout/mean_token_prob": float((rollout_lp.exp() * mask).sum() / mask.sum().clamp(min=1)),
    }
    return batch, metrics


def response_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    sampled: torch.Tensor,
    adv_estimator: str,
    norm_adv_by_std: bool,
) -> torch.Tensor:
    """``[B]``: each response's advantage from its reward (every estimator gives one value per
    response, on each of its tokens; reinforce_plus_plus_baseline whitens over the sampled tokens
    ``sampled`` ``[B, R]``: truncated responses' included, the environment's tokens not)."""
    return outcome_advantages(
        rewards, group_index, sampled, adv_estimator, norm_adv_by_std_in_grpo=norm_adv_by_std
    )[:, 0].contiguous()


def advantage_metrics(advantages: torch.Tensor) -> dict[str, float]:
    return {
        "train/advantages/mean": float(advantages.mean()),
        "train/advantages/max": float(advantages.max()),
        "train/advantages/min": float(advantages.min()),
    }


def _routed_experts(samples: Sequence) -> list | None:
    """The engines' recorded experts per sample (MoE routing replay), when every sample has them."""
    experts = [getattr(s, "routed_experts", None) for s in samples]
    if any(e is None for e in experts):
        return None
    return [torch.as_tensor(e) for e in experts]
