"""Training checkpoints: model + optimizer + schedule + RNG + trainer state, resumable anywhere.

Layout under a checkpoint root::

    root/step_00000010/      one megatron-core dist checkpoint (torch_dist) holding
                             "model" (or "model0".. with virtual pipeline; the converter reads
                             these, see weights/dist_ckpt.py), "optimizer"
                             (optimizer.sharded_state_dict), "rng" (one ShardedObject per rank),
                             and the common entries "scheduler" and "trainer";
                             plus config.json/tokenizer files and megatron_dapo_model.json;
        carried.safetensors           (async modes, when batches were generated ahead) the
                                      carried batches, driver/run_state.py
        megatron_dapo_manifest.json   every file's size and CRC-32, written last
    root/latest              text: the directory name of the newest complete checkpoint

A save writes ``root/.step_XXXXXXXX.tmp`` and renames it when every rank has finished and the
manifest is written, so a crash leaves either the previous state or a complete new checkpoint;
then ``latest`` is replaced atomically and all but the newest ``keep_last`` are deleted.

Loading checks the manifest first (missing file, wrong size, and with ``verify_checksums`` a CRC
mismatch), naming the file. ``resume="auto"`` starts from ``latest`` and falls back to older
checkpoints that verify. The model always reshards into the current TP/PP layout; the
optimizer state reshards where megatron-core supports it (the non-distributed optimizer does),
otherwise a :class:`CheckpointError` says so. RNG states are per rank and are restored only into
the layout they were saved from (a resharded run is reseeded, with a warning).

The distributed optimizer's state is written in the format ``parallel.optimizer_checkpoint_format``
names (``actor/optimizer.py``, OPTIMIZER_CHECKPOINT_FORMATS), recorded in the checkpoint and read
back in that format whatever the current setting. ``dp_reshardable`` resumes at another DP size
only; a resume that changes the model-parallel layout is refused with one line naming both
layouts, before anything is read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import zlib
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_dapo.actor.actor import ActorState
from megatron_dapo.weights.dist_ckpt import model_keys, model_sharded_state_dict, save_model_checkpoint
from megatron_dapo.weights.hf_io import CheckpointError
from megatron_dapo.weights.model_io import unwrap

log = logging.getLogger(__name__)

MANIFEST = "megatron_dapo_manifest.json"
LATEST = "latest"
_PREFIX = "step_"


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


# ---------------------------------------------------------------- files (pure, rank-local)
def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


_RANK_SHARD = re.compile(r"__(\d+)_\d+\.distcp")


def manifest_owner(rel: str, world: int) -> int:
    """The rank that checksums file ``rel``: the writer of a torch_dist shard ``__R_N.distcp``
    (R is its global rank), rank 0 for everything else (metadata, common state, HF files)."""
    match = _RANK_SHARD.fullmatch(Path(rel).name)
    return int(match.group(1)) % world if match else 0


def manifest_entries(ckpt_dir: Path, rank: int = 0, world: int = 1) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of the files under ``ckpt_dir`` that ``rank`` owns (all when world == 1).
    Each rank reads back only what it wrote, so the checksums of a large checkpoint are computed
    by all ranks in parallel instead of by rank 0 alone while the others wait in a barrier."""
    files = {}
    for path in sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST):
        rel = str(path.relative_to(ckpt_dir))
        if manifest_owner(rel, world) == rank:
            files[rel] = {"size": path.stat().st_size, "crc32": _crc32(path)}
    return files


def _gathered_manifest_entries(ckpt_dir: Path) -> dict[str, dict[str, int]] | None:
    """Every rank's :func:`manifest_entries`, merged on rank 0 (None elsewhere). Collective."""
    mine = manifest_entries(ckpt_dir, dist.get_rank(), dist.get_world_size())
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if parts is None:
        return None
    return {rel: info for part in parts for rel, info in part.items()}


def write_manifest(ckpt_dir: Path, files: dict[str, dict[str, int]] | None = None) -> None:
    """Record ``files`` (default: every file under ``ckpt_dir``, size and CRC-32) in the manifest,
    written last, in sorted order."""
    if files is None:
        files = manifest_entries(ckpt_dir)
    tmp = ckpt_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": dict(sorted(files.items()))}, indent=1) + "\n")
    os.replace(tmp, ckpt_dir / MANIFEST)


def verify_checkpoint(ckpt_dir: str | os.PathLike, verify_checksums: bool = True) -> None:
    """Raise CheckpointError naming the first missing, truncated or corrupt file of ``ckpt_dir``."""
    ckpt_dir = Path(ckpt_dir)
    manifest = ckpt_dir / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(
            f"{ckpt_dir} is incomplete: no {MANIFEST} (the save was interrupted, or it is not a "
            "megatron-dapo training checkpoint)"
        )
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{manifest} is unreadable ({e}); the checkpoint is corrupt") from e
    for rel, info in files.items():
        path = ckpt_dir / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        size = path.stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or altered: {size} bytes, expected {info['size']}"
            )
        if verify_checksums and _crc32(path) != info["crc32"]:
            raise CheckpointError(f"checkpoint file {path} is corrupt (CRC-32 mismatch)")


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete-looking step directories under ``root``, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[5:].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[len(_PREFIX) :]), reverse=True)


class NoUsableCheckpointError(CheckpointError):
    """Checkpoints exist but none of them can be resumed from: never start over silently."""


def find_resume_checkpoint(
    root: str | os.PathLike, resume: str = "auto", verify_checksums: bool = True, strict: bool = False
) -> Path | None:
    """The checkpoint to resume from.

    ``resume``: "never" -> None; "auto" -> the one ``latest`` names, or, when it fails to
    verify, the newest older one that does (each rejection is logged); None when there is none;
    anything else is a checkpoint directory (or a root with ``latest``) that must verify.
    ``strict``: with "auto", checkpoints present but none usable raise
    :class:`NoUsableCheckpointError` naming each one and why it was rejected (the driver's
    choice; starting over would overwrite the run's history).
    """
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if (path / LATEST).is_file():
            path = path / (path / LATEST).read_text().strip()
        if not path.is_dir():
            raise CheckpointError(
                f"trainer.resume={resume}: checkpoint {path} does not exist; point it at a step_* directory "
                "(or a checkpoints/ folder with a `latest` file), or use trainer.resume=auto"
            )
        verify_checkpoint(path, verify_checksums)
        return path
    root = Path(root)
    candidates = list_checkpoints(root)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named and _step_of(c) < _step_of(named)]
    rejected: list[str] = []
    for path in candidates:
        try:
            verify_checkpoint(path, verify_checksums)
        except CheckpointError as e:
            rejected.append(f"{path.name}: {e}")
            continue
        for why in rejected:
            log.warning("resume: skipping checkpoint %s", why)
        return path
    if rejected and not strict:
        log.warning("resume: no usable checkpoint under %s: %s", root, "; ".join(rejected))
    if strict and rejected:
        raise NoUsableCheckpointError(
            f"trainer.resume=auto found {len(rejected)} checkpoint(s) under {root} and none is usable ("
            + "; ".join(rejected)
            + "); repair or remove them, point trainer.resume=PATH at a good one, or start over with "
            "trainer.resume=never (the old metrics.jsonl is moved aside, not overwritten)"
        )
    return None


def _step_of(path: Path) -> int:
    tail = path.name[len(_PREFIX) :]
    return int(tail) if tail.isdigit() else -1


def _prune(root: Path, keep_last: int) -> None:
    for old in list_checkpoints(root)[keep_last:]:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    """This rank's RNG states: python, numpy, torch CPU, CUDA (if any), megatron's tracker."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded(data: Any) -> Any:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", data, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


# ---------------------------------------------------------------- save / load (collective)
def _layout_key(actor) -> dict[str, int]:
    lay = actor.layout
    return {
        "world": lay.world_size,
        "tp": lay.tp_size,
        "pp": lay.pp_size,
        "vpp": len(actor.model),
        "cp": lay.cp_size,
        "ep": lay.ep_size,
    }


_MODEL_PARALLEL = ("tp", "pp", "vpp", "cp", "ep")


def _optimizer_record(actor) -> dict[str, Any]:
    """Which optimizer wrote the checkpoint's "optimizer" entry, and in which format."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    distributed = any(isinstance(o, DistributedOptimizer) for o in inner)
    return {"distributed": distributed, "format": actor.optimizer_checkpoint_format if distributed else None}


def _allocate_torch_adam_state(actor) -> None:
    """Give a distributed optimizer that has not stepped yet the Adam state it would have.

    Without Transformer Engine or apex, megatron-core 0.16.1 steps a torch AdamW, whose state
    (and its "step") appears only at its first step, and ``DistributedOptimizer.state_dict()``,
    which every save and ``sharded_state_dict(is_loading=True)`` call, asserts on the missing
    step: a checkpoint before the first update, and every resume, would fail. The state made here
    is exactly what torch's AdamW makes at its first step (step 0, zero moments), so a later
    update is unchanged, and a load overwrites it."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for inner in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        if not isinstance(inner, distrib_optimizer.DistributedOptimizer):
            continue
        adam = inner.optimizer
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    if group.get("amsgrad"):
                        state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


@contextlib.contextmanager
def _step_kept_from_common_state(actor) -> Iterator[None]:
    """Load distributed-optimizer state into a torch AdamW (no Transformer Engine or apex).

    megatron-core 0.16.1 restores torch Adam's per-parameter "step" from the checkpoint's common
    state, then copies each parameter's tensors over it, and neither format carries the step
    there: ``load_parameter_state_from_fully_reshardable`` leaves it out on purpose ("handled
    separately", so the copy fails with KeyError('step')), and dp_reshardable's 0-dim step is not
    read back, so the copy writes the placeholder step of the optimizer the load started from
    (the resumed Adam's bias correction would restart). For the duration of the load the step is
    the common state's."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states
    if distrib_optimizer.HAVE_APEX_OR_TE:
        yield
        return

    def set_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            tensors = {**tensors, "step": self.optimizer.state[main_param]["step"]}
        return original(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        cls._set_main_param_and_optimizer_states = original


def _unshare_torch_adam_steps(actor) -> None:
    """After a load into a torch AdamW (no Transformer Engine or apex): megatron-core 0.16.1 gives
    every parameter's state the same "step" tensor object, and torch's AdamW increments each
    parameter's step in place, so one update would advance the shared count once per parameter
    and skew Adam's bias correction from then on. Each parameter gets its own copy."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for inner in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        if isinstance(inner, distrib_optimizer.DistributedOptimizer):
            for state in inner.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].clone()


def _optimizer_metadata(record: dict[str, Any]) -> dict[str, Any] | None:
    if not record["distributed"]:
        return None
    # mem_efficient: fully_reshardable gathers over the gloo DP group into host memory on DP rank
    # 0 only; without it megatron all-gathers every shard's whole state on every GPU.
    return {
        "distrib_optim_sharding_type": record["format"],
        "distrib_optim_fully_reshardable_mem_efficient": True,
    }


def optimizer_resume_error(
    saved: dict[str, Any], current: dict[str, Any], saved_layout, layout
) -> str | None:
    """Why the optimizer state saved as ``saved`` (an :func:`_optimizer_record`) with layout
    ``saved_layout`` cannot be loaded into an optimizer ``current`` at ``layout`` (None: it can)."""
    if saved["distributed"] != current["distributed"]:
        kind = {True: "the distributed optimizer", False: "the non-distributed optimizer"}
        return (
            f"it was saved by {kind[saved['distributed']]} and this run uses {kind[current['distributed']]}; "
            f"resume with parallel.use_distributed_optimizer={str(saved['distributed']).lower()}"
        )
    if saved["format"] == "dp_reshardable":
        saved_mp = {k: saved_layout.get(k, 1) for k in _MODEL_PARALLEL}
        mp = {k: layout[k] for k in _MODEL_PARALLEL}
        if saved_mp != mp:
            return (
                f"its distributed-optimizer state was written as dp_reshardable at {_fmt_layout(saved_layout)}, "
                f"which reshards only over data parallel, and this run is {_fmt_layout(layout)}; resume at "
                f"TP={saved_mp['tp']} PP={saved_mp['pp']} CP={saved_mp['cp']} EP={saved_mp['ep']} (any DP size), "
                "or save with parallel.optimizer_checkpoint_format=fully_reshardable"
            )
    return None


def _fmt_layout(layout: dict[str, int]) -> str:
    tp, pp, cp = layout.get("tp", 1), layout.get("pp", 1), layout.get("cp", 1)
    dp = layout.get("world", 1) // max(1, tp * pp * cp)
    parts = [f"TP={tp}", f"PP={pp}", f"CP={cp}", f"EP={layout.get('ep', 1)}", f"DP={dp}"]
    if layout.get("vpp", 1) > 1:
        parts.append(f"VPP={layout['vpp']}")
    return " ".join(parts)


def same_layout(saved: dict[str, int], current: dict[str, int]) -> bool:
    """Whether a checkpoint's per-rank state (RNG) means the same on every rank now. CP and EP change
    what a rank holds at the same world size (cp=2 vs dp=2), so they are part of it. A checkpoint that does not
    record them is taken as cp=1, ep=1; one saved at cp>1 or ep>1 before they were recorded then
    resumes without its RNG state, with the warning, rather than with another rank's."""
    return {"cp": 1, "ep": 1, **saved} == current


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    actor,
    *,
    trainer_state: dict[str, Any] | None = None,
    hf_dir: str | os.PathLike | None = None,
    keep_last: int = 3,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Save everything needed to resume after rollout step ``step``; returns the directory.

    Collective: every actor rank calls it. ``trainer_state`` is the driver's JSON-able state
    (data cursor, metrics line count, ...), returned by :func:`load_checkpoint`.
    ``extra_files``: {name in the checkpoint: a file the driver wrote beside ``root``} (the
    batches carried in async modes): rank 0 moves each into the checkpoint before the manifest
    is written, so the manifest covers it and it is published (or discarded) with the rest.
    """
    root = Path(root).absolute()
    final = root / step_dir_name(step)
    tmp = root / f".{final.name}.tmp"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    model_sd = model_sharded_state_dict(actor.model)
    optimizer = _optimizer_record(actor)
    _allocate_torch_adam_state(actor)
    extra = {
        "optimizer": actor.optimizer.sharded_state_dict(model_sd, metadata=_optimizer_metadata(optimizer)),
        "scheduler": actor.scheduler.state_dict(),
        "rng": _rng_sharded(rng_state()),
        "trainer": {
            "step": step,
            "actor_state": asdict(actor.state),
            "trainer_state": dict(trainer_state or {}),
            "layout": _layout_key(actor),
            "optimizer": optimizer,
        },
    }
    error = None
    try:
        save_model_checkpoint(actor.model, tmp, hf_dir=hf_dir, extra=extra)
        if dist.get_rank() == 0:
            for name, src in (extra_files or {}).items():
                os.replace(src, tmp / name)  # same file system (both under trainer.runs_dir)
    except OSError as e:  # a full disk, a quota: this rank's files are incomplete
        error = str(e)
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    error = next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)
    # collective: every rank agrees on `error`, so all of them take part or none
    entries = _gathered_manifest_entries(tmp) if error is None else None
    if dist.get_rank() == 0:
        try:
            if error is None:
                _publish(root, tmp, final, keep_last, entries)
        except OSError as e:
            error = f"rank 0: {e}"
        if error is not None:
            # the partial copy would only fill the disk further; `latest` still names the last good one
            shutil.rmtree(tmp, ignore_errors=True)
    error = _agreed(error)
    if error is not None:
        previous = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
        raise CheckpointError(
            f"saving checkpoint {final} failed ({error}); "
            + (
                f"the previous checkpoint {root / previous} is intact"
                if previous
                else "no earlier checkpoint exists"
            )
            + "; free space under trainer.runs_dir, then resume with trainer.resume=auto"
        )
    return final


def _publish(root: Path, tmp: Path, final: Path, keep_last: int, entries: dict | None) -> None:
    """Make a fully written ``tmp`` the checkpoint ``final`` and point ``latest`` at it.

    Each step is atomic (rename), in an order that keeps a usable ``latest`` at every instant:
    the manifest marks ``tmp`` complete, the rename publishes it, then the pointer moves."""
    write_manifest(tmp, entries)
    if final.exists():  # a re-save of the same step (a repeated stop): the pointer never names it twice
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / (LATEST + ".tmp")
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    _prune(root, keep_last)


def _agreed(value: Any) -> Any:
    """Rank 0's value on every rank (file checks must not diverge between ranks)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_checkpoint(
    actor,
    root: str | os.PathLike,
    resume: str = "auto",
    *,
    verify_checksums: bool = True,
    load_optimizer: bool = True,
) -> dict[str, Any] | None:
    """Restore ``actor`` (model, optimizer, scheduler, RNG, actor state) from the checkpoint
    :func:`find_resume_checkpoint` picks; returns the saved trainer record
    (``{"step", "trainer_state", "path", ...}``) or None when there is nothing to resume.
    Collective."""
    from megatron.core import dist_checkpointing

    found = None
    error = None
    if dist.get_rank() == 0:
        try:
            found = find_resume_checkpoint(root, resume, verify_checksums)
        except CheckpointError as e:
            error = str(e)
    found, error = _agreed((None if found is None else str(found), error))
    if error:
        raise CheckpointError(error)
    if found is None:
        return None
    common = torch.load(Path(found) / "common.pt", weights_only=False)
    record = common["trainer"]
    layout_unchanged = same_layout(record["layout"], _layout_key(actor))

    model_sd = model_sharded_state_dict(actor.model)
    request: dict[str, Any] = dict(model_sd)
    if load_optimizer:
        # Checkpoints from before the record was kept were all written by the non-distributed one.
        saved_optimizer = record.get("optimizer", {"distributed": False, "format": None})
        why = optimizer_resume_error(
            saved_optimizer, _optimizer_record(actor), record["layout"], _layout_key(actor)
        )
        if why is not None:
            raise CheckpointError(f"cannot resume the optimizer from checkpoint {found}: {why}")
        _allocate_torch_adam_state(actor)
        request["optimizer"] = actor.optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=_optimizer_metadata(saved_optimizer)
        )
    if layout_unchanged:
        request["rng"] = _rng_sharded(None)
    try:
        loaded = dist_checkpointing.load(request, found)
    except Exception as e:
        hint = ""
        if not layout_unchanged and load_optimizer:
            hint = (
                f" (saved with layout {record['layout']}, loading into {_layout_key(actor)}: megatron-core "
                "may not reshard this optimizer's state; resume with the saved layout or load_optimizer=False)"
            )
        raise CheckpointError(f"cannot load checkpoint {found}: {e}{hint}") from e
    for key, chunk in zip(model_keys(len(actor.model)), actor.model):
        unwrap(chunk).load_state_dict(loaded[key])
    if load_optimizer:
        # no_grad: with fp32 params the distributed optimizer's main params are views of the
        # model's leaf parameters, which an in-place copy under autograd refuses.
        with torch.no_grad(), _step_kept_from_common_state(actor):
            actor.optimizer.load_state_dict(loaded["optimizer"])
        _unshare_torch_adam_steps(actor)
        actor.scheduler.load_state_dict(common["scheduler"])
    else:
        # Model-only load: the fp32 master params still hold the old weights.
        actor.model_weights_changed()
    if layout_unchanged:
        set_rng_state(loaded["rng"])
    else:
        log.warning(
            "checkpoint %s was saved with layout %s; RNG states are not restored into %s",
            found,
            record["layout"],
            _layout_key(actor),
        )
    actor.state = ActorState(**record["actor_state"])
    return {**record, "path": found}
