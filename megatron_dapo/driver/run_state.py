"""The run's state and its checkpoint: what a resume needs besides model, optimizer and RNG.

`TrainerState` is the small part (step, weight version, data cursor, the manager's state, the
last step's metrics line), written as JSON by rank 0 with the checkpoint. `RunState` saves it and
resumes from it, together with the work generated ahead of the actor, which goes into its own file,
and reads the forms older checkpoints stored it in.

The carried file. `trainer.mode=one_step_off/async`: when a checkpoint is taken, the batches
already generated for the next steps (the queue of driver/modes.py) are part of the run's state:
a resume that generated them anew would use newer weights and diverge from the uninterrupted run.
At real sizes they are large (512 x 20k tokens: token ids, per-token log-probs and weight
versions), so they do not go into the trainer-state JSON but into ``carried.safetensors`` next to
it, inside the checkpoint directory: the checkpoint's manifest covers it (size and CRC-32), so a
torn or altered file is rejected like any corrupt checkpoint, naming the file.

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
import logging
import os
import typing
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.actor.checkpoint import find_resume_checkpoint
from megatron_dapo.data.types import PromptSample
from megatron_dapo.rollout.manager_protocol import ManagerProtocol
from megatron_dapo.rollout.partial import (
    CarriedGroup,
    PartialSample,
    carry_from_items,
    carry_from_state,
    carry_to_items,
)
from megatron_dapo.rollout.types import RolloutBatch, RolloutSample
from megatron_dapo.weights.hf_io import CheckpointError

log = logging.getLogger(__name__)

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
        "megatron_dapo.driver.run_state.register_carried_type"
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
        elif dataclasses.is_dataclass(hints[f.name]):  # its fields are columns under `path.`
            kwargs[f.name] = _unflatten(hints[f.name], values, path + ".")
        # else: a field added after the file was written (e.g. a sample's loss_mask): its default
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


# ---------------------------------------------------------------- the run's state
@dataclass
class TrainerState:
    """What a checkpoint must carry besides model/optimizer/RNG to resume exactly."""

    step: int = 0
    weight_version: int = 0
    data_cursor: dict = field(default_factory=dict)
    manager_state: dict = field(default_factory=dict)
    prompts_consumed: int = 0
    # The step's metrics line as it stood at its checkpoint: a SIGKILL between the save and the
    # line (validation, logging) must not lose the line; the resume writes it from here.
    step_record: dict = field(default_factory=dict)
    # trainer.mode=one_step_off/async: the next steps' rollouts, finished before this checkpoint
    # (generated with older weights; the data cursor is already past them), oldest first, are in
    # the checkpoint's carried.safetensors; this is its small index:
    # {"file", "items", "starts": per item the data cursor / manager state before it was drawn}.
    # ({} when nothing is carried. Checkpoints written before held them here as `prefetched`.)
    carried: dict = field(default_factory=dict)
    # rollout.partial: the groups the last rollout left past its cut (partly generated
    # responses with their tokens, log-probs and per-token versions), continued by the next one.
    # They are in carried.safetensors too, after the batches; this is their small index:
    # {"file", "groups", "samples": responses per group}. (Checkpoints written before held the
    # groups themselves here as {"groups": [...]}; they still load.)
    partial_rollouts: dict = field(default_factory=dict)
    # algorithm.use_kl_in_reward: the KL controller's state (its coefficient), {} without one
    kl_ctrl: dict = field(default_factory=dict)


# A carried batch and where its prompts began (pipeline.batch_start; None in older checkpoints).
Carried = tuple[RolloutBatch, "dict[str, Any] | None"]


class RunState:
    """The trainer state of a run, saved into and resumed from its checkpoints.

    cfg: the run's config; run: its directory; manager: the rollout manager
    (`rollout.manager_protocol.ManagerProtocol`); dataset: the prompt cursor; call: the trainer's
    bounded call to every rank (`call(method, *args, limit=..., **kwargs)`)."""

    def __init__(self, cfg: Any, run: Any, manager: ManagerProtocol, dataset: Any, call: Callable[..., Any]):
        self.cfg = cfg
        self.run = run
        self.manager = manager
        self.dataset = dataset
        self._call = call
        self.state = TrainerState()
        self.saved_step: int | None = None
        self.dropped_on_resume = 0  # carried batches trainer.drop_carried_on_resume discarded

    # ---------------------------------------------------------------- save
    def save(self, carried: list[Carried]) -> str:
        """Checkpoint now: the actor (by its ranks), this state, the carried batches (oldest first)
        and rollout.partial's tail in the carried file."""
        self.state.data_cursor = self.dataset.state_dict()
        partial_items, partial_index = carry_to_items(self.manager.partial_groups())
        extra_files = None
        # absolute: rank 0 (maybe another process, another cwd) moves it into the checkpoint
        staged = (self.run.checkpoints / ".carried.staging").absolute()
        self.state.carried = (
            {"file": CARRIED_FILE, "items": len(carried), "starts": [start for _, start in carried]}
            if carried
            else {}
        )
        self.state.partial_rollouts = {"file": CARRIED_FILE, **partial_index} if partial_index else {}
        if carried or partial_items:
            # its own file, not JSON in the trainer state: at real sizes the batches (and the
            # partial tail: ~1000 groups x 16 responses x thousands of tokens) are hundreds of MB;
            # rank 0 moves it into the checkpoint before the manifest (actor/checkpoint.py)
            write_carried(staged, [batch for batch, _ in carried] + partial_items)
            extra_files = {CARRIED_FILE: str(staged)}
        self.state.manager_state = self.manager.state_dict() or {}
        try:
            path = self._call(
                "save_checkpoint",
                str(self.run.checkpoints),
                self.state.step,
                asdict(self.state),
                self.cfg.trainer.keep_last,
                limit="checkpoint_s",
                **({"extra_files": extra_files} if extra_files else {}),
            )[0]
        finally:
            staged.unlink(missing_ok=True)  # moved into the checkpoint, or left by a failed save
        self.saved_step = self.state.step
        return path

    def unsaved(self) -> bool:
        """A finished step that no checkpoint holds yet."""
        return self.state.step > 0 and self.saved_step != self.state.step

    def last_checkpoint(self) -> str:
        """For messages: the checkpoint a resume would start from now."""
        latest = self.run.checkpoints / "latest"
        if latest.is_file():
            return str(self.run.checkpoints / latest.read_text().strip())
        return f"none under {self.run.checkpoints}"

    # ---------------------------------------------------------------- resume
    def resume(self) -> list[Carried] | None:
        """Restore the checkpoint `trainer.resume` names: None when none was loaded, else the
        batches it carried, with where each began (oldest first).

        The choice is made here, once, before any rank loads anything: with "auto", checkpoints
        present but none usable stop the run (naming each and why) instead of starting over."""
        mode = self.cfg.trainer.resume
        if mode == "never":
            return None
        path = find_resume_checkpoint(self.run.checkpoints, mode, strict=True)
        if path is None:
            return None
        # the ranks re-check sizes; the checksums were just verified here
        loaded = dict(self._call("load_checkpoint", str(path), str(path), False, limit="checkpoint_s")[0])
        legacy = loaded.pop("prefetched", None) or {}  # a checkpoint written before carried.safetensors
        self.state = TrainerState(**loaded)
        self.dataset.load_state_dict(self.state.data_cursor)
        if self.state.manager_state:
            self.manager.load_state_dict(self.state.manager_state)
        carried = self._load_carried(Path(path), legacy)
        self.saved_step = self.state.step
        return carried

    def _load_partial(self, groups: list[CarriedGroup] | None) -> None:
        """rollout.partial's tail into the manager: read from the carried file (``groups``), or
        from the trainer-state JSON of an older checkpoint, or none (dropped / not carried)."""
        if groups is None:
            old = self.state.partial_rollouts
            groups = carry_from_state({} if "file" in old else old)
        self.manager.load_partial_groups(groups)

    def _load_carried(self, path: Path, legacy: dict) -> list[Carried]:
        """The checkpoint's carried batches, or, with `trainer.drop_carried_on_resume`, none of
        them: the data cursor and the manager go back to where they stood before the oldest was
        drawn, so its prompts are drawn again and generated with the resumed weights (the same
        for every resume of this checkpoint). With rollout.partial, the tail the manager carried
        at that point goes back too, as fresh groups (no tokens kept) ahead of the cursor's
        prompts: they were drawn before that cursor, so nothing else would draw them again."""
        index = self.state.carried
        count = int(index.get("items", 0)) if index else len(queue_from_state(legacy))
        starts = list(index.get("starts") or []) if index else []
        if count and self.cfg.trainer.drop_carried_on_resume:
            self._drop_carried(path, count, starts[0] if starts else None)
            return []
        partial = self.state.partial_rollouts
        # one file holds both: the carried batches first, then the partial tail's items
        name = index.get("file") if index else partial.get("file")
        items = read_carried(path / name) if name else []
        batches = [b for b in items if isinstance(b, RolloutBatch)] if index else queue_from_state(legacy)
        groups = None
        if partial.get("file"):
            try:
                groups = carry_from_items(items[int(index.get("items", 0)) if index else 0 :], partial)
            except ValueError as e:
                raise CheckpointError(
                    f"carried batches file {path / name} does not match its index in state.json ({e}); the "
                    "checkpoint is corrupt: resume from an earlier one with trainer.resume=PATH"
                ) from e
        self._load_partial(groups)
        starts += [None] * (len(batches) - len(starts))
        return list(zip(batches, starts))

    def _drop_carried(self, path: Path, count: int, start: dict | None) -> None:
        tail = None
        if start is not None:
            self.dataset.load_state_dict(start["data_cursor"])
            if start["manager_state"] is not None:
                self.manager.load_state_dict(start["manager_state"])
            tail = self._fresh_tail(start.get("partial_tail"), path)
        if start is None:
            fate = "this older checkpoint does not record where their prompts began, so they are skipped"
        elif tail is None and self.cfg.rollout.partial:
            fate = (
                "their prompts are drawn again, but this older checkpoint does not record which prompts "
                "rollout.partial's tail held when they began, so those are skipped"
            )
        elif tail:
            fate = f"their prompts are drawn again, after the {len(tail)} prompt(s) rollout.partial's tail then held"
        else:
            fate = "their prompts are drawn again"
        log.warning(
            "trainer.drop_carried_on_resume=true: dropped the %d batch(es) checkpoint %s carried; %s",
            count,
            path,
            fate,
        )
        self.dropped_on_resume = count
        self.state.carried = {}
        # the tail the checkpoint carried was drawn after the oldest carried batch began: its
        # prompts are drawn again (from the cursor, or from the start's tail), so continuing
        # it as well would train them twice
        self.state.partial_rollouts = {}
        self._load_partial(tail or None)

    def _fresh_tail(self, positions: list | None, path: Path) -> list[CarriedGroup] | None:
        """The prompts at ``positions`` (a start record's ``partial_tail``) as carried groups with
        nothing generated: the manager sends them whole, from the prompt, like the unstarted
        groups of its own tail (rollout/partial.py). None when the record has no such field."""
        if positions is None:
            return None
        n = int(self.cfg.rollout.n)
        groups = []
        for p in positions:
            try:
                if not isinstance(p, int) or p < 0:
                    raise IndexError(p)
                prompt = self.dataset[p]
            except IndexError:
                raise CheckpointError(
                    f"checkpoint {path}: state.json's carried.starts[0].partial_tail names prompt {p!r}, which "
                    "this dataset does not have; resume with the same data.train_files, or without "
                    "trainer.drop_carried_on_resume"
                ) from None
            groups.append(CarriedGroup(prompt, [PartialSample() for _ in range(n)]))
        return groups


# ---------------------------------------------------------------- the old checkpoint forms
def queue_from_state(state: dict[str, Any]) -> list[RolloutBatch]:
    """The carried batches of a checkpoint written before carried.safetensors: they were JSON in
    the trainer state (`prefetched`), {"batches": [...]} or, before the queue, one batch."""
    if not state:
        return []
    if "samples" in state:  # a one_step_off checkpoint written before the queue: one batch
        return [rollout_from_state(state)]
    return [rollout_from_state(b) for b in state["batches"]]


def rollout_from_state(state: dict[str, Any]) -> RolloutBatch:
    samples = []
    for row in state["samples"]:
        row = dict(row)
        row["prompt"] = PromptSample(**row["prompt"])
        samples.append(RolloutSample(**row))
    return RolloutBatch(samples, dict(state["metrics"]))
