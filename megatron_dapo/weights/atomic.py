"""Write a directory completely or not at all: into a temporary sibling, renamed at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``target``; on success it becomes ``target``,
    on error it is removed and ``target`` is untouched. An existing non-empty ``target`` is an
    error unless ``overwrite``."""
    target = Path(target).absolute()
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise FileExistsError(f"{target} already exists and is not empty; choose another path or overwrite")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
