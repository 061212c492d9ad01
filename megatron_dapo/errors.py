"""How a failure reaches the user: one line on stderr, an exit status, the traceback in a file.

Exit status 2: bad input the user can fix (a path, a key, a URL, a file's contents); 1: a
failure during the run. Errors raised inside Ray actors or training ranks arrive wrapped
(`RankCallError`, Ray's `RayTaskError`, `RankFailed`); `root_cause` unwraps them so the line
names what actually went wrong, not the transport that carried it.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from pathlib import Path

# By class name (and base classes), so that classifying a failure imports nothing heavy.
BAD_INPUT = {
    "ConfigError",
    "DataError",
    "CheckpointError",
    "ModelConfigError",
    "UnknownDataSourceError",
    "EndpointUnreachable",
    "FileNotFoundError",
    "NotADirectoryError",
    "IsADirectoryError",
    "PermissionError",
    "FileExistsError",
    "UnicodeDecodeError",
}

# Where the traceback of a failure goes; a command that knows its run directory sets it.
_log_dir: Path | None = None


def set_log_dir(path: str | os.PathLike | None) -> None:
    global _log_dir
    _log_dir = Path(path) if path is not None else None


def _names(exc: BaseException) -> set[str]:
    names = getattr(exc, "type_names", None)  # a spawned rank's error, by name
    return set(names) if names else {c.__name__ for c in type(exc).__mro__}


def root_cause(exc: BaseException) -> BaseException:
    """The error a user can act on, out of the wrappers that carried it to the driver."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        causes = getattr(exc, "causes", None)  # RankCallError: every failed rank's error
        if causes:
            # a rank that failed on its own input beats one that only saw its peer disappear
            exc = next((c for c in causes if is_bad_input(c)), causes[0])
            continue
        inner = getattr(exc, "cause", None)  # Ray's RayTaskError
        if isinstance(inner, BaseException) and "RayTaskError" in _names(exc):
            exc = inner
            continue
        break
    return exc


def is_bad_input(exc: BaseException) -> bool:
    return bool(_names(exc) & BAD_INPUT)


def one_line(exc: BaseException) -> str:
    """The exception's message as a single line (a Ray traceback keeps only its last line)."""
    text = str(exc).strip()
    if "Traceback (most recent call last)" in text:
        text = [line for line in text.splitlines() if line.strip()][-1]
    if isinstance(exc, UnicodeDecodeError):
        text = f"not UTF-8 text: {exc.reason} at byte {exc.start}"
    if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in text:
        text = f"{text}: {exc.filename}"
    text = " ".join(text.split()) or type(exc).__name__
    context = getattr(exc, "megatron_dapo_context", None)
    return f"{text}; {context}" if context else text


def write_traceback(exc: BaseException, log_name: str = "error.log") -> Path | None:
    """The full traceback in the run directory (or a temporary file); None if it cannot be written."""
    text = "".join(traceback.format_exception(exc))
    try:
        if _log_dir is not None and _log_dir.is_dir():
            path = _log_dir / log_name
            path.write_text(text)
            return path
        fd, name = tempfile.mkstemp(prefix="megatron-dapo-error-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return Path(name)
    except OSError:
        return None


def report(exc: BaseException, debug: bool = False, log_name: str = "error.log") -> tuple[int, str]:
    """(exit status, the line to print) for a failure that reached the command line."""
    cause = root_cause(exc)
    if (
        cause is not exc
        and getattr(exc, "megatron_dapo_context", None)
        and not getattr(cause, "megatron_dapo_context", None)
    ):
        cause.megatron_dapo_context = exc.megatron_dapo_context
    status = 2 if is_bad_input(cause) else 1
    kind = "error" if status == 2 else "failed"
    line = f"{kind}: {one_line(cause)}"
    if not debug:
        where = write_traceback(exc, log_name)
        if where is not None:
            line += f" (traceback: {where}; --debug prints it here)"
    return status, line
