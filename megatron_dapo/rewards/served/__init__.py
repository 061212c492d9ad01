"""Rewards from a served model (``reward.model``): a classifier reward model on SGLang's
``/classify``, or a generative judge; outcomes that say why a sample is unscored instead of
scoring it 0; the checkpoint copy that corrects SGLang's classifier head, and the start-up check
that the served model scores as transformers does.

Modules: ``outcome`` (what goes in and out), ``transport`` (retries, in-flight bound, down
servers), ``classifier``, ``judge`` (and its verdict parsers), ``client`` (one reward model,
async and blocking), ``checkpoint`` (the served copy), ``startup_check``, ``combine``
(``reward.combine``), ``settings`` (the config section, the servers to start).
"""

from megatron_dapo.rewards.served.checkpoint import ServedCheckpoint, prepare_served_checkpoint
from megatron_dapo.rewards.served.client import BlockingRewardModel, RewardModel, open_reward_model
from megatron_dapo.rewards.served.combine import CombinedReward, Combiner
from megatron_dapo.rewards.served.judge import DEFAULT_PROMPT_TEMPLATE, parse_boxed_score, parse_yes_no
from megatron_dapo.rewards.served.outcome import (
    UNSCORED_REASONS,
    RewardModelError,
    RewardRequestError,
    RewardSample,
    RewardServerDown,
    ScoreOutcome,
)
from megatron_dapo.rewards.served.settings import (
    RewardServerSpec,
    ServedRewardSettings,
    server_specs,
    settings_from_config,
)
from megatron_dapo.rewards.served.startup_check import ProbeCheck, check_classifier_server, probe_tolerance

__all__ = [
    "DEFAULT_PROMPT_TEMPLATE",
    "UNSCORED_REASONS",
    "BlockingRewardModel",
    "CombinedReward",
    "Combiner",
    "ProbeCheck",
    "RewardModel",
    "RewardModelError",
    "RewardRequestError",
    "RewardSample",
    "RewardServerDown",
    "RewardServerSpec",
    "ScoreOutcome",
    "ServedCheckpoint",
    "ServedRewardSettings",
    "check_classifier_server",
    "open_reward_model",
    "parse_boxed_score",
    "parse_yes_no",
    "prepare_served_checkpoint",
    "probe_tolerance",
    "server_specs",
    "settings_from_config",
]
