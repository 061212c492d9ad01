"""The SGLang releases this package supports, and the one check of a version against them: the
client applies it to a running server's answer, the launcher to the interpreter it would start."""

from __future__ import annotations

from typing import Any

# The SGLang releases the client is written and tested against (tests/fixtures/sglang: 0.5.23);
# pinned the same in pyproject's `gpu` extra and the Dockerfile.
SUPPORTED_SGLANG = ((0, 5, 21), (0, 6, 0))  # [low, high)
SUPPORTED_SGLANG_TEXT = "sglang>=0.5.21,<0.6"


def parse_version(raw: Any) -> tuple[int, ...]:
    """``"0.5.23"`` / ``"0.5.10.post1"`` -> ``(0, 5, 23)``; unreadable -> ``()``."""
    parts = []
    for piece in str(raw or "").split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
        if len(parts) == 3:
            break
    return tuple(parts)


def unsupported(version: tuple[int, ...]) -> str | None:
    """Why ``version`` cannot be used ("SGLang 0.4.6 is not supported; ..."), or None when it can."""
    low, high = SUPPORTED_SGLANG
    if version and low <= version < high:
        return None
    shown = ".".join(map(str, version)) if version else "unknown"
    return f"SGLang {shown} is not supported; this release needs {SUPPORTED_SGLANG_TEXT}"
