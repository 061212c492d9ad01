"""The DAPO algorithm core, pure torch (no torch.distributed, no Megatron).

Public API: :func:`group_advantages`, :func:`policy_loss`, :func:`agg_loss`,
:func:`sequence_weights`, :func:`overlong_penalty`, :func:`mixed_group_mask`,
:class:`RolloutCorrection`, :func:`correction_terms`.
"""

from megatron_dapo.algo.advantages import group_advantages
from megatron_dapo.algo.aggregation import LOSS_AGG_MODES, agg_loss, sequence_weights
from megatron_dapo.algo.group_filter import mixed_group_mask
from megatron_dapo.algo.overlong import overlong_penalty
from megatron_dapo.algo.policy_loss import policy_loss
from megatron_dapo.algo.rollout_correction import RolloutCorrection, correction_terms

__all__ = [
    "LOSS_AGG_MODES",
    "RolloutCorrection",
    "agg_loss",
    "correction_terms",
    "group_advantages",
    "mixed_group_mask",
    "overlong_penalty",
    "policy_loss",
    "sequence_weights",
]
