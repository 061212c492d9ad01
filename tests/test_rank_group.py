"""Training ranks as Ray actors form one torch.distributed world (gloo), and a failing or slow
rank surfaces as an error naming the method instead of a hang."""

import os
import time

import pytest

ray = pytest.importorskip("ray")

from megatron_dapo.driver.rank_group import RankCallError, RayRankGroup  # noqa: E402


class SumWorker:
    def setup(self):
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return int(os.environ["RANK"])

    def all_reduce(self, value):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(value) * (dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()

    def fail_on_rank1(self):
        if int(os.environ["RANK"]) == 1:
            raise ValueError("rank one is broken")
        return 0

    def sleep(self, s):
        time.sleep(s)


@pytest.fixture(scope="module")
def ray_local():
    # workers import this test module by name
    env = {"PYTHONPATH": os.path.dirname(__file__)}
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 << 20,
        runtime_env={"env_vars": env},
    )
    yield
    ray.shutdown()


def test_ray_ranks_form_a_world_and_report_errors(ray_local):
    from ray.util.placement_group import placement_group

    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    ray.get(pg.ready())
    group = RayRankGroup(SumWorker, 2, placement_group=pg)
    assert group.call("setup") == [0, 1]
    assert group.call("all_reduce", 2.0) == [6.0, 6.0]  # 2*1 + 2*2
    with pytest.raises(
        RankCallError, match="fail_on_rank1 failed on 1 rank.*rank 1: ValueError: rank one is broken"
    ):
        group.call("fail_on_rank1")
    with pytest.raises(RankCallError, match=r"sleep: ranks \[0, 1\] did not finish within 1s"):
        group.call("sleep", 5, timeout_s=1)
    group.shutdown()


def _spmd_main(rank, world_size):
    import torch.distributed as dist

    from megatron_dapo.driver.rank_group import SPMDRankGroup

    dist.init_process_group("gloo")
    worker = SumWorker()
    if rank == 0:
        group = SPMDRankGroup(worker)
        out = group.call("all_reduce", 3.0)
        group.shutdown()
        return out
    SPMDRankGroup.follow(worker)
    return "followed"


def test_spmd_group_under_torchrun_style_world():
    from megatron_dapo.actor.spawn import run_ranks

    assert run_ranks(_spmd_main, 2, timeout_s=120) == [[9.0, 9.0], "followed"]
