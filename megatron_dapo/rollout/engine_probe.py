"""Noticing an engine that hangs while it holds requests (issue 10).

A server that stops answering in the middle of a rollout (a wedged scheduler, a SIGSTOPped or
swapped-out process, a node that lost its network) would otherwise be noticed only when its
requests reach ``rollout.request_timeout_s`` (30 minutes by default), the whole step waiting.

The rollout manager tells an :class:`InFlightProbe` when an engine gets work while it had none
(``busy``), when one of its calls returns (``heard``) and when it has no call left (``idle``).
An engine that has calls in flight and has returned nothing for ``interval_s`` is asked
``health()`` once, on a probe thread, never per request; a healthy answer counts as hearing from
it, so a busy engine is asked at most once per ``interval_s``, and one that keeps returning calls
is never asked. A failed (False or raising) probe is reported by ``poll``; the manager then
takes the engine as dead.

Why probing only silent engines is enough, and cheap: in SGLang 0.5.x ``GET /health`` of a
server that is generating answers as soon as its scheduler produced any output (it does not wait
behind the queue), a hung one does not answer within the client's ``health_timeout_s``, and a
scheduler that is stuck while its HTTP process lives answers 503 after SGLang's own 20 s. So a
hang costs at most ``interval_s + health_timeout_s`` instead of ``request_timeout_s``.

Time comes from ``clock`` (``time.monotonic`` in a run): tests step a fake clock instead of
sleeping, and wait on the probe's futures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class InFlightProbe:
    """Health probes for engines with calls in flight that went silent (module doc)."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        # interval_s > 0: config/validate.py refuses rollout.health_probe_interval_s otherwise
        self.interval_s = float(interval_s)
        self.clock = clock
        self._silent_since: dict[str, float] = {}  # busy engine -> when it was last heard from
        self._running: dict[str, tuple[Any, Future, int]] = {}  # engine, probe, replies at its start
        self._replies: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.probes = 0  # started, for tests and logs

    def busy(self, name: str) -> None:
        """The engine got work while it had none: its silence starts now."""
        self._silent_since.setdefault(name, self.clock())

    def heard(self, name: str) -> None:
        """A call of the engine returned (or it passed a probe): it answers."""
        self._replies[name] = self._replies.get(name, 0) + 1
        if name in self._silent_since:
            self._silent_since[name] = self.clock()

    def idle(self, name: str) -> None:
        """The engine has no call in flight: nothing to wait on, nothing to probe."""
        self._silent_since.pop(name, None)

    def futures(self) -> list[Future]:
        """The probes running, for the manager to wait on alongside its calls."""
        return [fut for _, fut, _ in self._running.values()]

    def poll(self, engines: dict[str, Any]) -> list[tuple[Any, float]]:
        """Start the probes that are due among ``engines`` (the busy ones, by name) and collect the
        finished ones; each engine whose probe failed, with how long it had been silent."""
        now = self.clock()
        failed = []
        for name, (engine, fut, replies) in list(self._running.items()):
            if not fut.done():
                continue
            del self._running[name]
            if fut.exception() is None and bool(fut.result()):
                self.heard(name)
            # a call that came back while the probe ran says it serves; an idle one needs no verdict
            elif name in self._silent_since and self._replies.get(name, 0) == replies:
                failed.append((engine, now - self._silent_since.pop(name)))
        for name, since in self._silent_since.items():
            if name in engines and name not in self._running and now - since >= self.interval_s:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="engine-probe")
                probe = self._pool.submit(engines[name].health)
                self._running[name] = (engines[name], probe, self._replies.get(name, 0))
                self.probes += 1
        return failed

    def close(self) -> None:
        """Stop waiting for probes (a probe of a hung server returns by its own timeout)."""
        self._running.clear()
        self._silent_since.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
