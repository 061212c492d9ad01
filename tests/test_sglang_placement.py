"""Cluster placement of trainer ranks and SGLang engines, as pure arithmetic (no Ray, no GPU).

The expected plans are written out by hand from the 32B recipe's shape (16 nodes x 8 GPUs,
128 trainer ranks, 32 engines x TP4), not computed by the code under test.
"""

from __future__ import annotations

import random

import pytest

from megatron_dapo.config import ConfigError
from megatron_dapo.sglang.placement import GpuSlot, plan_engines, plan_reward_servers, rank_order


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


def test_reward_servers_of_their_own_fill_the_gpus_ranks_and_engines_leave_node_by_node():
    # node a: 4 ranks on 0-3, engines on 4-5 and 6-7 (disaggregated TP2): nothing left;
    # node b (7 GPUs, engines only): one TP2 engine on 0-1, so 2-3 and 4-5 take servers and 6 is
    # left alone (a server of two needs consecutive GPUs)
    actor = [GpuSlot("a", "10.0.0.1", g) for g in range(4)]
    engines = plan_engines("disaggregated", actor, {"a": 8, "b": 7}, 3, 2, 30000, node_ips={"b": "10.0.0.2"})
    assert [(e.node_id, e.gpus) for e in engines] == [("a", (4, 5)), ("a", (6, 7)), ("b", (0, 1))]
    plans = plan_reward_servers("own", actor, {"a": 8, "b": 7}, engines, 2, 2, node_ips={"b": "10.0.0.2"})
    assert [(p.index, p.node_id, p.node_ip, p.gpus, p.port) for p in plans] == [
        (0, "b", "10.0.0.2", (2, 3), 0),
        (1, "b", "10.0.0.2", (4, 5), 0),
    ]
    with pytest.raises(
        ConfigError, match=r"num_servers=3 x gpus_per_server=2 .*10.0.0.1: \[\]; 10.0.0.2: \[2, 3, 4, 5, 6\]"
    ):
        plan_reward_servers("own", actor, {"a": 8, "b": 7}, engines, 3, 2, node_ips={"b": "10.0.0.2"})


def test_colocated_reward_servers_take_the_first_gpus_of_engine_i():
    actor = [GpuSlot("a", "10.0.0.1", g) for g in range(8)]
    engines = plan_engines("colocated", actor, {"a": 8}, 4, 2, 30000)
    plans = plan_reward_servers("colocated", actor, {"a": 8}, engines, 3, 1)
    assert [(p.node_id, p.gpus) for p in plans] == [("a", (0,)), ("a", (2,)), ("a", (4,))]
    with pytest.raises(ConfigError, match=r"5 servers need 5 engines of at least 1 GPUs.*\[2, 2, 2, 2\]"):
        plan_reward_servers("colocated", actor, {"a": 8}, engines, 5, 1)
