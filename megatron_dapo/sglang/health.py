"""The one health poller for SGLang servers, launched here or given by URL.

`poll_health` asks `GET {url}{path}` until it answers 200, the deadline passes, or the watched
process dies; it returns what it saw and leaves the wording of the error to the caller, who knows
which setting to name. In SGLang 0.5.x `/health` and `/health_generate` run a real decode step, so
each request may take as long as the time left, not a few seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class HealthOutcome:
    """What the poll ended with: healthy, or the last answer seen and whether the process exited."""

    healthy: bool
    last: str
    exited: bool = False


def poll_health(
    url: str,
    timeout_s: float,
    *,
    path: str = "/health",
    api_key: str | None = None,
    poll_s: float = 0.5,
    alive: Callable[[], bool] | None = None,
) -> HealthOutcome:
    """Poll until 200 (healthy), `timeout_s` (not healthy), or `alive()` turning False (exited)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    with httpx.Client(headers=headers) as http:
        while True:
            if alive is not None and not alive():
                return HealthOutcome(False, last, exited=True)
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                r = http.get(url + path, timeout=httpx.Timeout(remaining, connect=min(2.0, remaining)))
                if r.status_code == 200:
                    return HealthOutcome(True, "HTTP 200")
                last = f"HTTP {r.status_code}: {r.text[:200]}".rstrip(": ")
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                return HealthOutcome(False, last)
            time.sleep(poll_s)
