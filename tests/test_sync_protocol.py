"""Every weight transport is a `sync.protocol.WeightTransport`, which is how the driver and the
ranks use it (no probing for optional methods): `every_rank`, begin/send/finish, drop, reset. One
timeout error and one bucket description serve every transport."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.driver.actor_worker import ActorWorker
from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.sync.protocol import WeightSyncTimeoutError, WeightTransport, describe_bucket
from megatron_dapo.sync.sglang_transports import (
    EngineEndpoint,
    SGLangDiskTransport,
    SGLangIPCTransport,
    SGLangNCCLTransport,
    SGLangRankIPCTransport,
)
from megatron_dapo.sync.transports import DirectTransport, DiskTransport, RayObjectTransport


class Named:
    def __init__(self, name):
        self.name = name


def endpoints():
    # two single-GPU engines, each with the trainer rank on its GPU (what the per-rank IPC needs)
    return [
        EngineEndpoint("sg-0", "http://127.0.0.1:1", ipc_ranks=(0,)),
        EngineEndpoint("sg-1", "http://127.0.0.1:2", ipc_ranks=(1,)),
    ]


def every_transport(tmp_path):
    return {
        DirectTransport: DirectTransport([Named("sg-0"), Named("sg-1")]),
        RayObjectTransport: RayObjectTransport([("sg-0", None), ("sg-1", None)], timeout_s=1),
        DiskTransport: DiskTransport([("sg-0", None), ("sg-1", None)], tmp_path / "d", timeout_s=1),
        SGLangIPCTransport: SGLangIPCTransport(endpoints(), timeout_s=1),
        SGLangRankIPCTransport: SGLangRankIPCTransport(endpoints(), timeout_s=1),
        SGLangNCCLTransport: SGLangNCCLTransport(endpoints(), timeout_s=1, backend="gloo"),
        SGLangDiskTransport: SGLangDiskTransport(endpoints(), tmp_path / "s", timeout_s=1),
    }


SGLANG = (SGLangIPCTransport, SGLangRankIPCTransport, SGLangNCCLTransport, SGLangDiskTransport)


def names_of(transport) -> list[str]:
    if isinstance(transport, SGLANG):
        return [ep.name for ep in transport.calls.endpoints]
    return [e.name if isinstance(e, Named) else e[0] for e in transport.engines]


def test_every_transport_is_a_weight_transport_and_only_per_rank_ipc_runs_on_every_rank(tmp_path):
    transports = every_transport(tmp_path)
    assert len(transports) == 7
    for cls, t in transports.items():
        assert isinstance(t, WeightTransport), cls.__name__
    assert [cls.__name__ for cls, t in transports.items() if t.every_rank] == ["SGLangRankIPCTransport"]


def test_drop_leaves_every_transport_sending_to_the_other_engines(tmp_path):
    for cls, t in every_transport(tmp_path).items():
        t.drop({"sg-0"})
        assert names_of(t) == ["sg-1"], cls.__name__
        t.reset()  # nothing to forget, or a new group at the next sync: never an error
        assert names_of(t) == ["sg-1"], cls.__name__


def test_a_rank_takes_only_a_weight_transport_and_resets_and_drops_through_it(tmp_path):
    worker = ActorWorker({})
    worker.reset_transport()  # no transport (ranks other than 0): nothing to do
    worker.drop_engines(["sg-0"])
    with pytest.raises(TypeError, match="object is not a sync.protocol.WeightTransport"):
        worker.attach_transport(object())
    nccl = SGLangNCCLTransport(endpoints(), timeout_s=1, backend="gloo")
    worker.attach_transport(nccl)
    first = nccl.group_name
    worker.reset_transport()
    assert nccl.group_name != first  # a restarted server joins a new group
    worker.drop_engines(["sg-1"])
    assert names_of(nccl) == ["sg-0"]


def test_one_timeout_error_is_an_engine_error_and_names_buckets_one_way():
    assert issubclass(WeightSyncTimeoutError, EngineError)
    bucket = {"model.embed_tokens.weight": torch.zeros(256, 1024), "lm_head.weight": torch.zeros(256, 1024)}
    # 2 x 256 x 1024 fp32 = 2 MiB
    assert (
        describe_bucket(4, bucket)
        == "bucket 4 (2 tensors, 2.0 MiB: model.embed_tokens.weight .. lm_head.weight)"
    )
    assert describe_bucket(0, {"lm_head.weight": torch.zeros(1, dtype=torch.bfloat16)}) == (
        "bucket 0 (1 tensors, 0.0 MiB: lm_head.weight)"
    )
