"""NCCL-path sender on gloo (CPU): a custom group outside the default world, bucket broadcast to a
receiver, and a receiver that never shows up -> a timeout naming the engine and the bucket."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_dapo.actor.spawn import RankFailed, run_ranks
from megatron_dapo.ports import free_port
from megatron_dapo.sync.sglang_senders import broadcast_bucket, init_custom_group


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


def _sync_from_torchrun_rank(rank, world_size, port):
    if rank == 0:  # the trainer's sending rank runs under torchrun; the server does not
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return _sync(rank, world_size, port, False)


def test_group_forms_when_the_sender_runs_under_torchrun():
    """torchrun sets TORCHELASTIC_USE_AGENT_STORE in its ranks; a tcp:// rendezvous then makes the
    sender a store client too, and the weight-update group never formed (torchrun + SGLang)."""
    results = run_ranks(_sync_from_torchrun_rank, 2, free_port(), timeout_s=120)
    assert results[1]["model.norm.weight"][1] == (bucket(3.0)["model.norm.weight"]).tolist()


def test_missing_receiver_times_out_naming_engine_and_bucket():
    with pytest.raises(RankFailed, match=r"(?s)engine sg-1.*bucket 5 \(3 tensors"):
        run_ranks(_sync, 2, free_port(), True, timeout_s=120)


_LOAD_LIKE_SGLANG = """
import base64, sys
from multiprocessing.reduction import ForkingPickler
named = ForkingPickler.loads(base64.b64decode(sys.stdin.read()))
print({name: [str(t.dtype), t.float().sum().item()] for name, t in named})
"""


def test_cpu_bucket_serialized_for_update_weights_from_tensor_loads_in_another_process():
    # a CPU server on this host reads /update_weights_from_tensor payloads like this (base64 +
    # ForkingPickler); with the default file_descriptor strategy the handles are useless to it
    import ast
    import subprocess
    import sys

    from megatron_dapo.sglang.ipc import serialize_bucket_for_ipc

    # the torch_shm_manager this starts is this process's for good (conftest ends it with the session)
    before = torch.multiprocessing.get_sharing_strategy()
    b = bucket(2.0)
    payloads = serialize_bucket_for_ipc(b, tp_size=2)
    assert len(payloads) == 2 and torch.multiprocessing.get_sharing_strategy() == before
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_LIKE_SGLANG],
        input=payloads[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = ast.literal_eval(out.stdout.strip())
    assert got == {k: [str(v.dtype), v.float().sum().item()] for k, v in b.items()}


_HOLD_A_MANAGER = """
import sys, torch
from megatron_dapo.sglang.ipc import serialize_bucket_for_ipc
payloads = serialize_bucket_for_ipc({"w": torch.ones(4)})
print("ready", flush=True)
sys.stdin.read()
"""


def test_server_cleanup_ends_only_shm_managers_whose_process_exited():
    """stop_cpu_server's cleanup must spare a live process's torch_shm_manager (make test's other
    worker once lost its own to it: "Broken pipe" on its next weight update) and still end the one
    a process that exited left behind."""
    import subprocess
    import sys
    import time

    import psutil
    from sglang_fixtures import _shm_manager_pids

    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_A_MANAGER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        (manager,) = [c for c in psutil.Process(holder.pid).children() if c.name() == "torch_shm_manager"]
        assert manager.pid not in _shm_manager_pids()  # its process still uses it
        holder.kill()
        holder.wait(timeout=60)
        deadline = time.monotonic() + 60
        while manager.ppid() != 1:  # re-parented once the holder is reaped
            assert time.monotonic() < deadline, "the manager was not re-parented"
            time.sleep(0.05)
        assert manager.pid in _shm_manager_pids()
    finally:
        holder.kill()
        for p in psutil.process_iter(["name", "ppid"]):
            if p.info["name"] == "torch_shm_manager" and p.info["ppid"] == 1:
                p.terminate()
