"""Raw record readers: parquet, jsonl (or a JSON array) and HF ``datasets`` names."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_dapo.data.types import DataError

FORMATS = ("auto", "parquet", "jsonl", "hf")


def resolve_format(path_or_name: str, format: str) -> str:
    """The concrete format of a source: by file extension, or ``hf`` for a non-file name."""
    if format not in FORMATS:
        raise DataError(f"unknown data format {format!r}; choose one of {', '.join(FORMATS)}")
    if format != "auto":
        return format
    path = Path(path_or_name)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if path.exists():
        raise DataError(
            f"{path_or_name}: cannot tell the format from the extension; use .parquet/.jsonl or set "
            "data.format to parquet or jsonl"
        )
    return "hf"


def read_records(path_or_name: str, format: str) -> tuple[list, list[str]]:
    """``(records, where)``: the raw rows, and for each a location for error messages
    (``"row 5"``, 0-based, for parquet/HF/JSON arrays; ``"line 7"``, 1-based, for jsonl).

    A jsonl line that is not valid JSON comes back as a :class:`DataError` record.
    """
    fmt = resolve_format(path_or_name, format)
    if fmt == "hf":
        records = _read_hf(path_or_name)
    else:
        path = Path(path_or_name)
        if not path.is_file():
            raise DataError(f"{path_or_name}: no such file")
        if fmt == "jsonl":
            return _read_jsonl(path)
        records = _read_parquet(path)
    return records, [f"row {i}" for i in range(len(records))]


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e


def read_utf8(path: Path) -> str:
    """A text file's contents; bytes that are not UTF-8 are a DataError naming file, byte and line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}: not UTF-8 text at byte offset {e.start} (line {line}: {e.reason}); "
            "re-encode the file as UTF-8, e.g. iconv -f latin1 -t utf-8"
        ) from None


def _read_jsonl(path: Path) -> tuple[list, list[str]]:
    text = read_utf8(path)
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON array ({e})") from e
        return records, [f"row {i}" for i in range(len(records))]
    records, where = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            # kept as a record so that skip_bad_rows can skip it like any other bad row
            records.append(DataError(f"invalid JSON ({e.msg})"))
        where.append(f"line {lineno}")
    return records, where


def _read_hf(name: str) -> list[dict]:
    """``owner/name`` or ``owner/name:split`` (default split ``train``) via HF ``datasets``."""
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"{name!r} is not a file, and reading it as a Hugging Face dataset needs the `datasets` "
            "package (pip install datasets) and network access; or download it and pass the parquet path"
        ) from e
    repo, _, split = name.partition(":")
    try:
        return list(datasets.load_dataset(repo, split=split or "train"))
    except Exception as e:
        raise DataError(
            f"could not load Hugging Face dataset {repo!r} split {split or 'train'!r} "
            f"({type(e).__name__}: {e}); check the name and network, or pass a local parquet/jsonl path"
        ) from e
