"""A group of training ranks that the driver calls SPMD-style: every rank runs the same method
with the same arguments, and the driver gets each rank's return value.

Two implementations with one interface, `call(method, *args, timeout_s=None) -> list`:
- `RayRankGroup`: each rank is a Ray actor; rank 0's node address and a free port on it form the
  torch.distributed world (what torchrun would set in the environment).
- `SPMDRankGroup`: under torchrun, this process is rank 0 of the world; the method name and
  arguments go to the other ranks (which sit in `follow()`) over a gloo control group, so CPU
  objects move even when the training backend is NCCL.
The worker class is the same in both: a plain class whose `setup()` initialises the rank.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

from megatron_dapo.driver.rank_failures import (
    RankCallError,
    RankDied,
    dead_peers_after_failure,
    rank_died,
)
from megatron_dapo.driver.spmd_watchdog import CallWatchdog, _store, mark_answered, watch_for_abort
from megatron_dapo.ports import free_port
from megatron_dapo.sglang.placement import GpuSlot

# Followers wait on the control group while rank 0 generates a whole rollout step (hours at 32B
# scale); torch's default 30-minute collective timeout would kill them mid-step.
CONTROL_TIMEOUT = datetime.timedelta(hours=24)


def node_address() -> tuple[str, int]:
    """This node's routable IP and a free port on it, for MASTER_ADDR / MASTER_PORT."""
    try:
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray: fall back to the hostname's address
        ip = socket.gethostbyname(socket.gethostname())
    return ip, free_port()


def set_dist_env(rank: int, world_size: int, master_addr: str, master_port: int, local_rank: int = 0) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )


class RayRankGroup:
    """`world_size` Ray actors of `worker_cls`, placed on the bundles of `placement_group`.

    Rank r takes bundle `bundles[r]` (from `bundle_slots` + `sglang.placement.rank_order`: by node,
    then GPU), else `bundle_offset + r`.
    """

    def __init__(
        self,
        worker_cls: type,
        world_size: int,
        *,
        placement_group,
        bundle_offset: int = 0,
        bundles: list[int] | None = None,
        num_gpus_per_rank: float = 0.0,
        num_cpus_per_rank: float = 1.0,
        init_args: tuple = (),
        env: dict[str, str] | None = None,
    ):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote_cls = ray.remote(worker_cls)
        self.world_size = world_size
        self.workers = []
        for rank in range(world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=placement_group,
                placement_group_bundle_index=bundles[rank] if bundles is not None else bundle_offset + rank,
            )
            options = {
                "num_cpus": num_cpus_per_rank,
                "num_gpus": num_gpus_per_rank,
                "scheduling_strategy": strategy,
            }
            if env:
                options["runtime_env"] = {"env_vars": dict(env)}
            self.workers.append(remote_cls.options(**options).remote(*init_args))
        self.pids = ray.get([w.__ray_call__.remote(lambda self: os.getpid()) for w in self.workers])
        addr, port = ray.get(self.workers[0].__ray_call__.remote(lambda self: node_address()))
        # On GPU nodes Ray sets CUDA_VISIBLE_DEVICES per actor, so every rank's local device is 0.
        ray.get(
            [w.__ray_call__.remote(_set_env, r, world_size, addr, port) for r, w in enumerate(self.workers)]
        )

    def call(
        self,
        method: str,
        *args: Any,
        timeout_s: float | None = None,
        timeout_note: str = "",
        context: str = "",
        **kwargs: Any,
    ) -> list[Any]:
        # timeout_note, context: the caller adds them to the RankCallError raised here
        # (SPMDRankGroup prints them itself)
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return self._wait(method, refs, timeout_s)

    def call_each(self, method: str, per_rank_args: list[tuple], timeout_s: float | None = None) -> list[Any]:
        refs = [getattr(w, method).remote(*a) for w, a in zip(self.workers, per_rank_args)]
        return self._wait(method, refs, timeout_s)

    def _wait(self, method: str, refs: list, timeout_s: float | None) -> list[Any]:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError as e:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            late = [r for r, ref in enumerate(refs) if ref not in ready]
            raise RankCallError(
                f"{method}: ranks {late} did not finish within {timeout_s:.0f}s", timed_out=True
            ) from e
        except (RayTaskError, RayActorError) as e:
            failed, causes = [], []
            for rank, ref in enumerate(refs):
                try:
                    ray.get(ref, timeout=5)
                except RayActorError:
                    cause = RankDied(
                        f"training rank {rank} (pid {self.pids[rank]}) died during {method} "
                        "(killed, out of memory, or a crash in native code; see its log under /tmp/ray/session_latest/logs)"
                    )
                    causes.insert(0, cause)  # the dead process, not the peers it left waiting
                    failed.append(f"rank {rank}: {cause}")
                except GetTimeoutError:
                    failed.append(f"rank {rank}: still running (waiting for a peer)")
                except Exception as err:  # noqa: BLE001 - collecting every rank's failure
                    cause = getattr(err, "cause", None) or err
                    causes.append(cause)
                    failed.append(f"rank {rank}: {type(cause).__name__}: {cause}")
            raise RankCallError(
                f"{method} failed on {len(failed)} rank(s): " + "; ".join(failed), causes
            ) from e

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w, no_restart=True)


def bundle_slots(placement_group, count: int) -> list:
    """Where Ray put bundles 0..count-1: a `GpuSlot` (node id, node address, GPU index) each.

    A zero-CPU probe task runs in each bundle; bundles without a GPU report GPU -1.
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = placement_group.bundle_specs
    probe = ray.remote(_probe_where)
    refs = []
    for b in range(count):
        gpus = 1 if bundle[b].get("GPU") else 0
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=b
        )
        refs.append(probe.options(num_cpus=0, num_gpus=gpus, scheduling_strategy=strategy).remote())
    return [GpuSlot(*where) for where in ray.get(refs, timeout=300)]


def _probe_where() -> tuple[str, str, int]:
    import ray

    gpus = ray.get_gpu_ids()
    return (
        ray.get_runtime_context().get_node_id(),
        ray.util.get_node_ip_address(),
        int(gpus[0]) if gpus else -1,
    )


def _set_env(self, rank: int, world_size: int, addr: str, port: int) -> None:
    set_dist_env(rank, world_size, addr, port)


class SPMDRankGroup:
    """Rank 0's view of a torchrun world: `call` runs the method here and on every other rank."""

    _STOP = "__stop__"

    def __init__(self, worker: Any):
        import torch.distributed as dist

        self.worker = worker
        self.world_size = dist.get_world_size()
        # gloo carries Python objects whatever the training backend is
        self._group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        self.peers = _exchange_peers(self._group, self.world_size)

        self._watchdog = CallWatchdog(self.world_size, peers=self.peers)

    def call(
        self,
        method: str,
        *args: Any,
        timeout_s: float | None = None,
        timeout_note: str = "",
        context: str = "",
        **kwargs: Any,
    ) -> list[Any]:
        """`timeout_s` bounds the whole call: past it, this process prints one `failed:` line
        (ending with `timeout_note` and `context`) and exits 1; a peer that dies while this rank
        stays blocked in the call ends it the same way (driver/spmd_watchdog.py says why)."""
        import torch.distributed as dist

        self._watchdog.start(method, timeout_s, timeout_note, context)
        try:
            msg = [(method, args, kwargs)]
            dist.broadcast_object_list(msg, src=0, group=self._group)
            mine = getattr(self.worker, method)(*args, **kwargs)
            self._watchdog.mine_done()
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, mine, group=self._group)
        except Exception as e:
            # A peer that died surfaces here only as a broken collective ("Connection reset by
            # peer"); name the dead process instead, as the Ray path does.
            dead = dead_peers_after_failure(self.peers, e)
            if not dead:
                raise
            causes: list[BaseException] = [rank_died(rank, pid, method) for rank, pid in dead]
            raise RankCallError(f"{method} failed: " + "; ".join(map(str, causes)), causes) from e
        finally:
            self._watchdog.done()
        return gathered

    def shutdown(self) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([(self._STOP, (), {})], src=0, group=self._group)

    @classmethod
    def follow(cls, worker: Any) -> None:
        """Ranks > 0: execute whatever rank 0 calls until it shuts the group down."""
        import torch.distributed as dist

        group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        world, rank = dist.get_world_size(), dist.get_rank()
        _exchange_peers(group, world)
        store, seq = _store(), 0
        watcher = watch_for_abort(rank)  # rank 0's call watchdog may end the job while we are blocked
        try:
            while True:
                msg: list[Any] = [None]
                dist.broadcast_object_list(msg, src=0, group=group)
                method, args, kwargs = msg[0]
                if method == cls._STOP:
                    return
                seq += 1  # rank 0 counts its calls the same way
                result = getattr(worker, method)(*args, **kwargs)
                mark_answered(store, seq, rank)
                dist.all_gather_object([None] * world, result, group=group)
        finally:
            watcher.stop.set()


def _exchange_peers(group, world_size: int) -> list[tuple[str, int]]:
    """(host, pid) of every rank, so that rank 0 can tell which peer died."""
    import torch.distributed as dist

    peers: list[Any] = [None] * world_size
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid()), group=group)
    return [tuple(p) for p in peers]
