"""Where SGLang engines and trainer ranks go: pure arithmetic, no Ray, no GPU, no sglang.

- `engine_gpu_ids`: one node's engines (torchrun mode): colocated = engine i on GPUs
  [i*tp, (i+1)*tp) of the actor's GPUs on this node, disaggregated = the GPUs after the actor's.
  GPU indices are relative to the launching process's CUDA_VISIBLE_DEVICES (`--base-gpu-id`).
- `rank_order`: under Ray, which placement-group bundle each trainer rank takes: bundles sorted
  by (node, GPU), so the ranks of a node are consecutive and follow its GPUs, whatever order
  Ray numbered the bundles in.
- `plan_engines`: the engines of a whole cluster: which node, which GPUs, which port, and in
  colocated mode which trainer rank sits on each engine TP rank's GPU (the rank whose CUDA IPC
  handles that TP rank can open). An engine never spans nodes.
- `plan_reward_servers`: the servers of `reward.model.path` on the same cluster: on GPUs that no
  trainer rank and no engine uses (`own`), or on the first GPUs of engine i (`colocated`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_dapo.config import ConfigError


def engine_gpu_ids(
    placement: str, actor_gpus: Sequence[int], total_gpus: int, num_engines: int, tp: int
) -> list[list[int]]:
    """GPU indices of each engine on one node (torchrun, or servers launched by the driver's node).

    Raises ConfigError when the engines do not fit, or when an engine's GPUs are not contiguous
    (SGLang takes a base GPU id and counts up from it).
    """
    if num_engines < 1 or tp < 1:
        raise ConfigError(
            f"rollout.num_engines ({num_engines}) and rollout.tensor_parallel_size ({tp}) must be >= 1"
        )
    if placement == "colocated":
        pool = list(actor_gpus)
        where = f"the actor's GPUs on this node ({pool})"
    elif placement == "disaggregated":
        first = max(actor_gpus) + 1 if actor_gpus else 0
        pool = list(range(first, total_gpus))
        where = f"the GPUs after the actor's ({first}..{total_gpus - 1} of {total_gpus})"
    else:
        raise ConfigError(f"trainer.placement must be colocated or disaggregated, got {placement!r}")
    need = num_engines * tp
    if need > len(pool):
        raise ConfigError(
            f"rollout.num_engines={num_engines} x rollout.tensor_parallel_size={tp} needs {need} GPUs, but "
            f"trainer.placement={placement} leaves {len(pool)}: {where}. Use fewer or smaller engines, or "
            "start the servers yourself (launch/start_sglang_servers.sh) and give rollout.sglang.urls"
        )
    groups = [pool[i * tp : (i + 1) * tp] for i in range(num_engines)]
    for i, g in enumerate(groups):
        if g != list(range(g[0], g[0] + tp)):
            raise ConfigError(f"engine {i} would get non-contiguous GPUs {g}; SGLang needs consecutive ones")
    return groups


def local_actor_gpus(actor_world_size: int, total_gpus: int) -> list[int]:
    """The actor ranks' GPUs on this node: torchrun's local ranks, else Ray's first bundles."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    n = int(local) if local else min(actor_world_size, total_gpus)
    return list(range(n))


@dataclass(frozen=True)
class GpuSlot:
    """One placement-group bundle as Ray placed it: node (id and address) and GPU index there."""

    node_id: str
    node_ip: str
    gpu: int


def rank_order(slots: Sequence[GpuSlot]) -> list[int]:
    """Bundle index of each rank: bundles sorted by (node, GPU), never by bundle index."""
    return sorted(range(len(slots)), key=lambda b: (slots[b].node_ip, slots[b].node_id, slots[b].gpu))


@dataclass(frozen=True)
class EnginePlan:
    """One engine of the cluster plan.

    Attributes:
        index: the engine's number (0..num_engines-1), node by node.
        node_id / node_ip: where its server runs.
        gpus: its GPU indices on that node, in TP rank order (consecutive: `--base-gpu-id`).
        port: its HTTP port on that node (base_port + its number among the node's engines).
        ipc_ranks: colocated only: the trainer rank on each of `gpus`, in TP rank order.
    """

    index: int
    node_id: str
    node_ip: str
    gpus: tuple[int, ...]
    port: int
    ipc_ranks: tuple[int, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{self.node_ip}:{self.port}"


def plan_engines(
    placement: str,
    actor: Sequence[GpuSlot],
    node_gpus: dict[str, int],
    num_engines: int,
    tp: int,
    base_port: int,
    node_ips: dict[str, str] | None = None,
) -> list[EnginePlan]:
    """The engines of a cluster, filled node by node (nodes in (address, id) order).

    Args:
        placement: colocated (engines on the actor's GPUs) or disaggregated (on the others).
        actor: GpuSlot of trainer rank r at position r.
        node_gpus: GPUs of each node in the cluster (engine-only nodes included).
        node_ips: address of nodes that hold no trainer rank (others come from `actor`).
    Raises ConfigError when the engines do not fit on whole nodes.
    """
    if num_engines < 1 or tp < 1:
        raise ConfigError(
            f"rollout.num_engines ({num_engines}) and rollout.tensor_parallel_size ({tp}) must be >= 1"
        )
    if placement not in ("colocated", "disaggregated"):
        raise ConfigError(f"trainer.placement must be colocated or disaggregated, got {placement!r}")
    ips = dict(node_ips or {})
    rank_on: dict[tuple[str, int], int] = {}
    for r, s in enumerate(actor):
        ips[s.node_id] = s.node_ip
        rank_on[(s.node_id, s.gpu)] = r
    nodes = sorted(node_gpus, key=lambda n: (ips.get(n, ""), n))
    plans: list[EnginePlan] = []
    free_per_node = []
    for node in nodes:
        used = sorted(g for (n, g) in rank_on if n == node)
        pool = used if placement == "colocated" else [g for g in range(node_gpus[node]) if g not in used]
        # consecutive runs only: SGLang counts an engine's GPUs up from --base-gpu-id
        groups = _runs(pool, tp)
        free_per_node.append(f"{ips.get(node, node)}: {len(groups)}")
        for k, gpus in enumerate(groups):
            if len(plans) == num_engines:
                break
            ranks = tuple(rank_on[(node, g)] for g in gpus) if placement == "colocated" else ()
            plans.append(EnginePlan(len(plans), node, ips.get(node, ""), gpus, base_port + k, ranks))
    if len(plans) < num_engines:
        where = "the actor's GPUs" if placement == "colocated" else "the GPUs the actor leaves"
        raise ConfigError(
            f"rollout.num_engines={num_engines} x rollout.tensor_parallel_size={tp} does not fit on {where} "
            f"node by node (engines of TP {tp} per node: {', '.join(free_per_node)}); use fewer or smaller "
            "engines, more nodes, or give rollout.sglang.urls of servers you started"
        )
    return plans


def _runs(gpus: Sequence[int], size: int) -> list[tuple[int, ...]]:
    """``gpus`` (sorted) cut into consecutive runs of ``size``, left to right."""
    groups, run = [], []
    for g in gpus:
        run = run + [g] if run and g == run[-1] + 1 else [g]
        if len(run) == size:
            groups.append(tuple(run))
            run = []
    return groups


def plan_reward_servers(
    placement: str,
    actor: Sequence[GpuSlot],
    node_gpus: dict[str, int],
    engines: Sequence[EnginePlan],
    num_servers: int,
    tp: int,
    node_ips: dict[str, str] | None = None,
) -> list[EnginePlan]:
    """Where each reward server runs on the cluster (``port`` 0: a free one on its node).

    ``colocated``: server i on the first ``tp`` GPUs of engine i (the config checked that there
    are enough engines and that ``tp`` fits an engine). ``own``: GPUs no trainer rank and no
    engine uses, in consecutive runs of ``tp``, filled node by node (nodes in (address, id)
    order, as the engines are); a server never spans nodes.

    Raises ConfigError when they do not fit.
    """
    if placement == "colocated":
        if len(engines) < num_servers or any(len(e.gpus) < tp for e in engines[:num_servers]):
            raise ConfigError(
                f"reward.model.placement=colocated puts reward server i on the first {tp} GPUs of rollout "
                f"engine i: {num_servers} servers need {num_servers} engines of at least {tp} GPUs, the plan has "
                f"{[len(e.gpus) for e in engines]}; lower reward.model.num_servers or gpus_per_server"
            )
        return [
            EnginePlan(i, e.node_id, e.node_ip, e.gpus[:tp], 0) for i, e in enumerate(engines[:num_servers])
        ]
    if placement != "own":
        raise ConfigError(f"reward.model.placement must be own or colocated, got {placement!r}")
    ips = dict(node_ips or {})
    used: set[tuple[str, int]] = set()
    for s in actor:
        ips[s.node_id] = s.node_ip
        used.add((s.node_id, s.gpu))
    for e in engines:
        ips.setdefault(e.node_id, e.node_ip)
        used.update((e.node_id, g) for g in e.gpus)
    plans: list[EnginePlan] = []
    free_per_node = []
    for node in sorted(node_gpus, key=lambda n: (ips.get(n, ""), n)):
        free = [g for g in range(node_gpus[node]) if (node, g) not in used]
        free_per_node.append(f"{ips.get(node, node)}: {free}")
        for gpus in _runs(free, tp):
            if len(plans) < num_servers:
                plans.append(EnginePlan(len(plans), node, ips.get(node, ""), gpus, 0))
    if len(plans) < num_servers:
        raise ConfigError(
            f"reward.model.num_servers={num_servers} x gpus_per_server={tp} needs {num_servers} runs of {tp} "
            f"consecutive GPUs that neither the actor nor the rollout engines use, node by node, but the "
            f"cluster leaves {'; '.join(free_per_node)}; lower them, add a node, share the engines' GPUs "
            "(reward.model.placement=colocated), or serve the reward model elsewhere and give reward.model.url"
        )
    return plans
