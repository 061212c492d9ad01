"""The RL algorithm core, pure torch (no torch.distributed, no Megatron).

Public API: :func:`policy_loss` (loss types :data:`POLICY_LOSS_TYPES`, per-token terms in
:data:`POLICY_LOSSES`), :func:`agg_loss` and :class:`Aggregation`, :func:`sequence_weights`, :func:`sequence_pieces`,
:func:`kl_penalty`, :func:`kl_reward_penalty`, :func:`kl_loss`, :func:`entropy_loss`,
:func:`kl_controller`, :func:`outcome_advantages`, :func:`group_advantages`,
:func:`overlong_penalty`, :func:`mixed_group_mask`, :class:`RolloutCorrection`,
:func:`correction_terms`.

Dr. GRPO is ``outcome_advantages(..., estimator="grpo", norm_adv_by_std_in_grpo=False)`` with
``loss_agg_mode="seq-mean-token-sum-norm"`` (see :mod:`megatron_dapo.algo.advantages`).
"""

from megatron_dapo.algo.advantages import ADV_ESTIMATORS, group_advantages, outcome_advantages
from megatron_dapo.algo.aggregation import LOSS_AGG_MODES, Aggregation, agg_loss, sequence_weights
from megatron_dapo.algo.group_filter import mixed_group_mask
from megatron_dapo.algo.kl import KL_PENALTY_KINDS, KLRewardPenalty, kl_penalty, kl_reward_penalty
from megatron_dapo.algo.kl_control import (
    KL_CONTROL_TYPES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    kl_controller,
)
from megatron_dapo.algo.loss_terms import (
    POLICY_LOSS_TYPES,
    POLICY_LOSSES,
    LossParams,
    SequencePieces,
    TokenTerms,
    sequence_pieces,
)
from megatron_dapo.algo.overlong import overlong_penalty
from megatron_dapo.algo.policy_loss import policy_loss
from megatron_dapo.algo.regularizers import entropy_loss, kl_loss
from megatron_dapo.algo.rollout_correction import RolloutCorrection, correction_terms

__all__ = [
    "ADV_ESTIMATORS",
    "KL_CONTROL_TYPES",
    "KL_PENALTY_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "POLICY_LOSS_TYPES",
    "AdaptiveKLController",
    "Aggregation",
    "FixedKLController",
    "KLController",
    "KLRewardPenalty",
    "LossParams",
    "RolloutCorrection",
    "SequencePieces",
    "TokenTerms",
    "agg_loss",
    "correction_terms",
    "entropy_loss",
    "group_advantages",
    "kl_controller",
    "kl_loss",
    "kl_penalty",
    "kl_reward_penalty",
    "mixed_group_mask",
    "outcome_advantages",
    "overlong_penalty",
    "policy_loss",
    "sequence_pieces",
    "sequence_weights",
]
