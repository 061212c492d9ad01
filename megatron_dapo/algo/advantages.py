"""Group-relative (GRPO/DAPO) outcome advantages."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_dapo.algo.groups import group_ids


def group_advantages(
    scores: torch.Tensor,
    group_index: Sequence | torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sample advantage ``(score - group mean) / (group std + eps)``.

    Semantics are those of verl's ``compute_grpo_outcome_advantage``:

    - the std is the unbiased (n - 1) sample std of the group's scores;
    - a group with a single sample gets mean 0 and std 1, so its advantage is
      ``score / (1 + eps)`` (or ``score`` when ``norm_by_std`` is False);
    - ``norm_by_std=False`` gives Dr.GRPO's ``score - group mean``.

    Args:
        scores: (B,) float tensor, one scalar reward per response (shaping included).
        group_index: length-B group key per sample (ints, strings or a tensor). Groups need
            not be contiguous.
        norm_by_std: divide by the group std (GRPO/DAPO) or not (Dr.GRPO).
        eps: added to the std.

    Returns:
        (B,) tensor of scores' dtype (at least float32). Not part of any autograd graph.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (one score per response), got shape {tuple(scores.shape)}")
    ids, num_groups = group_ids(group_index, scores.shape[0], scores.device)
    dtype = torch.promote_types(scores.dtype, torch.float32)
    x = scores.detach().to(dtype)

    counts = torch.zeros(num_groups, dtype=dtype, device=x.device).index_add_(0, ids, torch.ones_like(x))
    sums = torch.zeros(num_groups, dtype=dtype, device=x.device).index_add_(0, ids, x)
    mean = sums / counts
    sq_dev = torch.zeros(num_groups, dtype=dtype, device=x.device).index_add_(0, ids, (x - mean[ids]) ** 2)
    # counts - 1 is 0 for singleton groups; their std is overridden below, clamp only avoids 0/0.
    std = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))

    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)

    adv = x - mean[ids]
    if norm_by_std:
        adv = adv / (std[ids] + eps)
    return adv
