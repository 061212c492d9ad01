"""Reading and writing HF safetensors checkpoints (single file or sharded with an index json).

The reader opens files lazily and reads only the requested rows/columns of a tensor
(``safe_open(...).get_slice``), so a rank of a large TP/PP layout touches just its shards. Errors
name the file or tensor at fault.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".distcp")
# Files of a megatron dist checkpoint that sit next to the copied HF metadata.
_NOT_HF_METADATA = {INDEX, "metadata.json", ".metadata", "common.pt", "megatron_dapo_model.json"}
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """A checkpoint on disk is missing, corrupt or does not match the model."""


class SafetensorsReader:
    """Lazy, slicing reader over an HF checkpoint directory (implements ``layout.SliceSource``)."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        self.dir = Path(hf_dir)
        self._handles: dict[str, object] = {}
        if not self.dir.is_dir():
            raise CheckpointError(f"HF checkpoint directory not found: {self.dir}")
        index = self.dir / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from e
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(
                    f"no safetensors weights in {self.dir} (expected {SINGLE} or {INDEX}); "
                    "convert .bin checkpoints with transformers save_pretrained(safe_serialization=True)"
                )
            weight_map = {}
            for f in files:
                for name in self._open(f.name).keys():  # noqa: SIM118 - safe_open is not a dict
                    weight_map[name] = f.name
        for f in sorted(set(weight_map.values())):
            if not (self.dir / f).is_file():
                raise CheckpointError(f"{self.dir / f} is listed in {INDEX} but missing")
        self.weight_map: dict[str, str] = weight_map

    def _open(self, file: str):
        if file not in self._handles:
            from safetensors import SafetensorError, safe_open

            try:
                self._handles[file] = safe_open(str(self.dir / file), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"corrupt or unreadable safetensors file {self.dir / file}: {e}") from e
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise CheckpointError(f"tensor {name!r} not found in {self.dir}")
        return self._open(self.weight_map[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._slice(name).get_dtype()]

    def slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        sl = self._slice(name)
        try:
            if dim == 0:
                return sl[start:stop]
            return sl[:, start:stop]
        except Exception as e:  # safetensors raises its own error types for truncated data
            raise CheckpointError(f"cannot read {name!r} from {self.dir / self.weight_map[name]}: {e}") from e

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``."""
        self._slice(name)  # raises naming the tensor if absent
        return self._open(self.weight_map[name]).get_tensor(name)


def copy_hf_metadata(hf_dir: str | os.PathLike, target_dir: str | os.PathLike) -> list[str]:
    """Copy config.json, generation config and tokenizer files (every non-weight file at the top
    level of ``hf_dir``) into ``target_dir``; returns the copied file names."""
    src, dst = Path(hf_dir), Path(target_dir)
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src / 'config.json'} not found (expected an HF model directory)")
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _NOT_HF_METADATA:
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


class ShardedSafetensorsWriter:
    """Writes named tensors as HF safetensors shards; ``close()`` names them
    ``model-0000i-of-0000N.safetensors`` with an index json (or ``model.safetensors`` if one)."""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 5 << 30) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._parts: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
                self._flush()
            self._pending[name] = t.detach().to("cpu").contiguous()
            self._pending_bytes += nbytes
            self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        part = f".part-{len(self._parts):05d}.safetensors"
        save_file(self._pending, str(self.dir / part), metadata={"format": "pt"})
        self._parts.append((part, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        if self._pending or not self._parts:
            self._flush()
        n = len(self._parts)
        if n == 1:
            os.replace(self.dir / self._parts[0][0], self.dir / SINGLE)
            return [SINGLE]
        weight_map, files = {}, []
        for i, (part, names) in enumerate(self._parts):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / part, self.dir / final)
            files.append(final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return files


def write_all(
    tensors: Iterable[dict[str, torch.Tensor]], out_dir, max_shard_bytes: int = 5 << 30
) -> list[str]:
    """Write every bucket of ``tensors`` into ``out_dir`` as HF safetensors shards."""
    writer = ShardedSafetensorsWriter(out_dir, max_shard_bytes)
    for bucket in tensors:
        writer.add(bucket)
    return writer.close()
