"""Rule-based rewards: the DAPO math rule, the data_source registry, fault-isolated scoring."""

from megatron_dapo.rewards.registry import UnknownDataSourceError, load_custom_fn
from megatron_dapo.rewards.scorer import RewardResult, RewardWorkerError, Scorer

__all__ = ["RewardResult", "RewardWorkerError", "Scorer", "UnknownDataSourceError", "load_custom_fn"]
