"""torch.distributed + megatron parallel_state initialisation for the actor ranks.

``init_parallel`` is the one place a rank joins the world: it starts the process group from the
torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) with the backend the
machine supports (gloo without CUDA, nccl with), installs the CPU compat patches when needed,
builds megatron's TP/PP/CP/DP groups and seeds the model-parallel RNG streams.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_dapo.actor import compat


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits in the TP x CP x DP x PP grid (megatron's tp-cp-ep-dp-pp order)."""

    world_size: int
    rank: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    cp_size: int
    cp_rank: int
    vpp_size: int | None
    is_first_stage: bool
    is_last_stage: bool
    ep_size: int = 1  # expert parallel: MoE experts split over this many ranks of the DP x CP grid
    ep_rank: int = 0


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(
                f"torch.distributed is not initialised and ${name} is not set; launch with torchrun, "
                "megatron_dapo.actor.spawn.run_ranks, or set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT"
            )
        return default
    return int(value)


def _init_process_group(timeout_minutes: int) -> None:
    if dist.is_initialized():
        return
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    if world_size > 1 or "MASTER_ADDR" in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        _env_int("MASTER_PORT")
        init_method = "env://"
    else:
        # A lone process (tools, notebooks) still needs a group; a file store needs no free port.
        import tempfile

        init_method = f"file://{tempfile.mkstemp(prefix='megatron_dapo_pg_')[1]}"
    if not compat.on_cpu():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    dist.init_process_group(
        backend=compat.dist_backend(),
        init_method=init_method,
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    cp: int = 1,
    seed: int = 1234,
    *,
    ep: int = 1,
    timeout_minutes: int = 30,
) -> ParallelLayout:
    """Join the process group (if needed) and build megatron's parallel groups; DP is the rest.

    Raises ValueError when the world size is not divisible by tp*pp*cp or vpp is given with pp=1.
    """
    compat.apply_cpu_compat()
    _init_process_group(timeout_minutes)
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    if vpp is not None and vpp > 1 and pp == 1:
        raise ValueError("virtual pipeline stages (vpp) need pipeline parallelism (pp > 1)")
    vpp = vpp if vpp and vpp > 1 else None
    if ep > 1 and (world // (tp * pp)) % ep:
        # Megatron's expert grid (expert TP 1) splits the experts over ranks of one pipeline stage.
        raise ValueError(f"expert parallel size {ep} must divide world/(tp*pp) = {world // (tp * pp)}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        distributed_timeout_minutes=timeout_minutes,
    )
    compat.model_parallel_manual_seed(seed)
    return current_layout()


def current_layout() -> ParallelLayout:
    """The layout of the already initialised megatron parallel state."""
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        vpp_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        is_first_stage=ps.is_pipeline_first_stage(ignore_virtual=True),
        is_last_stage=ps.is_pipeline_last_stage(ignore_virtual=True),
        ep_size=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )


def destroy_parallel() -> None:
    """Tear down megatron's groups and the process group (safe to call twice)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
