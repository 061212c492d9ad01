"""`megatron-dapo data prepare NAME --out DIR`: the verl parquet files the recipes name.

Each data set comes from the Hugging Face hub (``hf_hub_download``: the shared hub cache,
``HF_HUB_OFFLINE`` honoured, a pinnable revision) or from a local copy, and is written in verl's
layout with the DAPO template applied (``data_source=math_dapo``, ``prompt`` as one user message,
``reward_model.ground_truth``, ``extra_info``), as ``DIR/<file_name>``. What was read is checked:
a hub file against the sha256 the hub's cache names its blob by, a known copy against its
recorded sha256 and row count; the output's row count equals the input's, and its sha256 and the
source's go to ``DIR/<file_name>.json``, which a rerun checks instead of writing again.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from megatron_dapo.data.templates import DAPO_TEMPLATE, DAPO_TEMPLATE_MARKER, PLACEHOLDER
from megatron_dapo.data.types import DataError


@dataclass(frozen=True)
class KnownCopy:
    """A copy of a data set measured once: its file's sha256 and row count."""

    rows: int
    origin: str


@dataclass(frozen=True)
class DatasetSpec:
    file_name: str  # what the recipes name under data/
    hub_repo: str  # a hub *dataset* repository
    hub_file: str
    known: dict[str, KnownCopy] = field(default_factory=dict)  # sha256 -> copy


DATASETS: dict[str, DatasetSpec] = {
    "dapo-math-17k": DatasetSpec(
        "dapo-math-17k.parquet",
        "BytedTsinghua-SIA/DAPO-Math-17k",
        "data/dapo-math-17k.parquet",
        {
            "246ae23df97c9eae8126cb4da780e9a0a31d10110e16eed144bcecbf2132d535": KnownCopy(
                17917, "MasterVito/SvS data/dapo_math_17k.parquet (a deduplicated copy; bare problems)"
            ),
        },
    ),
    "aime-2024": DatasetSpec(
        "aime-2024.parquet",
        "BytedTsinghua-SIA/AIME-2024",
        "data/aime-2024.parquet",
        {
            "12154e38a716d12db5731f9a022ae69a610c4f7d0e0dcc04e902887a686877e7": KnownCopy(
                960, "the DAPO release's eval/aime-2024.parquet (30 problems x 32)"
            ),
        },
    ),
}


@dataclass(frozen=True)
class Prepared:
    path: Path
    rows: int
    sha256: str
    source: str
    reused: bool = False


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def spec_for(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise DataError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
    return DATASETS[name]


def from_hub(spec: DatasetSpec, revision: str | None) -> Path:
    """The hub file in the hub cache (downloaded once; ``HF_HUB_OFFLINE=1``: the cache only), its
    content checked against the sha256 the cache names its blob by."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        path = Path(hf_hub_download(spec.hub_repo, spec.hub_file, repo_type="dataset", revision=revision))
    except LocalEntryNotFoundError as e:
        offline = " (HF_HUB_OFFLINE is set: only the hub cache is read)" if _offline() else ""
        raise DataError(
            f"{spec.hub_repo}/{spec.hub_file} is not in the hub cache and cannot be downloaded{offline}; "
            "download it where there is network, or give a local copy with --from FILE"
        ) from e
    except (HfHubHTTPError, OSError) as e:
        raise DataError(f"{spec.hub_repo}/{spec.hub_file}: {' '.join(str(e).split())}") from e
    blob = path.resolve().name
    if len(blob) == 64 and all(c in "0123456789abcdef" for c in blob):  # an LFS blob: named by its sha256
        got = sha256_of(path)
        if got != blob:
            raise DataError(
                f"{path}: sha256 {got} differs from the hub's {blob} (a torn download); delete it and rerun"
            )
    return path


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def verl_rows(records: list[dict], split: str) -> list[dict]:
    """verl's layout with the DAPO template on each problem (a problem that has it stays as it is)."""
    out = []
    for i, r in enumerate(records):
        prompt = r.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
            text = str(prompt[-1].get("content", ""))
        elif isinstance(prompt, str):
            text = prompt
        else:
            text = str(r.get("problem") or "")
        answer = (r.get("reward_model") or {}).get("ground_truth", r.get("answer"))
        if not text or answer is None or str(answer) == "":
            raise DataError(f"row {i}: no problem text or no ground truth (columns: {sorted(r)})")
        problem = text if DAPO_TEMPLATE_MARKER in text else DAPO_TEMPLATE.replace(PLACEHOLDER, text)
        raw = (r.get("extra_info") or {}).get("raw_problem") or text
        out.append(
            {
                "data_source": "math_dapo",
                "prompt": [{"role": "user", "content": problem}],
                "ability": "MATH",
                "reward_model": {"ground_truth": str(answer), "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": i, "raw_problem": raw, "split": split},
            }
        )
    return out


def prepare(name: str, out_dir: Path, source: Path | None = None, revision: str | None = None) -> Prepared:
    """Write ``out_dir/<file_name>`` for data set ``name`` from ``source`` (a local copy) or the hub."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = spec_for(name)
    out = Path(out_dir) / spec.file_name
    manifest = out.with_name(out.name + ".json")
    if out.is_file() and manifest.is_file():
        recorded = json.loads(manifest.read_text())
        if sha256_of(out) == recorded.get("sha256"):
            return Prepared(out, recorded["rows"], recorded["sha256"], recorded["source"], reused=True)
    if source is not None and not Path(source).is_file():
        raise DataError(f"--from {source}: no such file")
    path = Path(source) if source is not None else from_hub(spec, revision)
    digest = sha256_of(path)
    try:
        records = pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise DataError(f"{path}: not a readable parquet file ({e})") from e
    known = spec.known.get(digest)
    if known is not None and len(records) != known.rows:
        raise DataError(f"{path}: {len(records)} rows, {known.rows} expected for {known.origin}")
    rows = verl_rows(records, "test" if name.startswith("aime") else "train")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    written = pq.read_metadata(tmp).num_rows
    if written != len(records):
        raise DataError(f"{tmp}: {written} rows written of {len(records)} read")
    os.replace(tmp, out)
    origin = known.origin if known else f"{path} (not a copy measured before: its row count is not checked)"
    result = Prepared(out, written, sha256_of(out), origin)
    manifest.write_text(
        json.dumps(
            {
                "name": name,
                "rows": written,
                "sha256": result.sha256,
                "source": origin,
                "source_sha256": digest,
            },
            indent=1,
        )
        + "\n"
    )
    return result
