"""A Hugging Face hub cache filled by hand, as `hf_hub_download` / `snapshot_download` leave it:
``<cache>/<type>s--<owner>--<name>/{blobs/<sha256>, snapshots/<commit>/<path> -> blob, refs/main}``.
Tests read it with ``HF_HUB_OFFLINE=1``: no network is needed or tried."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def fill_hub_cache(cache: Path, repo_id: str, files: dict[str, Path], repo_type: str = "model",
                   commit: str = "0" * 39 + "1", blob_name: str | None = None) -> Path:  # fmt: skip
    """Put ``files`` ({path in the repo: local file}) in ``cache`` as ``repo_id``'s ``main``;
    returns the snapshot directory. ``blob_name`` overrides the blobs' names (a torn download)."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for rel, src in files.items():
        data = Path(src).read_bytes()
        blob = repo / "blobs" / (blob_name or hashlib.sha256(data).hexdigest())
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def offline_env(cache: Path) -> dict[str, str]:
    """The environment of a process that reads only ``cache``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {
        **env,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(cache),
        "HF_HOME": str(cache.parent / "hf_home"),
    }
