"""Stream a live TP/PP-sharded Megatron model out as full HF-named tensors, in bounded buckets.

This is what rollout engines receive after every optimizer step (``engine.load_weights(buckets)``)
and what the Megatron -> HF converter writes.

Protocol: every rank of a model-parallel group (all its TP and PP ranks) iterates
:func:`iter_hf_buckets` in lockstep; each yields the same number of items. The *holder* of a
group, its rank with ``pp_rank == 0 and tp_rank == 0`` (see :func:`is_bucket_holder`), gets
``dict[str, Tensor]`` buckets; every other rank gets ``None`` at the same points. With DP/CP > 1
each replica's group gathers independently, so there is one holder per DP x CP replica (global
rank 0 is always one). Tensors are on the parameters' device, in the parameters' dtype, with
exact HF names and shapes (vocabulary padding dropped; no ``lm_head.weight`` when the HF config
ties embeddings).

How: one all-gather of small metadata over the PP group (and, for MoE with expert parallelism,
first over the EP group) fixes the global order (HF order) and owner stage (and owner EP rank) of
every tensor; then, per tensor, the owner stage's TP ranks gather their shards to TP rank 0
and the owner's TP rank 0 merges them into HF layout (an expert's shards over the expert-TP
group, which is the TP group: expert_tensor_parallel_size = TP); an expert's tensors are then
broadcast from the EP rank that holds the expert to the other EP ranks of that stage, between
expert-TP rank 0s (each DP replica has a holder, and each needs every expert); if it is not the
holder's stage, the owner stage sends
them to the holder (point-to-point). A bucket is yielded when its bytes reach ``bucket_bytes``,
so the holder keeps at most one bucket plus one tensor, and other ranks one tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.weights.layout import MERGERS, Dims
from megatron_dapo.weights.model_io import hf_config_of, padded_vocab_of, unwrap
from megatron_dapo.weights.plan import bind, dims_of, expected_hf_names, is_expert


@dataclass(frozen=True)
class _Item:
    key: int  # position of the first HF name in HF order
    owner_pp: int
    local_index: int  # index into the owner's exported bindings
    kind: str
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    owner_ep: int | None = None  # the EP rank holding an expert's tensors; None: every EP rank

    @property
    def nbytes(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(size * _numel(s) for s in self.hf_shapes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def is_bucket_holder() -> bool:
    """Whether this rank receives the buckets of :func:`iter_hf_buckets` (others get None)."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0


def _hf_shapes(kind: str, shard_shape: tuple[int, ...], tp: int, dims: Dims) -> tuple[tuple[int, ...], ...]:
    meta = torch.empty(shard_shape, device="meta")
    shards = [meta] * (1 if kind == "replicated" else tp)
    return tuple(tuple(t.shape) for t in MERGERS[kind](shards, dims))


def _plan(model_chunks: list[Any]) -> tuple[list[_Item], list[Any], Dims]:
    from megatron.core import parallel_state as ps

    hf_config = hf_config_of(model_chunks)
    dims = dims_of(hf_config, padded_vocab_of(model_chunks))
    tp = ps.get_tensor_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    order = {name: i for i, name in enumerate(expected_hf_names(hf_config))}
    exported = [b for b in bind(model_chunks, hf_config) if b.export]
    local = [
        (
            order[b.hf_names[0]],
            i,
            b.kind,
            b.hf_names,
            _hf_shapes(b.kind, tuple(b.param.shape), etp if is_expert(b) else tp, dims),
            b.param.dtype,
            None,
        )
        for i, b in enumerate(exported)
    ]
    ep = ps.get_expert_model_parallel_world_size()
    if ep > 1:
        local = _with_other_ep_ranks_experts(local, exported, ep)
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp > 1:
        gathered: list[Any] = [None] * pp
        dist.all_gather_object(gathered, local, group=ps.get_pipeline_model_parallel_group())
    else:
        gathered = [local]
    items = [
        _Item(key, stage, i, kind, names, shapes, dtype, owner_ep)
        for stage, entries in enumerate(gathered)
        for key, i, kind, names, shapes, dtype, owner_ep in entries
    ]
    items.sort(key=lambda it: it.key)
    missing = set(order) - {n for it in items for n in it.hf_names}
    if missing:
        raise RuntimeError(f"model chunks do not cover HF tensors {sorted(missing)[:5]} ...")
    return items, exported, dims


def _with_other_ep_ranks_experts(local: list[tuple], exported: list[Any], ep: int) -> list[tuple]:
    """This stage's entries with every EP rank's experts: the dense tensors are the same on all EP
    ranks (kept once, from this rank), each expert is owned by the EP rank that holds it."""
    from megatron.core import parallel_state as ps

    gathered: list[Any] = [None] * ep
    dist.all_gather_object(gathered, local, group=ps.get_expert_model_parallel_group())
    dense = [e for e, b in zip(local, exported) if not is_expert(b)]
    experts = [
        (*entry[:-1], r)
        for r, entries in enumerate(gathered)
        for entry in entries
        if ".mlp.experts." in entry[3][0]
    ]
    return dense + experts


def _expert_broadcast(
    item: _Item, tensors: list[torch.Tensor] | None, device: torch.device
) -> list[torch.Tensor]:
    """The owner EP rank's merged expert tensors, on every EP rank of the owner stage."""
    from megatron.core import parallel_state as ps

    group = ps.get_expert_model_parallel_group()
    if ps.get_expert_model_parallel_rank() != item.owner_ep:
        tensors = [torch.empty(shape, dtype=item.dtype, device=device) for shape in item.hf_shapes]
    src = dist.get_global_rank(group, item.owner_ep)
    out = []
    for t in tensors:
        t = t.contiguous()
        dist.broadcast(t, src, group=group)
        out.append(t)
    return out


def _merged_on_owner(item: _Item, binding: Any, dims: Dims) -> list[torch.Tensor] | None:
    """All TP ranks of the owner stage call this; TP rank 0 gets the HF tensors.

    A gather to TP rank 0 (not an all-gather: only it needs the result) into one buffer, so the
    dim-0 layouts merge without another copy.
    """
    from megatron.core import parallel_state as ps

    if item.owner_ep is not None or is_expert(binding):
        # An expert's shards live on the expert-tensor-parallel group (megatron's ETP, = TP here).
        tp, rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
        group = ps.get_expert_tensor_parallel_group() if tp > 1 else None
    else:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        group = ps.get_tensor_model_parallel_group() if tp > 1 else None
    local = binding.param.detach()
    if item.kind == "replicated" or tp == 1:
        shards = [local]
    else:
        dst = dist.get_global_rank(group, 0)
        if rank == 0:
            flat = torch.empty((tp, *local.shape), dtype=local.dtype, device=local.device)
            shards = list(flat.unbind(0))
            dist.gather(local.contiguous(), gather_list=shards, dst=dst, group=group)
        else:
            dist.gather(local.contiguous(), gather_list=None, dst=dst, group=group)
            return None
    if rank != 0:
        return None
    return MERGERS[item.kind](shards, dims)


def iter_hf_buckets(
    model_chunks: list[Any],
    hf_config: Any | None = None,
    bucket_bytes: int = 512 << 20,
) -> Iterator[dict[str, torch.Tensor] | None]:
    """Yield the model's full HF tensors in buckets of about ``bucket_bytes`` (see module doc).

    Tensors may be views of gather buffers or of the live parameters (no copy where the layout
    allows): copy them (as ``load_weights`` does) rather than mutate them, and do not keep them
    across an optimizer step.

    ``hf_config`` defaults to the one the chunks were built from. Call on every TP and PP rank.
    """
    from megatron.core import parallel_state as ps

    if hf_config is not None:
        for chunk in model_chunks:
            unwrap(chunk).hf_config = hf_config
    items, exported, dims = _plan(model_chunks)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    holder = is_bucket_holder()
    holder_global = ps.get_pipeline_model_parallel_first_rank()
    bucket: dict[str, torch.Tensor] = {}
    filled = 0
    for item in items:
        tensors: list[torch.Tensor] | None = None
        if pp_rank == item.owner_pp:
            if item.owner_ep is None:
                tensors = _merged_on_owner(item, exported[item.local_index], dims)
            else:
                mine = ps.get_expert_model_parallel_rank() == item.owner_ep
                merged = _merged_on_owner(item, exported[item.local_index], dims) if mine else None
                # The owner's expert-TP rank 0 holds the merged tensors; the expert-TP rank 0s of
                # the other EP ranks (one per DP replica's holder) receive them.
                if ps.get_expert_tensor_parallel_rank() == 0:
                    tensors = _expert_broadcast(item, merged, exported[0].param.device)
            if tensors is not None and item.owner_pp != 0:
                for t in tensors:
                    dist.send(t.contiguous(), holder_global)
                tensors = None
        if holder and item.owner_pp != 0:
            src = _stage_tp0_global_rank(item.owner_pp)
            tensors = []
            for shape in item.hf_shapes:
                buf = torch.empty(shape, dtype=item.dtype, device=exported[0].param.device)
                dist.recv(buf, src)
                tensors.append(buf)
        if holder:
            bucket.update(zip(item.hf_names, tensors))
        filled += item.nbytes
        if filled >= bucket_bytes:
            yield bucket if holder else None
            bucket, filled = {}, 0
    if filled:
        yield bucket if holder else None


def _stage_tp0_global_rank(stage: int) -> int:
    """Global rank of PP stage ``stage`` in the holder's pipeline group (the holder is TP rank 0)."""
    from megatron.core import parallel_state as ps

    return dist.get_global_rank(ps.get_pipeline_model_parallel_group(), stage)


def gather_hf_state_dict(
    model_chunks: list[Any], bucket_bytes: int = 512 << 20
) -> dict[str, torch.Tensor] | None:
    """The whole HF state dict on the holder (None elsewhere); for tests and small models."""
    out: dict[str, torch.Tensor] | None = {} if is_bucket_holder() else None
    for bucket in iter_hf_buckets(model_chunks, bucket_bytes=bucket_bytes):
        if out is not None and bucket is not None:
            out.update(bucket)
    return out
