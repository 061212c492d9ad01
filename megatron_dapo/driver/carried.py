"""What an off-policy checkpoint carries: the work generated ahead of the actor, in its own file.

`trainer.mode=one_step_off/async`: when a checkpoint is taken, the batches already generated for
the next steps (the queue of driver/pipeline.py) are part of the run's state: a resume that
generated them anew would use newer weights and diverge from the uninterrupted run. At real sizes
they are large (512 x 20k tokens: token ids, per-token log-probs and weight versions), so they do
not go into the trainer-state JSON but into ``carried.safetensors`` next to it, inside the
checkpoint directory: the checkpoint's manifest covers it (size and CRC-32), so a torn or altered
file is rejected like any corrupt checkpoint, naming the file.

Layout of the file (one safetensors file: tensors plus a string header):

* the header's metadata holds ``format`` (:data:`FORMAT`) and ``index``, a JSON list with one
  segment per run of items of the same kind, in order. A segment names its kind, its row count,
  its per-item extras (a batch's metrics) and, per column (a dataclass field, nested dataclasses
  flattened as ``prompt.prompt_ids``), how the column is stored;
* per-token columns (lists of ints / floats, strings, tensors) are one flat tensor per column
  and segment (``s{segment}.{column}``) plus the per-row lengths (``...#len``, -1 for None):
  int32 (int64 when a value needs it), float64 (a Python float round-trips bit for bit), utf-8
  bytes, or the tensors concatenated along dim 0 (per row, ``...#{row}``, when their dtypes or
  trailing shapes differ); everything else (scalars, dicts) is JSON in the index.

Items are :class:`RolloutBatch` (kind ``rollout_batch``: its samples are the rows) or instances
of a dataclass registered with :func:`register_carried_type` (consecutive items of one type form
one segment, one row each); :func:`write_carried` / :func:`read_carried` take and give back the
list of items, in order. ``rollout.partial``'s tail (groups past a rollout's cut, partly
generated) travels here too, as kinds ``partial_prompt`` and ``partial_sample``
(rollout/partial.py carry_to_items), after the batches.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import itertools
import json
import os
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.data.types import PromptSample
from megatron_dapo.rollout.partial import PartialSample
from megatron_dapo.rollout.types import RolloutBatch, RolloutSample
from megatron_dapo.weights.hf_io import CheckpointError

CARRIED_FILE = "carried.safetensors"
FORMAT = "megatron-dapo-carried/1"
_BATCH = "rollout_batch"
# a lone surrogate (a tokenizer's decode of half a character) round-trips too
_UTF8_ERRORS = "surrogatepass"
# kind name -> dataclass of one item (a row); RolloutBatch is the built-in kind above
_TYPES: dict[str, type] = {}


def register_carried_type(name: str, cls: type) -> None:
    """Let items of dataclass ``cls`` be carried (stored under kind ``name``)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"carried type {name}: {cls!r} is not a dataclass")
    if name == _BATCH or _TYPES.get(name, cls) is not cls:
        raise ValueError(f"carried kind {name!r} is already taken")
    _TYPES[name] = cls


# rollout.partial's carried tail: a prompt per group, then each group's responses so far
register_carried_type("partial_prompt", PromptSample)
register_carried_type("partial_sample", PartialSample)


def _kind_of(item: Any) -> str:
    if isinstance(item, RolloutBatch):
        return _BATCH
    for name, cls in _TYPES.items():
        if type(item) is cls:
            return name
    raise TypeError(
        f"cannot carry a {type(item).__name__} in a checkpoint: register it with "
        "megatron_dapo.driver.carried.register_carried_type"
    )


# ---------------------------------------------------------------- rows <-> columns
def _flatten(row: Any, prefix: str = "") -> dict[str, Any]:
    """A dataclass instance as {column path: value}; nested dataclasses become ``a.b`` paths."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(row):
        value = getattr(row, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(_flatten(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unflatten(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if path in values:
            kwargs[f.name] = values[path]
        else:  # a nested dataclass: its fields are columns under `path.`
            kwargs[f.name] = _unflatten(hints[f.name], values, path + ".")
    return cls(**kwargs)


def _column_kind(values: list[Any]) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "json"
    if all(type(v) is list for v in present):
        types: set[type] = set()
        for v in present:
            types.update(map(type, v))  # exact types: a bool is not stored as the int 1
        if types <= {int}:
            return "ints"
        if types == {float}:
            return "floats"
        return "json"
    if all(type(v) is str for v in present):
        return "text"
    if all(isinstance(v, torch.Tensor) for v in present):
        first = present[0]
        same = all(
            v.dim() >= 1 and v.dtype == first.dtype and v.shape[1:] == first.shape[1:] for v in present
        )
        return "tensor" if same else "tensors"
    return "json"


def _lengths(values: list[Any], size) -> torch.Tensor:
    return torch.tensor([-1 if v is None else size(v) for v in values], dtype=torch.int64)


def _encode_column(key: str, values: list[Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    kind = _column_kind(values)
    present = [v for v in values if v is not None]
    if kind in ("ints", "floats"):
        try:  # array.array: a C loop over the Python numbers, several times torch.tensor's speed
            flat = array.array("q" if kind == "ints" else "d", itertools.chain.from_iterable(present))
        except OverflowError:  # an int beyond int64: keep it exact in JSON
            return {"kind": "json", "values": values}
        dtype = torch.int64 if kind == "ints" else torch.float64
        data = torch.frombuffer(flat, dtype=dtype).clone() if flat else torch.zeros(0, dtype=dtype)
        if kind == "ints" and data.numel() and data.min() >= -(2**31) and data.max() < 2**31:
            data = data.to(torch.int32)  # token ids and versions: half the bytes, same values
        tensors[key], tensors[key + "#len"] = data, _lengths(values, len)
    elif kind == "text":
        encoded = [None if v is None else v.encode("utf-8", _UTF8_ERRORS) for v in values]
        raw = b"".join(v for v in encoded if v is not None)
        # (frombuffer refuses an empty buffer)
        tensors[key] = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
        )
        tensors[key + "#len"] = _lengths(encoded, len)
    elif kind == "tensor":
        tensors[key] = torch.cat([v.detach().cpu() for v in present]).contiguous()
        tensors[key + "#len"] = _lengths(values, lambda v: v.shape[0])
    elif kind == "tensors":
        for i, v in enumerate(values):
            if v is not None:
                # a copy: safetensors refuses tensors that share memory (one tensor in two rows)
                tensors[f"{key}#{i}"] = v.detach().cpu().clone(memory_format=torch.contiguous_format)
        return {"kind": kind, "present": [v is not None for v in values]}
    else:
        return {"kind": "json", "values": values}
    return {"kind": kind}


def _decode_column(key: str, spec: dict[str, Any], rows: int, get) -> list[Any]:
    kind = spec["kind"]
    if kind == "json":
        values = spec["values"]
    elif kind == "tensors":
        values = [get(f"{key}#{i}") if present else None for i, present in enumerate(spec["present"])]
    else:
        data, lengths = get(key), get(key + "#len").tolist()
        if sum(n for n in lengths if n > 0) != data.shape[0]:
            raise ValueError(f"column {key}: the row lengths do not add up to its {data.shape[0]} entries")
        flat = data.tolist() if kind in ("ints", "floats") else data
        values, at = [], 0
        for n in lengths:
            if n < 0:
                values.append(None)
                continue
            part = flat[at : at + n]
            at += n
            if kind == "text":
                part = bytes(part.numpy()).decode("utf-8", _UTF8_ERRORS)
            elif kind == "tensor":
                part = part.clone()
            values.append(part)
    if len(values) != rows:
        raise ValueError(f"column {key}: {len(values)} values for {rows} rows")
    return values


# ---------------------------------------------------------------- the file
def write_carried(path: str | os.PathLike, items: Sequence[Any]) -> int:
    """Write ``items`` (RolloutBatch or registered dataclasses, in order) to ``path`` (a
    safetensors file); returns its size in bytes. The caller makes it part of a checkpoint
    (actor/checkpoint.py adopts it before the manifest is written)."""
    from safetensors.torch import save_file

    segments: list[tuple[str, list[Any]]] = []
    for item in items:
        kind = _kind_of(item)
        if kind != _BATCH and segments and segments[-1][0] == kind:
            segments[-1][1].append(item)
        else:
            segments.append((kind, [item]))
    index, tensors = [], {}
    for s, (kind, group) in enumerate(segments):
        if kind == _BATCH:
            (batch,) = group
            rows, extra = batch.samples, {"metrics": dict(batch.metrics)}
        else:
            rows, extra = group, {}
        flat = [_flatten(r) for r in rows]
        names = list(flat[0]) if flat else []
        if any(list(r) != names for r in flat):  # e.g. a nested dataclass field that is None in one row
            raise TypeError(f"cannot carry {kind} items whose fields differ between rows: {names}")
        columns = {name: _encode_column(f"s{s}.{name}", [r[name] for r in flat], tensors) for name in names}
        index.append({"kind": kind, "rows": len(rows), "columns": columns, **extra})
    metadata = {"format": FORMAT, "index": json.dumps(index)}
    save_file(tensors, str(path), metadata=metadata)
    return Path(path).stat().st_size


def read_carried(path: str | os.PathLike) -> list[Any]:
    """The items :func:`write_carried` wrote, equal to them (tensors bitwise). A file that is
    missing, torn or not of this format raises :class:`CheckpointError` naming it."""
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
            return _decode(json.loads(meta["index"]), f.get_tensor)
    except Exception as e:  # noqa: BLE001 - whatever the parser says, the file is at fault
        why = " ".join(str(e).split()) or type(e).__name__
        raise CheckpointError(
            f"carried batches file {path} is unreadable ({why}); the checkpoint is corrupt: resume from an "
            "earlier one with trainer.resume=PATH, or drop what it carries with trainer.drop_carried_on_resume=true"
        ) from e


def _decode(index: list[dict[str, Any]], get) -> list[Any]:
    items: list[Any] = []
    for s, seg in enumerate(index):
        kind, rows = seg["kind"], int(seg["rows"])
        cls = RolloutSample if kind == _BATCH else _TYPES.get(kind)
        if cls is None:
            raise ValueError(f"items of kind {kind!r}, which this version does not know")
        columns = {
            name: _decode_column(f"s{s}.{name}", spec, rows, get) for name, spec in seg["columns"].items()
        }
        decoded = [_unflatten(cls, {name: col[i] for name, col in columns.items()}) for i in range(rows)]
        if kind == _BATCH:
            items.append(RolloutBatch(decoded, dict(seg["metrics"])))
        else:
            items.extend(decoded)
    return items
