"""Fault-isolated reward scoring: a reward that raises, hangs or crashes scores the sample as wrong.

The built-in rules (the registry's, ``math_dapo``) are this package's own pure functions of the
text, bounded in work (the DAPO rule reads the last 300 characters): they run in the caller's
thread, with no lock, so scoring threads never queue behind each other for them. A custom
reward (``reward.custom_fn``), code this package does not know, runs in one persistent worker
subprocess
(:mod:`megatron_dapo.rewards.worker`). Why a process and not a thread: a hung Python thread
cannot be stopped (it would keep burning CPU and holding the GIL for the rest of the run) and
``signal.alarm`` only works on the main thread and cannot interrupt C code, while a process can
be killed. On a timeout the worker is killed and a fresh one is started for the next call, so a
hang costs ``timeout_s`` once, not the run. Items are sent in chunks and answered one line
each, so the per-call round trip stays small (tens of microseconds) and the timeout bounds each
call separately.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_dapo.rewards.registry import UnknownDataSourceError, builtin_reward, reward_fields

logger = logging.getLogger(__name__)

WRONG_SCORE = -1.0
_CHUNK = 256
_MIN_STARTUP_S = 30.0


@dataclass
class RewardResult:
    """The outcome of scoring one response. ``error`` is set when the reward failed."""

    score: float
    acc: bool
    pred: str
    error: str | None = None


class RewardWorkerError(RuntimeError):
    """The reward worker could not be started (for example a broken custom reward file)."""


class Scorer:
    """Score responses by data_source with the registry or a custom ``file.py:function``.

    Args:
        custom_fn: ``"path/to/file.py:function"`` with verl's signature, used for every
            data_source; None uses the built-in registry.
        timeout_s: limit for one reward call; past it the sample scores as wrong.
        boxed_fallback: let the built-in math rule fall back to the last ``\\boxed{}``.

    ``stats`` counts ``calls``, ``errors`` (the reward raised, returned a bad value, or the
    worker died), ``timeouts`` and ``worker_restarts``. Each distinct error message is logged
    once. An unknown data_source (without a custom reward) is a configuration error and raises
    :class:`~megatron_dapo.rewards.registry.UnknownDataSourceError` instead of scoring.

    Use as a context manager or call :meth:`close` to stop the worker.
    """

    def __init__(self, custom_fn: str | None = None, timeout_s: float = 10.0, boxed_fallback: bool = False):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.custom_fn = _absolute_spec(custom_fn) if custom_fn else None
        self.timeout_s = float(timeout_s)
        self.boxed_fallback = boxed_fallback
        self.stats = {"calls": 0, "errors": 0, "timeouts": 0, "worker_restarts": 0}
        self._logged: set[str] = set()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        if self.custom_fn is not None:
            self._start_worker()  # fail fast on a broken custom reward

    def knows(self, data_source: str) -> bool:
        """Whether this scorer has a reward for ``data_source`` (a custom reward: every one)."""
        if self.custom_fn is not None:
            return True
        try:
            builtin_reward(data_source)
        except UnknownDataSourceError:
            return False
        return True

    def score(self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None):
        """Score one response; returns a :class:`RewardResult`."""
        return self.score_many([(data_source, solution_str, ground_truth, extra_info)])[0]

    def score_many(self, items: Iterable[Sequence]) -> list[RewardResult]:
        """Score ``(data_source, solution_str, ground_truth[, extra_info])`` tuples, in order."""
        requests = [_request(item) for item in items]
        if self.custom_fn is None:
            for source in {r[0] for r in requests}:
                builtin_reward(source)  # raises UnknownDataSourceError with the fix
        if self.custom_fn is None:  # pure and bounded: here, no lock, no worker
            return [self._builtin(r) for r in requests]
        results: list[RewardResult] = []
        with self._lock:
            for start in range(0, len(requests), _CHUNK):
                results.extend(self._run_chunk(requests[start : start + _CHUNK]))
        return results

    def _builtin(self, request: list) -> RewardResult:
        data_source, solution_str, ground_truth, extra_info = request
        self.stats["calls"] += 1
        try:
            score, acc, pred = reward_fields(
                builtin_reward(data_source, self.boxed_fallback)(solution_str, ground_truth, extra_info)
            )
        except Exception as e:  # noqa: BLE001 - a rule that fails on odd input scores it as wrong
            return self._failed(f"{type(e).__name__}: {e}")
        return RewardResult(score, acc, pred)

    def close(self) -> None:
        """Stop the worker process."""
        with self._lock:
            self._stop_worker()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self._stop_worker()

    # -- worker management -------------------------------------------------------------

    def _run_chunk(self, chunk: list[list]) -> list[RewardResult]:
        out: list[RewardResult] = []
        while len(out) < len(chunk):
            pending = chunk[len(out) :]
            send_error = self._send(pending)
            if send_error is not None:
                self.stats["calls"] += len(pending)
                out.extend(self._failed(send_error) for _ in pending)
                break
            while len(out) < len(chunk):
                self.stats["calls"] += 1
                reply = self._read_line(time.monotonic() + self.timeout_s)
                if isinstance(reply, dict):
                    out.append(self._from_reply(reply))
                    continue
                if reply == "timeout":
                    self.stats["timeouts"] += 1
                    out.append(self._failed(f"reward call timed out after {self.timeout_s:g}s", timeout=True))
                else:
                    out.append(self._failed(reply))
                self._stop_worker()  # the rest of the chunk goes to a fresh worker
                break
        return out

    def _from_reply(self, reply: dict) -> RewardResult:
        if "error" in reply:
            return self._failed(reply["error"])
        return RewardResult(float(reply["score"]), bool(reply["acc"]), str(reply["pred"]))

    def _failed(self, message: str, timeout: bool = False) -> RewardResult:
        if not timeout:
            self.stats["errors"] += 1
        if message not in self._logged:
            self._logged.add(message)
            logger.warning("reward failed, sample scored as wrong (logged once per message): %s", message)
        return RewardResult(WRONG_SCORE, False, "", message)

    def _send(self, pending: list[list]) -> str | None:
        """Hand ``pending`` to the worker (starting one if needed); an error message on failure."""
        line = (json.dumps({"items": pending}, default=_jsonable) + "\n").encode()
        for _attempt in range(2):
            if self._proc is None:
                try:
                    self._start_worker()
                except RewardWorkerError as e:
                    return str(e)
            try:
                self._proc.stdin.write(line)
                self._proc.stdin.flush()
                return None
            except OSError:  # the worker died between calls; one fresh start is allowed
                self._stop_worker()
        return "reward worker closed its input"

    def _start_worker(self) -> None:
        cmd = [sys.executable, "-m", "megatron_dapo.rewards.worker"]
        if self.custom_fn:
            cmd += ["--custom-fn", self.custom_fn]
        if self.boxed_fallback:
            cmd.append("--boxed-fallback")
        env = dict(os.environ)
        # the worker must import this very package even when it is not installed
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else root
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._buf = b""
        ready = self._read_line(time.monotonic() + max(_MIN_STARTUP_S, self.timeout_s))
        if not (isinstance(ready, dict) and ready.get("ready")):
            self._stop_worker()
            why = ready.get("error") if isinstance(ready, dict) else ready
            raise RewardWorkerError(f"reward worker failed to start ({self.custom_fn or 'built-in'}): {why}")
        if self.stats["calls"]:
            self.stats["worker_restarts"] += 1

    def _stop_worker(self) -> None:
        proc, self._proc = getattr(self, "_proc", None), None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):  # a dead worker's pipe may already be broken
                stream.close()

    def _read_line(self, deadline: float) -> dict | str:
        """The next JSON reply, ``"timeout"``, or a message saying why the worker is gone."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return "timeout"
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                code = self._proc.wait()
                return f"reward worker exited with code {code} while scoring"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return f"reward worker wrote an unreadable reply: {line[:80]!r}"


def _request(item: Sequence) -> list:
    if len(item) == 3:
        data_source, solution_str, ground_truth = item
        extra_info = None
    elif len(item) == 4:
        data_source, solution_str, ground_truth, extra_info = item
    else:
        raise ValueError(
            f"score_many items are (data_source, solution_str, ground_truth[, extra_info]); got {len(item)} fields"
        )
    return [data_source, solution_str, ground_truth, extra_info if extra_info is not None else {}]


def _absolute_spec(spec: str) -> str:
    # the worker may run from another directory; resolve the file part now
    path, sep, name = spec.rpartition(":")
    return f"{Path(path).expanduser().resolve()}{sep}{name}" if sep and path else spec


def _jsonable(x):
    """JSON fallback for numpy scalars/arrays (parquet extra_info) and anything else."""
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)
