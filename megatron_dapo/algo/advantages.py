"""Outcome advantages: one scalar score per response, a baseline from its group (the responses
to the same prompt), the same advantage on every token of the response.

Estimators, by verl's ``algorithm.adv_estimator`` names (see :func:`outcome_advantages`):

- ``grpo``: ``(score - group mean) / (group std + eps)`` (GRPO, DAPO).
- ``rloo``: ``score - mean of the other responses of the group`` (Ahmadian et al. 2024).
- ``reinforce_plus_plus_baseline``: ``score - group mean``, then whitened over all response
  tokens of the batch (REINFORCE++, Hu 2025, arXiv:2501.03262).

**Dr. GRPO** (Liu et al. 2025, arXiv:2503.20783) is not a separate estimator: it is ``grpo``
with ``norm_adv_by_std_in_grpo=False`` (no division by the group std) together with the loss
aggregation ``seq-mean-token-sum-norm`` (each response's token sum divided by a constant length,
not by its own length; see :func:`~megatron_dapo.algo.aggregation.agg_loss`), as in verl.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_dapo.algo.groups import group_ids

ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")

# verl's masked_whiten: var + 1e-8 under the square root, so a batch of equal scores stays finite.
_WHITEN_EPS = 1e-8


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


def outcome_advantages(
    scores: torch.Tensor,
    group_index: Sequence | torch.Tensor,
    mask: torch.Tensor,
    estimator: str = "grpo",
    norm_adv_by_std_in_grpo: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """(B, T) advantages: each response's outcome advantage on its response tokens, 0 elsewhere.

    As verl's ``compute_<estimator>_outcome_advantage`` with ``token_level_rewards`` holding
    ``scores`` (their sum over a response is its score):

    - ``grpo``: :func:`group_advantages` (``norm_adv_by_std_in_grpo=False``: Dr. GRPO's
      ``score - group mean``).
    - ``rloo``: in a group of ``n > 1`` responses, ``n / (n - 1) * (score - group mean)``, i.e.
      the score minus the mean of the other ``n - 1``; a response alone in its group keeps its
      score (verl does the same).
    - ``reinforce_plus_plus_baseline``: ``x = score - group mean`` (a group of one: mean 0) on
      every response token, then ``(x - m) / sqrt(v + 1e-8)`` with ``m`` and ``v`` the mean and
      unbiased variance of ``x`` over the batch's response tokens (so a long response weighs
      more in them). Needs at least 2 response tokens in the batch. verl divides the sums by
      ``count + 1e-8``; here by the exact count.

    Args:
        scores: (B,) one scalar reward per response (shaping and any KL penalty included).
        group_index: length-B group key per response (ints, strings or a tensor); groups need
            not be contiguous.
        mask: (B, T) response mask (bool or 0/1): the tokens the advantage is placed on.
        estimator: one of :data:`ADV_ESTIMATORS`.
        norm_adv_by_std_in_grpo: ``grpo`` only: divide by the group std.
        eps: ``grpo`` only: added to the group std.

    Returns:
        (B, T) tensor of the scores' dtype (at least float32), no autograd graph.
    """
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"unknown adv_estimator {estimator!r}; choose one of {', '.join(ADV_ESTIMATORS)}")
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (one score per response), got shape {tuple(scores.shape)}")
    if mask.dim() != 2 or mask.shape[0] != scores.shape[0]:
        raise ValueError(f"mask must be (B, T) with B = {scores.shape[0]} responses, got {tuple(mask.shape)}")
    keep = mask.bool()
    dtype = torch.promote_types(scores.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=scores.device)
    if estimator == "grpo":
        adv = group_advantages(scores, group_index, norm_by_std=norm_adv_by_std_in_grpo, eps=eps)
        return torch.where(keep, adv.unsqueeze(-1), zero)

    ids, num_groups = group_ids(group_index, scores.shape[0], scores.device)
    x = scores.detach().to(dtype)
    counts = torch.zeros(num_groups, dtype=dtype, device=x.device).index_add_(0, ids, torch.ones_like(x))
    mean = torch.zeros(num_groups, dtype=dtype, device=x.device).index_add_(0, ids, x) / counts
    n, centred = counts[ids], x - mean[ids]
    if estimator == "rloo":
        adv = torch.where(n > 1, centred * n / (n - 1).clamp(min=1), x)
        return torch.where(keep, adv.unsqueeze(-1), zero)

    adv = torch.where(n > 1, centred, x)  # a group of one has baseline 0
    tokens = torch.where(keep, adv.unsqueeze(-1), zero)
    count = keep.sum()
    if count < 2:
        raise ValueError(
            "adv_estimator=reinforce_plus_plus_baseline whitens over the batch's response tokens and "
            f"needs at least 2, got {int(count)}"
        )
    m = tokens.sum() / count
    v = torch.where(keep, (tokens - m) ** 2, zero).sum() / (count - 1)
    return torch.where(keep, (tokens - m) * torch.rsqrt(v + _WHITEN_EPS), zero)
