"""DAPO dynamic sampling: which groups carry a learning signal."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_dapo.algo.groups import group_ids


def mixed_group_mask(metric: torch.Tensor, group_index: Sequence | torch.Tensor) -> torch.Tensor:
    """(B,) bool: True for samples whose group's metric is not constant, or whose group has one sample.

    verl keeps a group when ``np.std(metric) > 0`` (population std) or it has one sample. A
    population std is positive exactly when the group's max differs from its min; comparing max
    and min avoids the rounding noise of a floating-point std (``np.std([0.1] * 3)`` is ~1e-17,
    not 0, which would wrongly keep a tied group).

    Args:
        metric: (B,) per-sample metric (acc, score, ...); bool or numeric.
        group_index: length-B group keys (ints, strings or a tensor); need not be contiguous.
    """
    if metric.dim() != 1:
        raise ValueError(f"metric must be 1-D (one value per response), got shape {tuple(metric.shape)}")
    x = metric.detach().to(torch.float64)
    if torch.isnan(x).any():
        raise ValueError("metric contains NaN; fix the reward/metric before group filtering")
    ids, num_groups = group_ids(group_index, x.shape[0], x.device)
    group_max = torch.full((num_groups,), -torch.inf, dtype=x.dtype, device=x.device).scatter_reduce(
        0, ids, x, reduce="amax"
    )
    group_min = torch.full((num_groups,), torch.inf, dtype=x.dtype, device=x.device).scatter_reduce(
        0, ids, x, reduce="amin"
    )
    counts = torch.zeros(num_groups, dtype=torch.long, device=x.device).index_add_(
        0, ids, torch.ones_like(ids)
    )
    keep = (group_max > group_min) | (counts == 1)
    return keep[ids]
