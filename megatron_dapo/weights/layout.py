"""Tensor layouts of megatron-core's fused/parallel weights, as pure functions of HF tensors.

Each layout kind converts between the HF tensors of one Megatron parameter and that parameter's
tensor-parallel shard, in both directions:

- ``read(source, names, tp, rank, dims)`` -> this rank's shard, reading only the rows/columns of
  the HF tensors it needs (``source.slice(name, dim, start, stop)``).
- ``merge(shards, dims)`` -> the HF tensors (in the order of ``names``) from all TP shards; they
  may be views of the shards (no copy where the layout allows), so copy before mutating.

Kinds:
  replicated  norms: every TP rank holds the whole tensor.
  column      split on dim 0 (output features).
  row         split on dim 1 (input features).
  vocab       split on dim 0 over the *padded* vocabulary; padding rows are zero on load and dropped
              on merge.
  qkv         megatron's linear_qkv: per query group g, the group's q heads then its k head then its
              v head ([g0: q..q k v][g1: q..q k v]...), weights on dim 0 and biases alike; TP ranks
              own contiguous groups.
  gate_up     megatron's linear_fc1 for SwiGLU: each TP shard is [gate_shard; up_shard], so the
              concatenation of shards is *not* [gate; up] when TP > 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Dims:
    """Model sizes the layouts need."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int


class SliceSource(Protocol):
    def slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...


def _even_split(total: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    if total % tp:
        raise ValueError(f"{what}: size {total} is not divisible by tensor parallel size {tp}")
    per = total // tp
    return rank * per, (rank + 1) * per


def read_replicated(src: SliceSource, names, tp, rank, dims) -> torch.Tensor:
    (name,) = names
    return src.slice(name, 0, 0, src.shape(name)[0])


def read_column(src: SliceSource, names, tp, rank, dims) -> torch.Tensor:
    (name,) = names
    a, b = _even_split(src.shape(name)[0], tp, rank, name)
    return src.slice(name, 0, a, b)


def read_row(src: SliceSource, names, tp, rank, dims) -> torch.Tensor:
    (name,) = names
    a, b = _even_split(src.shape(name)[1], tp, rank, name)
    return src.slice(name, 1, a, b)


def read_vocab(src: SliceSource, names, tp, rank, dims: Dims) -> torch.Tensor:
    (name,) = names
    shape = src.shape(name)
    if shape[0] != dims.vocab_size:
        raise ValueError(f"{name}: has {shape[0]} rows but the config's vocab_size is {dims.vocab_size}")
    a, b = _even_split(dims.padded_vocab_size, tp, rank, f"{name} (padded vocab)")
    real_b = min(b, dims.vocab_size)
    rows = src.slice(name, 0, a, real_b) if real_b > a else None
    out_shape = (b - a, *shape[1:])
    if rows is not None and rows.shape[0] == b - a:
        return rows
    out = torch.zeros(out_shape, dtype=src.dtype(name))
    if rows is not None:
        out[: rows.shape[0]] = rows
    return out


def read_qkv(src: SliceSource, names, tp, rank, dims: Dims) -> torch.Tensor:
    q_name, k_name, v_name = names
    groups, hd = dims.num_kv_heads, dims.head_dim
    q_per_group = dims.num_heads // groups
    g0, g1 = _even_split(groups, tp, rank, f"{q_name} (query groups)")
    q = src.slice(q_name, 0, g0 * q_per_group * hd, g1 * q_per_group * hd)
    k = src.slice(k_name, 0, g0 * hd, g1 * hd)
    v = src.slice(v_name, 0, g0 * hd, g1 * hd)
    n = g1 - g0
    tail = q.shape[1:]
    q = q.reshape(n, q_per_group * hd, *tail)
    k = k.reshape(n, hd, *tail)
    v = v.reshape(n, hd, *tail)
    return torch.cat([q, k, v], dim=1).reshape(n * (q_per_group + 2) * hd, *tail)


def read_gate_up(src: SliceSource, names, tp, rank, dims) -> torch.Tensor:
    gate_name, up_name = names
    a, b = _even_split(src.shape(gate_name)[0], tp, rank, gate_name)
    return torch.cat([src.slice(gate_name, 0, a, b), src.slice(up_name, 0, a, b)], dim=0)


def _cat0(shards: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(shards, 0)``, but a view (no copy) when there is one shard or the shards are
    consecutive pieces of one buffer (as the TP gather produces them)."""
    first = shards[0]
    if len(shards) == 1:
        return first
    step = first.numel()
    adjacent = all(
        s.is_contiguous()
        and s.shape == first.shape
        and s.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and s.storage_offset() == first.storage_offset() + i * step
        for i, s in enumerate(shards)
    )
    if adjacent:
        return first.as_strided((first.shape[0] * len(shards), *first.shape[1:]), first.stride())
    return torch.cat(shards, dim=0)


def merge_replicated(shards, dims) -> list[torch.Tensor]:
    return [shards[0]]


def merge_column(shards, dims) -> list[torch.Tensor]:
    return [_cat0(shards)]


def merge_row(shards, dims) -> list[torch.Tensor]:
    return [shards[0] if len(shards) == 1 else torch.cat(shards, dim=1)]


def merge_vocab(shards, dims: Dims) -> list[torch.Tensor]:
    return [_cat0(shards)[: dims.vocab_size]]


def merge_qkv(shards, dims: Dims) -> list[torch.Tensor]:
    full = _cat0(shards)
    groups, hd = dims.num_kv_heads, dims.head_dim
    q_per_group = dims.num_heads // groups
    tail = full.shape[1:]
    grouped = full.reshape(groups, (q_per_group + 2) * hd, *tail)
    q, k, v = torch.split(grouped, [q_per_group * hd, hd, hd], dim=1)
    return [
        q.reshape(groups * q_per_group * hd, *tail),
        k.reshape(groups * hd, *tail),
        v.reshape(groups * hd, *tail),
    ]


def merge_gate_up(shards, dims) -> list[torch.Tensor]:
    halves = [torch.chunk(s, 2, dim=0) for s in shards]
    if len(shards) == 1:
        return list(halves[0])
    return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]


READERS = {
    "replicated": read_replicated,
    "column": read_column,
    "row": read_row,
    "vocab": read_vocab,
    "qkv": read_qkv,
    "gate_up": read_gate_up,
}
MERGERS = {
    "replicated": merge_replicated,
    "column": merge_column,
    "row": merge_row,
    "vocab": merge_vocab,
    "qkv": merge_qkv,
    "gate_up": merge_gate_up,
}
NUM_HF_TENSORS = {"replicated": 1, "column": 1, "row": 1, "vocab": 1, "qkv": 3, "gate_up": 2}


class DictSource:
    """A :class:`SliceSource` over in-memory full HF tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.tensors[name].narrow(dim, start, stop - start).clone()
