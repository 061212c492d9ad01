"""``reward.model`` for a run: the servers it starts (or the one it is given), the client that
scores with them, and ``reward.combine``; nothing when ``reward.model.kind`` is null."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_dapo.eval.served import ServedScorer
from megatron_dapo.rewards.served import BlockingRewardModel, Combiner, settings_from_config
from megatron_dapo.sglang.placement import EnginePlan
from megatron_dapo.sglang.reward_servers import RewardServers


class ServedReward:
    """What the rollout manager scores with besides the rule reward (``model`` None when off)."""

    def __init__(
        self, model: BlockingRewardModel | None, combiner: Combiner | None, servers: RewardServers | None
    ):
        self.model = model
        self.combiner = combiner
        self.servers = servers

    @classmethod
    def start(cls, cfg: Any, run_root: str | Path, plans: Sequence[EnginePlan] | None = None) -> ServedReward:
        """The model of ``reward.model``, its servers started (on ``plans``' nodes when given,
        else on this node) when it has a ``path``."""
        settings = settings_from_config(cfg.reward)
        if settings is None:
            return cls(None, None, None)
        servers = RewardServers.launch(cfg, settings, run_root, plans) if settings.path is not None else None
        try:
            model = BlockingRewardModel(settings, servers.urls if servers else None)
        except BaseException:
            if servers is not None:
                servers.stop()
            raise
        if servers is not None:
            servers.watch(model)
        return cls(model, Combiner(settings.combine), servers)

    def val_scorer(self, rule: Any) -> ServedScorer:
        """What validation scores with: this model (left open: the run closes it) and ``reward.combine``."""
        return ServedScorer(lambda: self.model, combine=self.combiner.spec, rule=rule)

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
        if self.servers is not None:
            self.servers.stop()
