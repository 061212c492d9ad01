"""Cluster placement of trainer ranks and SGLang engines, as pure arithmetic (no Ray, no GPU).

The expected plans are written out by hand from the 32B recipe's shape (16 nodes x 8 GPUs,
128 trainer ranks, 32 engines x TP4), not computed by the code under test.
"""

from __future__ import annotations

import random

import pytest

from megatron_dapo.config import ConfigError
from megatron_dapo.sglang.placement import GpuSlot, plan_engines, rank_order


def cluster(nodes: int, gpus: int) -> list[GpuSlot]:
    # node ids are random hex in Ray; addresses order the nodes
    return [
        GpuSlot(f"id{(n * 7919) % 97:02x}", f"10.0.0.{10 + n}", g) for n in range(nodes) for g in range(gpus)
    ]


def test_ranks_follow_node_then_gpu_not_bundle_index():
    slots = cluster(16, 8)
    shuffled = slots[:]
    random.Random(0).shuffle(shuffled)  # how Ray may number the bundles of a placement group
    order = rank_order(shuffled)
    assert sorted(order) == list(range(128))
    assert [shuffled[b] for b in order] == slots  # rank r on node r // 8, GPU r % 8


def test_32_engines_tp4_on_16_nodes_colocated():
    actor = cluster(16, 8)  # rank r = node r // 8, GPU r % 8
    plans = plan_engines("colocated", actor, {s.node_id: 8 for s in actor}, 32, 4, 30000)
    assert len(plans) == 32
    for e, p in enumerate(plans):
        node, half = divmod(e, 2)
        assert p.index == e
        assert (p.node_ip, p.node_id) == (f"10.0.0.{10 + node}", actor[8 * node].node_id)
        assert p.gpus == (4 * half, 4 * half + 1, 4 * half + 2, 4 * half + 3)
        assert p.port == 30000 + half
        assert p.url == f"http://10.0.0.{10 + node}:{30000 + half}"
        # each engine TP rank's CUDA IPC handles come from the trainer rank on that very GPU
        assert p.ipc_ranks == tuple(8 * node + 4 * half + j for j in range(4))
    assert len({(p.node_id, g) for p in plans for g in p.gpus}) == 128  # no GPU used twice


def test_disaggregated_uses_the_gpus_the_actor_leaves_and_engine_only_nodes():
    actor = [GpuSlot("a", "10.0.0.1", g) for g in range(6)]
    plans = plan_engines("disaggregated", actor, {"a": 8, "b": 8}, 5, 2, 31000, node_ips={"b": "10.0.0.2"})
    assert [(p.node_ip, p.gpus, p.port) for p in plans] == [
        ("10.0.0.1", (6, 7), 31000),
        ("10.0.0.2", (0, 1), 31000),
        ("10.0.0.2", (2, 3), 31001),
        ("10.0.0.2", (4, 5), 31002),
        ("10.0.0.2", (6, 7), 31003),
    ]
    assert all(p.ipc_ranks == () for p in plans)


def test_engines_never_span_nodes_and_the_error_counts_per_node():
    actor = cluster(2, 6)  # 6 GPUs per node: one TP4 engine each, 2 GPUs left over on each node
    with pytest.raises(
        ConfigError, match=r"num_engines=3 x .*tensor_parallel_size=4 .*10.0.0.10: 1, 10.0.0.11: 1"
    ):
        plan_engines("colocated", actor, {s.node_id: 8 for s in actor}, 3, 4, 30000)


def test_non_consecutive_actor_gpus_are_not_grouped():
    actor = [GpuSlot("a", "10.0.0.1", g) for g in (0, 1, 3, 4)]
    plans = plan_engines("colocated", actor, {"a": 8}, 2, 2, 30000)
    assert [p.gpus for p in plans] == [(0, 1), (3, 4)]
    assert [p.ipc_ranks for p in plans] == [(0, 1), (2, 3)]
    with pytest.raises(ConfigError):
        plan_engines("colocated", [GpuSlot("a", "ip", g) for g in (0, 2, 4)], {"a": 8}, 1, 2, 30000)
