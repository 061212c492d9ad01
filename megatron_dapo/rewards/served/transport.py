"""POSTs to a set of reward servers: retries, back-off, a bound on requests in flight per server,
and the failure each exhausted request ends in.

What is retried: timeouts, HTTP 5xx, HTTP 429 (rate limited) and 408 (request timeout), and
refused or dropped connections (the next attempt goes to the least busy server that is not known
to be down, so a dead server's samples move to the others). A 429 or 408 waits what its
``Retry-After`` says (seconds or an HTTP date, at most ``_RETRY_AFTER_MAX_S``), else the usual
back-off, and is counted on the outcome (``throttled``). A 400 that says the prompt is
longer than the model's context is this sample's failure (``too_long``, not retried). What is
not: any other HTTP 4xx (the request itself is wrong; :class:`RewardRequestError`), and
an answer that is not JSON (a server that answers garbage answers it again). Scoring is
read-only, so a retry can never do harm on the server, unlike a rollout's ``/generate``.

A server is *down* from the first refused or dropped connection until it answers again. One that
stays down longer than ``down_grace_s`` makes the next request routed to it, or :meth:`check_down`,
raise :class:`RewardServerDown`: the run stops with one line instead of leaving every sample
unscored. Restarting servers is the caller's business; :meth:`ServerPool.mark_restarted` tells
the pool one is back.

A *supervised* pool (the run started the servers and restarts the dead ones:
:meth:`ServerPool.mark_supervised`) treats a refused or dropped connection as a server that is
being restarted, not as a failed attempt: with no other server up, the request waits for one to
come back (the supervisor's ``mark_restarted``), for one lost for good (``mark_lost``: the run
stops) or for the down grace, and is then sent again. A server dies between two of the
supervisor's polls; a request failed "down" in those seconds would leave its group, so every
restart would cost a step its groups. A server given by URL has no one to restart it: its
requests fail "down" after their retries, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from megatron_dapo.http_errors import http_error
from megatron_dapo.rewards.served.outcome import RewardRequestError, RewardServerDown

_CONNECT_TIMEOUT_S = 10.0
# requests one httpx client carries at once (see ServerPool.__init__)
_PER_CLIENT = 8
# a down server is tried again after this long (doubling per failure), so a restarted one that
# nobody announced still gets traffic back
_DOWN_RETRY_FIRST_S = 1.0
_DOWN_RETRY_MAX_S = 30.0
# the longest a Retry-After is honoured: a hosted judge asking for an hour must not stall a step
_RETRY_AFTER_MAX_S = 60.0
# how SGLang, vLLM and OpenAI word a 400 for a prompt past the model's context: the sample is
# unscored "too_long", not a wrong request that stops the run
_TOO_LONG = re.compile(r"context length|maximum context|context window", re.IGNORECASE)


@dataclass
class Failure:
    """Why a request produced no answer after its attempts: an ``UNSCORED_REASONS`` entry and the
    last error as one line."""

    reason: str
    detail: str
    server: str
    attempts: int
    retry_after: float | None = None  # what a 429/408 asked to wait before the next attempt
    throttled: int = 0  # 429/408 answers among the attempts


@dataclass
class Answer:
    """A 200 answer: the decoded JSON, from which server, after how many attempts."""

    body: Any
    server: str
    attempts: int
    throttled: int = 0  # 429/408 answers before this one


@dataclass
class _Server:
    url: str
    limit: asyncio.Semaphore
    in_flight: int = 0
    peak_in_flight: int = 0
    down_since: float | None = None
    down_failures: int = 0
    retry_at: float = 0.0
    last_error: str = ""
    requests: int = field(default=0)

    def usable(self, now: float) -> bool:
        return self.down_since is None or now >= self.retry_at


class ServerPool:
    """Async POSTs to ``urls`` with retries; create and use it inside one event loop.

    Args:
        urls: the servers (``http://host:port``), all serving the same model.
        timeout_s: the longest one attempt may take, start to end of the answer.
        max_retries: attempts after the first for timeouts, 5xx and connection failures.
        max_in_flight: requests in flight per server; more wait for a free slot, and that wait
            is not part of ``timeout_s``.
        down_grace_s: how long a server may stay unreachable before :class:`RewardServerDown`.
        backoff_s: the first wait before a retry, doubled per retry (capped at 8x).
        api_key: sent as ``Authorization: Bearer`` (SGLang's ``--api-key``, OpenAI-style servers).
        what: names the pool in error lines (e.g. ``"reward judge"``).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float,
        max_retries: int,
        max_in_flight: int,
        down_grace_s: float,
        backoff_s: float = 0.5,
        api_key: str | None = None,
        what: str = "reward server",
    ):
        if not urls:
            raise ValueError(f"{what}: no server URLs")
        if timeout_s <= 0 or max_retries < 0 or max_in_flight < 1 or down_grace_s <= 0:
            raise ValueError(
                f"{what}: timeout_s={timeout_s} must be > 0, max_retries={max_retries} >= 0, "
                f"max_in_flight={max_in_flight} >= 1, down_grace_s={down_grace_s} > 0"
            )
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.down_grace_s = float(down_grace_s)
        self.backoff_s = float(backoff_s)
        self.what = what
        self.lost: str | None = None  # why the run must stop (mark_lost)
        self.supervised = False  # a dead server is restarted by the run (mark_supervised)
        self.servers = [_Server(u.rstrip("/"), asyncio.Semaphore(int(max_in_flight))) for u in urls]
        self._back = asyncio.Event()  # set when the supervisor reports a server restarted
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # connections are bounded by the semaphores, not by httpx's pool (its wait would count
        # against the timeout); and spread over clients of at most _PER_CLIENT requests each:
        # httpcore's pool scans every request and connection it holds (a select() per idle
        # connection) at each request's start and end, so one pool of 512 spends its time
        # scanning (docs/reward_models.md, "Scoring under load")
        shards = max(1, math.ceil(int(max_in_flight) * len(self.servers) / _PER_CLIENT))
        self._clients = [
            httpx.AsyncClient(
                headers=headers,
                timeout=httpx.Timeout(self.timeout_s, connect=min(_CONNECT_TIMEOUT_S, self.timeout_s)),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            )
            for _ in range(shards)
        ]
        self._client_load = [0] * shards
        self._http = self._clients[0]  # for the odd GET

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def peak_in_flight(self) -> dict[str, int]:
        """The most requests each server had in flight at once so far."""
        return {s.url: s.peak_in_flight for s in self.servers}

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()

    def mark_supervised(self) -> None:
        """The run restarts these servers when they die: a refused connection waits for the
        restart instead of failing the sample (see the module)."""
        self.supervised = True

    def mark_restarted(self, url: str) -> None:
        """The caller restarted the server at ``url``: route requests to it again at once."""
        for s in self.servers:
            if s.url == url.rstrip("/"):
                s.down_since, s.down_failures, s.retry_at = None, 0, 0.0
        self._back.set()

    def mark_down(self, url: str, why: str) -> None:
        """The caller is restarting the server at ``url``: route nothing to it (while another
        server is up) until :meth:`mark_restarted`; its down grace runs from now."""
        self.supervised = True
        for s in self.servers:
            if s.url == url.rstrip("/"):
                if s.down_since is None:
                    s.down_since = time.monotonic()
                s.retry_at, s.last_error = float("inf"), why

    def mark_lost(self, message: str) -> None:
        """A server is gone for good (restarted too often): :meth:`check_down` raises ``message``."""
        self.lost = message
        self._back.set()

    def check_down(self) -> None:
        """Raise :class:`RewardServerDown` when some server has been down past the grace, or
        was lost for good."""
        if self.lost is not None:
            raise RewardServerDown(self.lost)
        now = time.monotonic()
        for s in self.servers:
            self._check_grace(s, now)

    async def get(self, path: str) -> Any:
        """``GET path`` on the first server, one attempt (server information, not scoring)."""
        server = self.servers[0]
        r = await self._http.get(server.url + path)
        if r.status_code != 200:
            raise RewardRequestError(f"{self.what}: {http_error(r)}")
        return r.json()

    async def post(self, path: str, payload: dict, sample: str) -> Answer | Failure:
        """``POST path`` with retries; the JSON answer, or the :class:`Failure` it ended in.

        Raises :class:`RewardRequestError` on a 4xx and :class:`RewardServerDown` for a server
        down past the grace; ``sample`` names the sample in those lines."""
        failure: Failure | None = None
        throttled = 0
        attempt = 0
        await self._wait_for_a_server()
        while True:
            server = self._pick()
            result = await self._attempt(server, path, payload, sample)
            if isinstance(result, Answer):
                result.attempts, result.throttled = attempt + 1, throttled
                return result
            failure = result
            if failure.reason == "down" and self.supervised:
                # being restarted (or about to be, at the supervisor's next poll): wait for it,
                # not an attempt spent; past the grace the next attempt raises RewardServerDown
                await self._wait_for_a_server()
                continue
            throttled += failure.retry_after is not None  # a 429 or 408
            failure.attempts, failure.throttled = attempt + 1, throttled
            attempt += 1
            if failure.reason in ("unparseable", "too_long") or attempt > self.max_retries:
                return failure
            wait = self.backoff_s * 2 ** min(attempt - 1, 3)
            if failure.retry_after is not None:
                wait = failure.retry_after
            await asyncio.sleep(wait)

    async def _wait_for_a_server(self) -> None:
        """In a supervised pool, while no server is up (each down since a refused connection, or
        marked down by the supervisor while it restarts it), wait for one to come back instead of
        failing as down: a restart takes seconds to a minute, and a sample failed meanwhile leaves
        its group, so one restart could empty a step. The wait ends when a server may be tried
        again (back, or its retry time come), when one is lost for good, or at the down grace
        (the request then goes on and its grace check raises RewardServerDown)."""
        while self.supervised and self.lost is None:
            now = time.monotonic()
            if any(s.usable(now) for s in self.servers):
                return
            since = min(s.down_since for s in self.servers if s.down_since is not None)
            left = self.down_grace_s - (now - since)
            if left <= 0:
                return
            retry = min(s.retry_at for s in self.servers) - now
            self._back.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._back.wait(), max(min(left, retry, 1.0), 0.01))

    def _pick(self) -> _Server:
        now = time.monotonic()
        usable = [s for s in self.servers if s.usable(now)] or self.servers
        # least busy first; among equals the one asked least, so idle servers share the work
        return min(usable, key=lambda s: (s.in_flight, s.requests))

    async def _attempt(self, server: _Server, path: str, payload: dict, sample: str) -> Answer | Failure:
        self._check_grace(server, time.monotonic())
        async with server.limit:
            server.in_flight += 1
            server.requests += 1
            server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
            try:
                # httpx's read timeout restarts with every chunk; this bounds the whole answer
                shard = min(range(len(self._clients)), key=self._client_load.__getitem__)
                self._client_load[shard] += 1
                try:
                    r = await asyncio.wait_for(
                        self._clients[shard].post(server.url + path, json=payload), self.timeout_s
                    )
                finally:
                    self._client_load[shard] -= 1
                body = r.content
            except (asyncio.TimeoutError, httpx.TimeoutException) as e:
                if isinstance(e, httpx.ConnectTimeout):
                    return self._down(server, f"connect timeout: {e}")
                return Failure(
                    "timeout", f"no answer within {self.timeout_s:g}s ({server.url}{path})", server.url, 0
                )
            except httpx.TransportError as e:  # refused, reset, or closed mid-answer
                return self._down(server, f"{type(e).__name__}: {e}".rstrip(": "))
            finally:
                server.in_flight -= 1
        self._up(server)
        where = f"sample {sample}"
        if r.status_code >= 500:
            return Failure("server_error", http_error(r, where), server.url, 0)
        if r.status_code in (408, 429):  # busy, not wrong: wait as asked and try again
            reason = "rate_limited" if r.status_code == 429 else "timeout"
            detail = http_error(r, where)
            return Failure(reason, detail, server.url, 0, retry_after=_retry_after(r, self.backoff_s))
        if r.status_code == 400 and _TOO_LONG.search(r.text):  # a prompt past the context: this sample's
            return Failure("too_long", http_error(r, where), server.url, 0)
        if r.status_code >= 400:
            raise RewardRequestError(f"{self.what}: {http_error(r, where)}")
        try:
            return Answer(json.loads(body), server.url, 0)
        except ValueError:
            text = body[:200].decode(errors="replace")
            return Failure(
                "unparseable", f"answer is not JSON ({server.url}{path}, {where}): {text!r}", server.url, 0
            )

    def _down(self, server: _Server, error: str) -> Failure:
        now = time.monotonic()
        if server.down_since is None:
            server.down_since = now
        server.down_failures += 1
        # the exponent is capped: a server down for long fails every request of the step quickly
        backoff = _DOWN_RETRY_FIRST_S * 2.0 ** min(server.down_failures - 1, 30)
        # a server the supervisor is restarting stays out of use until it reports it back
        server.retry_at = max(server.retry_at, now + min(backoff, _DOWN_RETRY_MAX_S))
        server.last_error = error
        return Failure("down", f"{server.url}: {error}", server.url, 0)

    def _up(self, server: _Server) -> None:
        server.down_since, server.down_failures, server.retry_at = None, 0, 0.0

    def _check_grace(self, server: _Server, now: float) -> None:
        if self.lost is not None:
            raise RewardServerDown(self.lost)
        if server.down_since is not None and now - server.down_since > self.down_grace_s:
            raise RewardServerDown(
                f"{self.what} {server.url} has been unreachable for {now - server.down_since:.0f}s, past "
                f"reward.model.down_grace_s={self.down_grace_s:g} (last error: {server.last_error}); "
                "the run stops rather than leave every sample unscored: check the server's log, or raise "
                "reward.model.down_grace_s"
            )


def _retry_after(r: httpx.Response, default: float) -> float:
    """What a 429/408's ``Retry-After`` asks (seconds, or an HTTP date), within
    ``[0, _RETRY_AFTER_MAX_S]``; ``default`` when it says nothing readable."""
    value = (r.headers.get("retry-after") or "").strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return default
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.timezone.utc)
        seconds = (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    if not math.isfinite(seconds):
        return default
    return min(max(seconds, 0.0), _RETRY_AFTER_MAX_S)
