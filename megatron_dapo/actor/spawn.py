"""Run a function on N local processes that form one torch.distributed world.

Used by tests, `verify-model` and the CPU demo to start Megatron ranks without torchrun. Each
process gets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in its environment (as torchrun would set)
and calls ``fn(rank, world_size, *args)``; the function initialises its own process group. Return
values travel back pickled; an exception in any rank is re-raised in the caller with that rank's
traceback, and the other ranks are terminated instead of left hanging in a collective.

Without CUDA the ranks fork from a forkserver that has already imported torch and megatron.core
(about 5 s of CPU per rank otherwise, mostly megatron pulling in torch._inductor): one import per
calling process instead of one per rank. With CUDA they start with "spawn" as before.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from megatron_dapo.ports import free_port


class RankFailed(RuntimeError):
    """A spawned rank raised; the message carries its traceback, `cause` a stand-in for the
    rank's exception (its class name and message) for one-line reports."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.causes = [cause] if cause is not None else []


class RankError(Exception):
    """Stands for a spawned rank's exception in this process: `type_names` are its class and
    base class names (the class itself may not be importable here)."""

    def __init__(self, message: str, type_names: list[str]):
        super().__init__(message)
        self.type_names = type_names


def _stand_in(type_names: list[str], message: str) -> BaseException:
    return RankError(message, type_names)


# Imported once in the forkserver, before any rank forks from it. Nothing here may touch CUDA or
# start threads (a fork copies neither safely); importing them does neither. mcore_import loads
# megatron.core and its GPT model without the wandb it never uses here.
_PRELOAD = ["torch", "torch.distributed", "megatron_dapo.actor.mcore_import", "transformers"]


def _context():
    """The start method for ranks: a forkserver with ``_PRELOAD`` imported on CPU-only machines,
    "spawn" where CUDA is present (keeps the GPU path exactly as it was)."""
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Takes effect when this process first starts its forkserver; later calls reuse it.
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _entry(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, threads: int, environ: dict
) -> None:
    # A forkserver child inherits the server's environment (the caller's when the server started),
    # not the caller's now: restore the caller's, as "spawn" would have passed it.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    torch.set_num_threads(threads)
    try:
        queue.put((rank, True, _to_bytes(fn(rank, world_size, *args))))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        names = [c.__name__ for c in type(e).__mro__]
        queue.put((rank, False, (traceback.format_exc(), names, str(e))))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _to_bytes(value: Any) -> bytes:
    # Tensors put on a multiprocessing queue travel as shared-memory handles that vanish when the
    # rank exits before the parent reads them; serialised bytes survive the process.
    import io

    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 600.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; results ordered by rank.

    ``fn`` must be importable (module level) because processes start from a fresh interpreter
    (a forkserver or "spawn"), never by forking the caller: "fork" is unsafe with threads already
    running in the parent (Ray, tokenizers) and with CUDA.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, port, fn, args, queue, threads_per_rank, dict(os.environ)),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = queue.get(timeout=timeout_s)
            except Exception as e:  # queue.Empty
                raise RankFailed(
                    f"no result from some rank within {timeout_s:.0f}s (got ranks {sorted(results)})"
                ) from e
            if not ok:
                text, names, message = value
                raise RankFailed(f"rank {rank} of {world_size} failed:\n{text}", _stand_in(names, message))
            results[rank] = _from_bytes(value)
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == world_size else 0.5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]
