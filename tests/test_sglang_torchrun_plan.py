"""Which torchrun node starts which SGLang engine (`sglang.torchrun.torchrun_plans`): pure
arithmetic on what every rank reports, so every rank computes the same plan."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_dapo.config import ConfigError
from megatron_dapo.sglang.torchrun import RankInfo, route_address, torchrun_plans


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


def test_a_guessed_loopback_node_address_stops_a_multi_node_run_with_one_line():
    # the host name resolves to 127.0.1.1 (a common /etc/hosts) on node 1: the other nodes would
    # get URLs pointing at themselves (before: planned silently, rank 0 then failed to connect)
    ranks = [
        RankInfo(0, "10.0.0.10", 0, 0, "the route to MASTER_ADDR=node0"),
        RankInfo(1, "127.0.1.1", 0, 0, "the address of host name node1"),
    ]
    with pytest.raises(ConfigError) as e:
        torchrun_plans(_cfg(2, 1), ranks, cpu=True)
    msg = str(e.value)
    assert "\n" not in msg
    assert "node 1's address is 127.0.1.1 (from the address of host name node1)" in msg
    assert "set MEGATRON_DAPO_NODE_IP on every node" in msg


def test_loopback_is_fine_when_set_explicitly_or_on_one_node():
    explicit = [RankInfo(0, "127.0.0.1", 0, 0), RankInfo(1, "127.0.0.1", 0, 0)]  # a localhost simulation
    assert len(torchrun_plans(_cfg(2, 1), explicit, cpu=True)) == 2
    one = [RankInfo(0, "127.0.1.1", r, 0, "the address of host name n") for r in range(2)]
    assert len(torchrun_plans(_cfg(2, 1), one, cpu=True)) == 2


def test_node_address_prefers_the_env_then_the_route_to_master_addr(monkeypatch):
    from megatron_dapo.sglang import torchrun as st

    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MEGATRON_DAPO_NODE_IP", "10.9.9.9")
    assert st.node_address() == ("10.9.9.9", "MEGATRON_DAPO_NODE_IP")
    monkeypatch.delenv("MEGATRON_DAPO_NODE_IP")
    # the interface that reaches MASTER_ADDR is the one the other nodes share with this one
    monkeypatch.setattr(st, "route_address", lambda host: {"node0": "10.1.2.3"}.get(host))
    assert st.node_address() == ("10.1.2.3", "the route to MASTER_ADDR=node0")
    # a route over loopback (MASTER_ADDR is this node, named 127.x) says nothing: the host name's
    monkeypatch.setattr(st, "route_address", lambda host: "127.0.0.1")
    assert st.node_address()[1].startswith("the address of host name ")


def test_route_address_asks_the_kernel():
    # a UDP connect picks the route and source address without sending anything
    assert route_address("127.0.0.1") == "127.0.0.1"
    assert route_address("no-such-host.invalid") is None
