"""Which GPUs of the driver's node each reward server gets (sglang/reward_servers.py), by hand for
configs/dapo_judge_qwen2.5_7b.yaml (8 actor ranks, 8 TP=1 engines on the actor's GPUs, 4 judge
servers): own GPUs after the actor's and engines', or the engines' own GPUs when colocated."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.rewards.served import settings_from_config
from megatron_dapo.sglang.reward_servers import reward_gpu_groups

RECIPE = str(Path(__file__).resolve().parents[1] / "configs" / "dapo_judge_qwen2.5_7b.yaml")


def groups(total, *overrides):
    cfg = load_config(RECIPE, list(overrides))
    return reward_gpu_groups(cfg, settings_from_config(cfg.reward), total)


def test_own_gpus_are_those_no_actor_rank_or_engine_uses(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert groups(12) == [[8], [9], [10], [11]]
    assert groups(16, "reward.model.num_servers=2", "reward.model.gpus_per_server=4") == [
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]
    with pytest.raises(
        ConfigError, match=r"needs 8 consecutive free GPUs.*leave \[8, 9, 10, 11\].*colocated"
    ):
        groups(12, "reward.model.gpus_per_server=2")


def test_colocated_servers_take_the_first_gpus_of_each_engine(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert groups(8, "reward.model.placement=colocated") == [[0], [1], [2], [3]]
    tp2 = ["rollout.tensor_parallel_size=2", "rollout.num_engines=4", "reward.model.placement=colocated"]
    assert groups(8, *tp2, "reward.model.gpus_per_server=2") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(8, *tp2, "reward.model.num_servers=2") == [[0], [2]]
    # disaggregated: the engines' GPUs follow the actor's 4
    dis = [
        "trainer.placement=disaggregated",
        "parallel.actor_world_size=4",
        "reward.model.placement=colocated",
    ]
    assert groups(12, *dis, "rollout.num_engines=8") == [[4], [5], [6], [7]]
