"""The payload of SGLang's ``/update_weights_from_tensor``, and the colocated update of one engine.

Each bucket's tensors are pickled with ``multiprocessing.reduction.ForkingPickler`` (torch's
reductions turn CUDA tensors into IPC handles), base64-encoded, one copy per server TP rank, which
is how SGLang's ``MultiprocessingSerializer`` expects them. SGLang's own reduction patch (device
UUIDs instead of indices, for differing ``CUDA_VISIBLE_DEVICES``) is applied when sglang is
importable; sglang is imported only there. CPU tensors (a CPU server on the same host) go as
shared-memory files (``file_system`` strategy).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler

import torch


def serialize_bucket_for_ipc(bucket: dict[str, torch.Tensor], tp_size: int = 1) -> list[str]:
    """SGLang's ``serialized_named_tensors``: base64 ForkingPickler bytes of [(name, tensor)], per TP rank."""
    _patch_reductions_like_sglang()
    buf = io.BytesIO()
    # CPU tensors are copied: pickling moves a storage into shared memory in place
    named = [
        (name, t.detach().clone() if t.device.type == "cpu" else t.detach()) for name, t in bucket.items()
    ]
    # CPU tensors travel as shared-memory files the server opens by name; the default strategy
    # passes file descriptors over a multiprocessing connection, which HTTP is not. Only the
    # pickling needs it (the files live as long as the tensors), so the process setting is restored.
    # The sender keeps a torch_shm_manager daemon; whoever owns the process ends it.
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        ForkingPickler(buf).dump(named)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return [data] * tp_size


def _patch_reductions_like_sglang() -> None:
    """Use SGLang's CUDA-tensor reduction patch when it is installed (GPU runs only)."""
    for module in ("sglang.srt.utils.patch_torch", "sglang.srt.patch_torch"):
        try:
            patch = __import__(
                module, fromlist=["monkey_patch_torch_reductions"]
            ).monkey_patch_torch_reductions
        except (ImportError, AttributeError):
            continue
        patch()
        return


def push_weights_ipc(engine, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> int:
    """Colocated update of one ``SGLangEngine``; returns buckets sent."""
    client = engine.client
    engine.run(client.pause_generation("abort"))
    engine.run(client.flush_cache())
    sent = 0
    try:
        for bucket in buckets:
            # CUDA tensors go as IPC handles, CPU tensors (a CPU server on this host) as shm files
            # the tensors must stay alive until the server has copied them: the reply comes after that
            engine.run(
                client.update_weights_from_tensor(serialize_bucket_for_ipc(bucket, engine.tp_size), version)
            )
            sent += 1
    finally:
        engine.run(client.continue_generation())
    return sent
