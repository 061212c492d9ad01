"""`train` compares the GPUs its layout places with the Ray cluster's before it asks for a placement
group: a cluster too small stops the run in one line naming both numbers, instead of
`ray.get(pg.ready(), timeout=300)` waiting five minutes for GPUs that are not there."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.driver.launch import Placement, check_cluster_size

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "dapo_qwen2.5_32b.yaml"


class FakeRay(types.ModuleType):
    """The part of `ray` Placement touches before its placement group; records what it was asked."""

    def __init__(self, gpus: int):
        super().__init__("ray")
        self.gpus = gpus
        self.asked: list[str] = []

    def is_initialized(self) -> bool:
        return True  # joined a cluster already (trainer.ray_address)

    def cluster_resources(self) -> dict:
        self.asked.append("cluster_resources")
        return {"CPU": 64.0 * self.gpus / 8, "GPU": float(self.gpus)}


@pytest.fixture
def fake_ray(monkeypatch):
    def install(gpus: int) -> FakeRay:
        ray = FakeRay(gpus)
        util = types.ModuleType("ray.util")
        pg = types.ModuleType("ray.util.placement_group")

        def placement_group(*args, **kwargs):
            ray.asked.append("placement_group")
            raise RuntimeError("stop here: the test only reaches the placement group")

        pg.placement_group = placement_group
        util.placement_group = pg
        ray.util = util
        for name, module in (("ray", ray), ("ray.util", util), ("ray.util.placement_group", pg)):
            monkeypatch.setitem(sys.modules, name, module)
        return ray

    return install


def test_train_with_more_actor_ranks_than_the_clusters_gpus_stops_in_one_line(fake_ray):
    cfg = load_config(RECIPE, ["trainer.ray_address=10.0.0.1:6379"])
    ray = fake_ray(32)
    with pytest.raises(ConfigError) as e:
        Placement(cfg, "cuda", "sglang")
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(
        "the layout places 128 GPUs (parallel.actor_world_size=128, rollout.num_engines=32, "
        "trainer.placement=colocated) but the Ray cluster at 10.0.0.1:6379 has 32"
    )
    assert "megatron-dapo plan CONFIG --num-gpus 32" in line
    assert ray.asked == ["cluster_resources"]  # never asked for the placement group
    # a cluster that has them goes on to the placement group
    ray = fake_ray(128)
    with pytest.raises(RuntimeError, match="stop here"):
        Placement(cfg, "cuda", "sglang")
    assert ray.asked == ["cluster_resources", "placement_group"]


def test_disaggregated_engines_and_cpu_bundles_are_counted():
    cfg = load_config(
        RECIPE,
        ["trainer.placement=disaggregated", "trainer.rollout_gpus=64", "parallel.actor_world_size=64",
         "rollout.num_engines=16"],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="places 128 GPUs .* has 96"):
        check_cluster_size(cfg, "cuda", [], {"GPU": 96.0})
    check_cluster_size(cfg, "cuda", [], {"GPU": 128.0})
    with pytest.raises(ConfigError, match="places 3 CPUs .* has 2: lower parallel.actor_world_size"):
        check_cluster_size(cfg, "cpu", [{"CPU": 1}] * 3, {"CPU": 2.0})


@pytest.mark.parametrize(
    "recipe, overrides",
    [
        ("dapo_qwen2.5_32b.yaml", []),
        ("dapo_qwen2.5_7b.yaml", ["trainer.placement=disaggregated", "trainer.rollout_gpus=4"]),
        ("dapo_judge_qwen2.5_7b.yaml", []),
        ("dapo_judge_qwen2.5_7b.yaml", ["reward.model.placement=colocated"]),
        ("retool_qwen2.5_32b.yaml", []),
    ],
)
def test_the_driver_counts_the_gpus_as_the_planner_does(recipe, overrides):
    from megatron_dapo.driver.launch import layout_gpus as driver_count
    from megatron_dapo.plan.sizing import layout_gpus as planner_count

    cfg = load_config(REPO / "configs" / recipe, overrides)
    assert driver_count(cfg) == planner_count(cfg)
