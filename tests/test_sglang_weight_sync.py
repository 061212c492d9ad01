"""NCCL-path sender on gloo (CPU): a custom group outside the default world, bucket broadcast to a
receiver, and a receiver that never shows up -> a timeout naming the engine and the bucket."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor.spawn import RankFailed, free_port, run_ranks
from megatron_dapo.rollout.sglang_weight_sync import broadcast_bucket, init_custom_group


def bucket(fill: float):
    return {
        "model.embed_tokens.weight": torch.full((8, 4), fill),
        "model.norm.weight": torch.arange(4, dtype=torch.float32) + fill,
        "lm_head.weight": torch.full((8, 4), -fill, dtype=torch.bfloat16),
    }


def _sync(rank, world_size, port, skip_receive):
    group = init_custom_group(
        "127.0.0.1", port, rank, world_size, "dapo_test_sync", backend="gloo", timeout_s=20
    )
    if rank == 0:
        broadcast_bucket(
            bucket(3.0), group, timeout_s=1 if skip_receive else 20, engine="sg-1", bucket_index=5
        )
        return None
    if skip_receive:
        import time

        time.sleep(3)  # joined the group but never receives: the sender must time out
        return None
    got = bucket(0.0)
    broadcast_bucket(got, group, timeout_s=20, engine="trainer", bucket_index=5)
    return {k: (str(v.dtype), v.float().tolist()) for k, v in got.items()}  # plain data: no shared memory


def test_broadcast_bucket_reaches_the_receiver():
    results = run_ranks(_sync, 2, free_port(), False, timeout_s=120)
    for name, ref in bucket(3.0).items():
        dtype, values = results[1][name]
        assert dtype == str(ref.dtype) and values == ref.float().tolist()


def test_missing_receiver_times_out_naming_engine_and_bucket():
    with pytest.raises(RankFailed, match=r"(?s)engine sg-1.*bucket 5 \(3 tensors"):
        run_ranks(_sync, 2, free_port(), True, timeout_s=120)
