"""An HTTP error answer as one line that carries the server's own reason.

Servers put the reason in the body, in one of a few shapes: OpenAI-style ``{"error": {"message":
...}}`` (SGLang's native routes, vLLM), ``{"object": "error", "message": ...}`` (SGLang's and
older vLLM's OpenAI routes), FastAPI's ``{"detail": ...}``, or plain text. httpx's own
``raise_for_status`` message names only the status, which is why these lines are built here.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

MESSAGE_LIMIT = 500  # characters of the server's message kept in the line


def _from_json(body: Any) -> str | None:
    if isinstance(body, str):
        return body
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(error, str) and error:
        return error
    if body.get("message"):
        return str(body["message"])
    detail = body.get("detail")
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):  # FastAPI's validation errors: [{"loc": [...], "msg": ...}]
        msgs = [
            f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" if isinstance(d, dict) else str(d)
            for d in detail
        ]
        return "; ".join(msgs)
    return None


def server_message(response: httpx.Response) -> str:
    """The reason the server gave in the answer's body, on one line (empty when it gave none)."""
    try:
        text = response.text
    except (httpx.ResponseNotRead, UnicodeDecodeError):
        return ""
    try:
        message = _from_json(json.loads(text)) or text
    except ValueError:
        message = text
    message = " ".join(message.split())
    if len(message) > MESSAGE_LIMIT:
        message = message[:MESSAGE_LIMIT] + "..."
    return message


def http_error(response: httpx.Response, what: str | None = None) -> str:
    """``HTTP 400 Bad Request: <server's message> (POST <url>[, <what>])``.

    ``what`` names the problem or request the call was for (e.g. ``"problem 3"``, ``"request r1"``).
    """
    status = f"HTTP {response.status_code} {response.reason_phrase}".rstrip()
    message = server_message(response)
    try:
        request = response.request
        where = f"{request.method} {request.url}"
    except RuntimeError:  # a response built by hand has no request
        where = ""
    where = ", ".join(p for p in (where, what) if p)
    return f"{status}: {message or '(empty body)'}" + (f" ({where})" if where else "")
