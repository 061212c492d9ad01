"""Which torchrun node starts which SGLang engine (`sglang_torchrun.torchrun_plans`): pure
arithmetic on what every rank reports, so every rank computes the same plan."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_dapo.driver.sglang_torchrun import RankInfo, torchrun_plans


def _cfg(num_engines: int, tp: int, placement: str = "colocated"):
    return SimpleNamespace(
        rollout=SimpleNamespace(
            num_engines=num_engines,
            tensor_parallel_size=tp,
            sglang=SimpleNamespace(base_port=30000, host="127.0.0.1"),
        ),
        trainer=SimpleNamespace(placement=placement),
    )


def test_32b_recipe_16_nodes_every_node_starts_its_two_engines_with_their_ipc_owners():
    # torchrun: global rank r = node r // 8, LOCAL_RANK r % 8 (its GPU)
    ranks = [RankInfo(r // 8, f"10.0.0.{10 + r // 8}", r % 8, 8) for r in range(128)]
    plans = torchrun_plans(_cfg(32, 4), ranks, cpu=False)
    assert len(plans) == 32
    for p in plans:
        node = p.index // 2
        assert p.node_id == f"node{node}" and p.node_ip == f"10.0.0.{10 + node}"
        assert len(p.gpus) == 4 and p.port == 30000 + p.index % 2
        # exactly one payload per engine TP rank, each from the trainer rank on that node and GPU
        assert len(p.ipc_ranks) == 4
        for gpu, r in zip(p.gpus, p.ipc_ranks):
            assert (ranks[r].node_rank, ranks[r].local_rank) == (node, gpu)
    owners = [r for p in plans for r in p.ipc_ranks]
    assert sorted(owners) == list(range(128))  # no rank serializes twice, none is skipped


def test_cpu_servers_alternate_over_the_nodes():
    ranks = [RankInfo(0, "127.0.0.1", 0, 0), RankInfo(1, "127.0.0.2", 0, 0)]
    plans = torchrun_plans(_cfg(3, 1), ranks, cpu=True)
    assert [(p.index, p.node_id, p.node_ip, p.port) for p in plans] == [
        (0, "node0", "127.0.0.1", 0),
        (1, "node1", "127.0.0.2", 0),
        (2, "node0", "127.0.0.1", 0),
    ]
