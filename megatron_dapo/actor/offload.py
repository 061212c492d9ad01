"""Moving the actor's device memory out of the way of colocated engines and back, through
megatron-core's own RL hooks (DDP grad buffers, param buffers, optimizer state).

Parameters can only leave with the distributed optimizer: megatron-core 0.16 maps the
parameters into a contiguous ``param_data`` buffer (the thing ``offload_to_cpu(move_params=True)``
moves) only when ``use_distributed_optimizer`` is on; without it ``param_data`` is None and the
call silently frees nothing. :func:`offload_actor` refuses that case instead.
"""

from __future__ import annotations

from typing import Any


def _param_buffers(model_chunks: list[Any]) -> list[Any]:
    return [b for chunk in model_chunks for b in list(chunk.buffers) + list(chunk.expert_parallel_buffers)]


def check_params_offloadable(model_chunks: list[Any]) -> None:
    """Raise ValueError when a DDP buffer holds no contiguous parameter storage to offload."""
    missing = [b for b in _param_buffers(model_chunks) if getattr(b, "param_data", None) is None]
    if missing:
        raise ValueError(
            f"cannot offload the actor's parameters: {len(missing)} of its DDP buffers have no "
            "contiguous parameter storage (megatron-core keeps one only with the distributed "
            "optimizer), so offloading would free nothing; set optim.use_distributed_optimizer=true, "
            "or do not colocate the actor with the engines"
        )


def offload_actor(model_chunks: list[Any], optimizer: Any, params: bool) -> None:
    """Drop grad buffers, move optimizer state (and with ``params`` the parameters) to host."""
    if params:
        check_params_offloadable(model_chunks)
    for chunk in model_chunks:
        chunk.offload_grad_buffers(synchronize=True, empty_cache=False)
        if params:
            for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
                buffer.offload_to_cpu(move_params=True, move_grads=False)
    optimizer.offload_to_cpu()


def onload_actor(model_chunks: list[Any], optimizer: Any) -> None:
    """Undo :func:`offload_actor`: parameters back, grad buffers re-allocated and zeroed."""
    for chunk in model_chunks:
        for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            buffer.reload_from_cpu(move_params=True, move_grads=False)
        chunk.restore_grad_buffers(synchronize=False)
    optimizer.restore_from_cpu()
