"""Importing a user's Python file by path (``reward.custom_fn``, a call format, a tool): one module
per file, under a name of its own in ``sys.modules`` (so that the file's dataclasses and pickles
work, and naming the same file twice imports it once). The name hashes the path and the
contents, so a file edited between two imports in one process is imported anew, never served
stale. A leaf: anyone may import it."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_file(path: str | Path, prefix: str) -> ModuleType:
    """The module of the Python file at ``path``, imported once per process. Raises
    FileNotFoundError for a missing file, ImportError for one that is not a module, and whatever
    the file raises at import (nothing of it is left in ``sys.modules`` then)."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    digest = hashlib.sha256(str(path).encode() + b"\0" + path.read_bytes()).hexdigest()[:12]
    name = f"{prefix}_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
