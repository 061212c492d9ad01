"""ToolHost: runs tool calls in worker processes that can be killed.

Why processes: a tool is user code (or a model's code, through the ``python`` builtin). A hung
Python thread cannot be stopped and a crash in C takes its process along, so each call runs in a
tool worker (:mod:`megatron_dapo.agent.tools.worker`) that the host kills, with its whole process
group, when the call outlives ``timeout_s``, and replaces. A call therefore always returns within
``timeout_s`` plus a small slack, whatever the tool does, and the run goes on.

Scheduling: up to ``workers`` processes (``tool_workers``, by default the cores the trainer may
use), started as calls need them and ended after ``idle_s`` without one (unless they hold verl
instances), so the pool follows the load; the episode loop runs ``workers`` calls at once, so a
turn's calls beyond that wait in its queue, not against their time limit. A function or builtin
tool runs on the idle worker used last (the others age out). A verl class tool keeps per-episode state (``create`` ... ``release``), so the
first such call of an episode binds the episode to a worker and its later calls wait for that
worker. A worker killed or crashed takes the verl instances on it along: later calls of those
episodes to verl tools get an error observation saying the state was lost (not a fresh instance
that would silently answer from a blank state).

The time limit covers the whole call: waiting for a free worker, starting one, running. A call
that finds every worker busy until its time is up gets a ``timeout`` result saying so (and
``queue_timeouts`` counts it): give ``tool_workers`` room for the episodes that run at once.

Errors: a tool's stderr (its prints, a crash's stack) and the traceback of each failed call go to
the run's tool log (``log_path``), not to the console; the console gets one line per distinct
error (tool and message) when it first happens, and its count when it recurred, at most every
``REPORT_EVERY_S`` and when the host closes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_dapo.agent.calls import ToolCall
from megatron_dapo.agent.tools.spec import ToolConfigError, ToolSpec, load_tool_config
from megatron_dapo.config.schema import MultiTurnConfig

__all__ = ["ToolHost", "ToolHostClosed", "ToolResult"]

logger = logging.getLogger(__name__)

# The least address space a worker runs in: the interpreter, a thread's stack and malloc arena.
MIN_MEMORY_MB = 256
# Beyond timeout_s: killing a process group and reaping it, and the JSON round trip.
_KILL_WAIT_S = 2.0
# The python builtin's own wall-clock limit, when its config gives none: this share of the
# host's, so that it answers "timed out" itself before the host kills the worker.
PYTHON_TIMEOUT_SHARE = 0.8
_PYTHON_DEFAULT_MEMORY_MB = 1024
_READ_CHUNK = 1 << 16
_MAX_DISTINCT = 1000  # distinct errors counted apart; later new ones are counted together
# the console's counts of recurring errors, at most this often (and at close)
REPORT_EVERY_S = 60.0
# a worker idle this long ends (a burst's workers do not stay); a new one starts in ~0.1 s
IDLE_S = 120.0


@dataclass
class ToolResult:
    """The outcome of one tool call.

    ``text``: what the model is shown (an ``Error: ...`` observation on failure). ``status``:
    ``ok``; ``error`` (the call was malformed or named no tool, the tool raised, returned something
    that is not text, or its process died; a builtin's answer that reports a failure: a calculator
    error, python code that raised or was killed); ``timeout`` (the call outlived ``timeout_s`` and
    its worker was killed, or python code outlived the interpreter's own limit). ``reward``: a verl
    tool's step reward (reported, not trained on). ``metrics``: what the tool reported (verl's
    metrics dict; the python builtin's ``exit_code``, ``timed_out``, ``output_truncated``,
    ``isolation``; ``truncated`` and ``output_chars`` when the answer was cut to
    ``max_output_chars``)."""

    text: str
    status: str
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)


class ToolHostClosed(RuntimeError):
    """A call on a ToolHost after ``close()``."""


class _Worker:
    """One tool process and the host's ends of its two pipes (owned by one thread at a time)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None  # None while its first owner starts it
        self.requests_fd = -1
        self.replies_fd = -1
        self.buf = b""
        self.busy = True  # created for the thread that will start it
        self.dead = False
        self.pending: list[bytes] = []  # release lines, sent before the next request
        self.episodes: set[str] = set()  # episodes whose verl instances live here
        self.idle_since = 0.0


class _Log:
    """The tool log, appended to by the host's threads (each write whole, under a lock, so that
    none writes to its descriptor once closed and reused) and by the workers (their stderr)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # O_APPEND: the workers' writes and ours interleave by whole writes, none overwritten
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def fileno(self) -> int:
        return self._fd

    def write(self, text: str) -> None:
        with self._lock:
            if self._fd >= 0:
                with contextlib.suppress(OSError):  # a full disk must not fail the call
                    os.write(self._fd, text.encode(errors="replace"))

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class ToolHost:
    """Run tool calls in ``workers`` killable processes.

    Args:
        specs: the tools (:func:`~megatron_dapo.agent.tools.spec.load_tool_config`).
        timeout_s: limit of one call, all included (``rollout.multi_turn.tool_timeout_s``).
        workers: tool processes at most, started on demand (``tool_workers``).
        memory_mb: address-space limit of each (``tool_memory_mb``).
        max_output_chars: a tool's answer is cut to this many characters in the worker, before it
            is sent (a bound for the pipe; the episode runner cuts to tokens later).
        log_path: the tool log (appended to): the workers' stderr and each failed call's
            traceback. None: the workers' stderr is the trainer's, tracebacks go to the logger.
        idle_s: a worker unused this long ends (one holding verl instances stays).

    ``call`` is thread-safe and blocking; use as a context manager or call ``close()`` (also run
    at exit). ``stats()`` counts calls, errors, timeouts and worker restarts.
    """

    def __init__(
        self,
        specs: Iterable[ToolSpec],
        *,
        timeout_s: float,
        workers: int,
        memory_mb: int,
        max_output_chars: int = 65536,
        log_path: str | os.PathLike | None = None,
        idle_s: float = IDLE_S,
    ):
        specs = list(specs)
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ToolConfigError(
                f"rollout.multi_turn.tool_timeout_s must be a positive number of seconds, got {timeout_s!r}"
            )
        if not isinstance(workers, int) or workers < 1:
            raise ToolConfigError(f"rollout.multi_turn.tool_workers must be an integer >= 1, got {workers!r}")
        if not isinstance(memory_mb, int) or memory_mb < MIN_MEMORY_MB:
            raise ToolConfigError(
                f"rollout.multi_turn.tool_memory_mb must be an integer >= {MIN_MEMORY_MB} (a tool process "
                f"needs that much address space to start), got {memory_mb!r}"
            )
        if not (isinstance(idle_s, (int, float)) and idle_s > 0):
            raise ToolConfigError(f"idle_s must be a positive number of seconds, got {idle_s!r}")
        if not isinstance(max_output_chars, int) or max_output_chars < 1:
            raise ToolConfigError(f"max_output_chars must be a positive integer, got {max_output_chars!r}")
        names: dict[str, ToolSpec] = {}
        for spec in specs:
            if spec.name in names:
                raise ToolConfigError(
                    f"two tools are called {spec.name!r}; give each its own tool_schema.function.name"
                )
            names[spec.name] = spec
        self.timeout_s = float(timeout_s)
        self.workers = workers
        self.memory_mb = memory_mb
        self.max_output_chars = max_output_chars
        self.idle_s = float(idle_s)
        self._shrunk_at = time.monotonic()
        self._specs = names
        self._python_defaults = self._check_python(specs)
        self._cond = threading.Condition(threading.Lock())
        self._pool: list[_Worker] = []
        self._affinity: dict[str, _Worker] = {}  # episode -> the worker with its verl instances
        self._lost: set[str] = set()  # episodes whose verl instances died with their worker
        self._stats = dict.fromkeys(
            (
                "calls",
                "errors",
                "timeouts",
                "queue_timeouts",
                "worker_restarts",
                "truncated",
                "lost_instances",
            ),
            0,
        )
        self._errors: dict[str, list[int]] = {}  # "tool: message" -> [count, count at the last report]
        self._reported_at = time.monotonic()
        self.log_path = Path(log_path) if log_path is not None else None
        self._log = _Log(self.log_path) if self.log_path is not None else None
        self._closed = False
        # kills the workers at exit or when the host is collected, without keeping it alive
        self._finalizer = weakref.finalize(self, _kill_all, self._pool, self._log)

    @classmethod
    def from_config(
        cls, multi_turn: MultiTurnConfig, log_path: str | os.PathLike | None = None
    ) -> ToolHost | None:
        """The host of ``rollout.multi_turn``: its tool YAML and limits; None without a tool YAML."""
        if not multi_turn.tool_config_path:
            return None
        return cls(
            load_tool_config(multi_turn.tool_config_path),
            timeout_s=multi_turn.tool_timeout_s,
            workers=multi_turn.tool_workers,
            memory_mb=multi_turn.tool_memory_mb,
            log_path=log_path,
        )

    # -- public --------------------------------------------------------------------------

    @property
    def schemas(self) -> list[dict]:
        """The tools' OpenAI function schemas, for the chat template's ``tools=``."""
        return [json.loads(json.dumps(spec.schema)) for spec in self._specs.values()]

    def call(self, episode_id: str, call: ToolCall, *, tools_kwargs: dict | None = None) -> ToolResult:
        """Run one tool call of episode ``episode_id``; returns within ``timeout_s`` plus a small slack.

        ``tools_kwargs``: verl's per-sample ``{tool_name: {"create_kwargs": {...}, "execute_kwargs":
        {...}}}`` (a dataset's ``extra_info.tools_kwargs``), read by verl class tools when the
        episode's instance is created and at each execute. Raises only ToolHostClosed."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        with self._cond:
            if self._closed:
                raise ToolHostClosed("ToolHost.call after close(): create a new ToolHost")
            self._stats["calls"] += 1
        self._shrink()
        early = self._refuse(episode_id, call)
        if early is not None:
            return self._count(early)
        spec = self._specs[call.name]
        stateful = spec.kind == "verl_class"
        request = {
            "op": "call",
            "episode": episode_id,
            "tool": call.name,
            "arguments": call.arguments,
            "tools_kwargs": tools_kwargs or {},
        }
        try:
            line = (json.dumps(request, default=_jsonable) + "\n").encode()
        except (TypeError, ValueError) as e:
            return self._count(
                ToolResult(f"Error: the call's arguments cannot be sent to the tool: {e}", "error")
            )
        for _attempt in range(2):  # a worker found dead before it read the request: once more on a fresh one
            worker = self._acquire(episode_id if stateful else None, deadline)
            if worker is None:
                self._stats_add("queue_timeouts")
                self._note(
                    call.name,
                    f"waited {self.timeout_s:g} s for a free tool worker (all {self.workers} busy); "
                    "raise rollout.multi_turn.tool_workers",
                )
                return self._count(
                    ToolResult(
                        f"Error: tool {call.name} timed out after {self.timeout_s:g} s (no tool worker was free)",
                        "timeout",
                    )
                )
            result, retry = self._run_on(worker, spec, line, deadline)
            if not retry:
                return self._count(result)
            if stateful:  # the dead worker may have held this episode's state: then it is lost
                early = self._refuse(episode_id, call)
                if early is not None:
                    return self._count(early)
        return self._count(result)

    def release(self, episode_id: str) -> None:
        """The episode is over: its verl tool instances are released (``BaseTool.release``).

        Does not wait: the release reaches the worker before its next call (at once when it is idle)."""
        with self._cond:
            self._lost.discard(episode_id)
            worker = self._affinity.pop(episode_id, None)
            if worker is None or worker.dead:
                return
            worker.episodes.discard(episode_id)
            worker.pending.append((json.dumps({"op": "release", "episode": episode_id}) + "\n").encode())
            if worker.busy or worker.proc is None:
                return
            worker.busy = True
        try:
            self._send_pending(worker, time.monotonic() + self.timeout_s)
        except OSError:
            self._retire(worker)
            return
        self._give_back(worker)

    def start(self, timeout_s: float = 60.0) -> None:
        """Start every worker now instead of at first need (their start then costs no call's time)."""
        started = []
        with self._cond:
            if self._closed:
                raise ToolHostClosed("ToolHost.start after close()")
            while len(self._pool) < self.workers:
                worker = _Worker()
                self._pool.append(worker)
                started.append(worker)
        deadline = time.monotonic() + timeout_s
        errors = []
        for worker in started:
            try:
                self._spawn(worker)
            except OSError as e:
                errors.append(str(e))
        for worker in started:
            if worker.proc is None:  # its spawn failed, said above
                self._retire(worker, count=False)
                continue
            error = self._await_ready(worker, deadline)
            if error:
                errors.append(error)
                self._retire(worker, count=False)
            else:
                self._give_back(worker)
        if errors:
            raise RuntimeError(f"{len(errors)} tool worker(s) did not start: {errors[0]}")

    def stats(self) -> dict:
        """Counters since the start: ``calls``, ``errors``, ``timeouts`` (``queue_timeouts`` of them
        found no free worker), ``worker_restarts`` (killed after a timeout or died), ``truncated``
        (answers cut to max_output_chars), ``lost_instances`` (calls refused because their verl
        state died with a worker); and ``workers``, those running now."""
        with self._cond:
            return {**self._stats, "workers": sum(1 for w in self._pool if w.proc is not None and not w.dead)}

    def close(self) -> None:
        """Kill every worker and report the errors' counts; later calls raise ToolHostClosed."""
        with self._cond:
            already = self._closed
            self._closed = True
            self._cond.notify_all()
        if not already:
            self.report_errors()
        self._finalizer()

    def __enter__(self) -> ToolHost:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls ---------------------------------------------------------------------------

    def _refuse(self, episode_id: str, call: ToolCall) -> ToolResult | None:
        """The error result for a call that must not run, None for one that may."""
        if call.error:
            return ToolResult(f"Error: {call.error}", "error")
        spec = self._specs.get(call.name)
        if spec is None:
            return ToolResult(
                f"Error: unknown tool {call.name!r}; the tools are: {', '.join(self._specs)}", "error"
            )
        if not isinstance(call.arguments, dict):
            return ToolResult(f"Error: the arguments of {call.name} must be an object", "error")
        missing = [k for k in spec.required if k not in call.arguments]
        if missing:
            return ToolResult(
                f"Error: tool {call.name} needs the argument(s) {', '.join(repr(m) for m in missing)}, "
                "missing from the call",
                "error",
            )
        if spec.kind == "verl_class":
            with self._cond:
                lost = episode_id in self._lost
            if lost:
                self._stats_add("lost_instances")
                return ToolResult(
                    f"Error: tool {call.name} lost this episode's state when its process was restarted "
                    "(after a time-out or a crash); it cannot be used again in this episode",
                    "error",
                )
        return None

    def _acquire(self, episode: str | None, deadline: float) -> _Worker | None:
        """A worker owned by the caller (for ``episode``'s verl state, its bound worker), or None
        when none was free before ``deadline``."""
        with self._cond:
            while True:
                if self._closed:
                    raise ToolHostClosed("ToolHost closed while a call waited for a worker")
                worker = self._affinity.get(episode) if episode is not None else None
                if worker is not None:
                    if not worker.busy:
                        worker.busy = True
                        return worker
                else:
                    # the one used last: the others stay idle and age out when the load drops
                    idle = (w for w in self._pool if not w.busy and not w.dead)
                    worker = max(idle, key=lambda w: w.idle_since, default=None)
                    if worker is None and len(self._pool) < self.workers:
                        worker = _Worker()  # busy: this thread starts it
                        self._pool.append(worker)
                    if worker is not None:
                        worker.busy = True
                        if episode is not None:
                            self._affinity[episode] = worker
                            worker.episodes.add(episode)
                        return worker
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def _run_on(
        self, worker: _Worker, spec: ToolSpec, line: bytes, deadline: float
    ) -> tuple[ToolResult, bool]:
        """(result, retry): retry when the worker was found dead before it could read the call."""
        if worker.proc is None:
            try:
                self._spawn(worker)
            except OSError as e:  # no process could be made (fork refused, out of fds)
                self._retire(worker, count=False, had_state=False)
                return ToolResult(f"Error: tool {spec.name} could not start its process: {e}", "error"), False
            error = self._await_ready(worker, deadline)
            if error:
                timed_out = error == "timeout"
                self._retire(worker, count=not timed_out, had_state=False)
                if timed_out:
                    return self._timeout(spec.name), False
                return ToolResult(
                    f"Error: tool {spec.name} could not start its process: {error}", "error"
                ), False
        try:
            self._send_pending(worker, deadline)
            _write_all(worker.requests_fd, line, deadline)
        except TimeoutError:
            self._kill(worker)
            self._retire(worker)
            return self._timeout(spec.name), False
        except OSError:  # died between calls (killed from outside): nothing ran
            self._kill(worker)
            self._retire(worker)
            return ToolResult(f"Error: tool {spec.name}'s process had died", "error"), True
        reply = self._read_reply(worker, deadline)
        if reply == "timeout":
            self._kill(worker)
            self._retire(worker)
            return self._timeout(spec.name), False
        if isinstance(reply, str):  # the worker died during the call
            self._retire(worker)
            self._note(spec.name, f"crashed: {reply}")
            return ToolResult(f"Error: tool {spec.name} crashed: {reply}", "error"), False
        self._give_back(worker)
        if reply.get("traceback"):
            self._note(spec.name, str(reply.get("text")), reply["traceback"])
        metrics = reply.get("metrics") if isinstance(reply.get("metrics"), dict) else {}
        if metrics.get("truncated"):
            self._stats_add("truncated")
        status = reply.get("status") if reply.get("status") in ("ok", "error", "timeout") else "error"
        try:
            reward = float(reply.get("reward") or 0.0)
        except (TypeError, ValueError):
            reward = 0.0
        return ToolResult(str(reply.get("text", "")), status, reward, metrics), False

    def _timeout(self, name: str) -> ToolResult:
        self._note(name, f"timed out after {self.timeout_s:g} s; its worker was killed")
        return ToolResult(f"Error: tool {name} timed out after {self.timeout_s:g} s", "timeout")

    def _count(self, result: ToolResult) -> ToolResult:
        if result.status == "timeout":
            self._stats_add("timeouts")
        elif result.status != "ok":
            self._stats_add("errors")
        return result

    def _stats_add(self, key: str) -> None:
        with self._cond:
            self._stats[key] += 1

    def _note(self, tool: str, message: str, detail: str | None = None) -> None:
        """Count an error of ``tool``; its ``detail`` (a traceback) goes to the tool log. The
        console hears of it once, and of its count later (:meth:`report_errors`)."""
        key = f"tool {tool}: {message}"
        with self._cond:
            if key not in self._errors and len(self._errors) >= _MAX_DISTINCT:
                key = f"tool {tool}: (errors past the first {_MAX_DISTINCT} distinct ones)"
            first = key not in self._errors
            counts = self._errors.setdefault(key, [0, 0])
            counts[0] += 1
            if first:
                counts[1] = 1
            due = time.monotonic() - self._reported_at >= REPORT_EVERY_S
        if self._log is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            self._log.write(f"[{stamp}] {key}\n{detail.rstrip() + chr(10) if detail else ''}")
        if first:
            if self._log is not None:
                logger.warning("%s (its traceback and stderr: %s; repeats are counted)", key, self.log_path)
            elif detail:
                logger.warning("%s (repeats are counted)\n%s", key, detail.rstrip())
            else:
                logger.warning("%s (repeats are counted)", key)
        if due:
            self.report_errors()

    def report_errors(self) -> None:
        """One console line per distinct error that recurred since the last report, with its count."""
        with self._cond:
            self._reported_at = time.monotonic()
            lines = []
            for key, counts in self._errors.items():
                if counts[0] > counts[1]:
                    lines.append((key, counts[0], counts[0] - counts[1]))
                    counts[1] = counts[0]
        for key, total, new in lines:
            logger.warning("%s: %d times (%d since the last count)", key, total, new)

    # -- workers -------------------------------------------------------------------------

    def _spawn(self, worker: _Worker) -> None:
        """Start ``worker``'s process and send it the tools (the caller owns ``worker``)."""
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        env = dict(os.environ)
        # the worker must import this very package even when it is not installed
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = root + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else root
        cmd = [
            sys.executable,
            "-m",
            "megatron_dapo.agent.tools.worker",
            "--in-fd",
            str(to_worker_r),
            "--out-fd",
            str(from_worker_w),
            "--memory-mb",
            str(self.memory_mb),
        ]
        try:
            worker.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stderr=self._stderr(),
                pass_fds=(to_worker_r, from_worker_w),
                env=env,
                start_new_session=True,  # its own process group (killed whole), out of the terminal's Ctrl-C
            )
        except BaseException:
            for fd in (to_worker_w, from_worker_r):
                os.close(fd)
            raise
        finally:
            os.close(to_worker_r)
            os.close(from_worker_w)
        os.set_blocking(to_worker_w, False)  # writes wait in select, up to the call's deadline
        worker.requests_fd, worker.replies_fd = to_worker_w, from_worker_r
        init = {
            "op": "init",
            "specs": [asdict(s) for s in self._specs.values()],
            "max_output_chars": self.max_output_chars,
            "python": self._python_defaults,
        }
        with contextlib.suppress(OSError):  # a worker that died at once is reported by _await_ready
            _write_all(worker.requests_fd, (json.dumps(init) + "\n").encode(), time.monotonic() + 10)

    def _stderr(self) -> int | None:
        """Where a worker's stderr goes: the tool log; the trainer's without one."""
        if self._log is None:
            return None
        fd = self._log.fileno()
        return fd if fd >= 0 else subprocess.DEVNULL  # closed meanwhile (-1 would ask for a pipe)

    def _await_ready(self, worker: _Worker, deadline: float) -> str | None:
        reply = self._read_reply(worker, deadline)
        if isinstance(reply, dict) and reply.get("ready"):
            return None
        if reply == "timeout":
            self._kill(worker)
            return "timeout"
        return reply.get("error", repr(reply)) if isinstance(reply, dict) else reply

    def _send_pending(self, worker: _Worker, deadline: float) -> None:
        while worker.pending:
            _write_all(worker.requests_fd, worker.pending[0], deadline)
            worker.pending.pop(0)

    def _read_reply(self, worker: _Worker, deadline: float) -> dict | str:
        """The next reply, ``"timeout"``, or a line saying how the worker ended."""
        while b"\n" not in worker.buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            try:
                if not select.select([worker.replies_fd], [], [], remaining)[0]:
                    continue
                chunk = os.read(worker.replies_fd, _READ_CHUNK)
            except (OSError, ValueError):  # its fd closed under us: the host is closing
                chunk = b""
            if not chunk:
                return self._death(worker)
            worker.buf += chunk
        line, worker.buf = worker.buf.split(b"\n", 1)
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            self._kill(worker)
            return f"its process wrote an unreadable reply: {line[:80]!r}"
        return reply

    def _death(self, worker: _Worker) -> str:
        """Why the worker's reply pipe closed, once its process group is gone."""
        self._kill(worker)
        code = worker.proc.returncode if worker.proc is not None else None
        if code is None:
            return "its process closed the pipe"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            if name == "SIGKILL":
                return (
                    f"its process was killed (SIGKILL: out of memory, limit {self.memory_mb} MiB, or "
                    "killed from outside)"
                )
            return f"its process was killed by {name}"
        return f"its process exited with code {code}"

    def _kill(self, worker: _Worker) -> None:
        """SIGKILL the worker's process group (tool children included) and reap it."""
        proc = worker.proc
        if proc is None:
            return
        # before reaping: a group id cannot be reused while its leader is unreaped
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:  # stuck in the kernel: reap it in the background
            threading.Thread(target=proc.wait, daemon=True, name="tool-worker-reaper").start()

    def _retire(self, worker: _Worker, count: bool = True, had_state: bool = True) -> None:
        """Take a dead or killed worker out of the pool; its episodes' verl state is lost (unless
        it never ran a call: ``had_state`` False, its episodes start afresh elsewhere)."""
        self._kill(worker)
        for fd in (worker.requests_fd, worker.replies_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        worker.requests_fd = worker.replies_fd = -1
        with self._cond:
            worker.dead = True
            worker.busy = False
            if worker in self._pool:
                self._pool.remove(worker)
            for episode in worker.episodes:
                if self._affinity.get(episode) is worker:
                    del self._affinity[episode]
                    if had_state:
                        self._lost.add(episode)
            worker.episodes.clear()
            if count:
                self._stats["worker_restarts"] += 1
            self._cond.notify_all()

    def _shrink(self) -> None:
        """End the workers idle for ``idle_s`` that hold no verl instances (checked once a second)."""
        now = time.monotonic()
        with self._cond:
            if now - self._shrunk_at < 1.0:
                return
            self._shrunk_at = now
            stale = [
                w
                for w in self._pool
                if not w.busy
                and not w.dead
                and w.proc is not None
                and not w.episodes
                and not w.pending
                and now - w.idle_since > self.idle_s
            ]
            for w in stale:
                w.busy = True  # ours to end
        for w in stale:
            self._retire(w, count=False, had_state=False)

    def _give_back(self, worker: _Worker) -> None:
        with self._cond:
            closed = self._closed
            if not closed:
                worker.idle_since = time.monotonic()
                worker.busy = False
                self._cond.notify_all()
        if closed:  # started while close() ran, so close() could not see it: not left behind
            self._retire(worker, count=False)

    def _check_python(self, specs: list[ToolSpec]) -> dict:
        """The python builtin's defaults from the host's limits; its own limits must sit inside them."""
        defaults = {
            "timeout_s": round(self.timeout_s * PYTHON_TIMEOUT_SHARE, 3),
            "memory_mb": min(_PYTHON_DEFAULT_MEMORY_MB, self.memory_mb),
        }
        for spec in specs:
            if spec.kind != "builtin" or spec.target != "python":
                continue
            timeout = spec.config.get("timeout_s")
            if timeout is not None and timeout >= self.timeout_s:
                raise ToolConfigError(
                    f"tool {spec.name} (builtin python): config.timeout_s={timeout:g} must be below "
                    f"rollout.multi_turn.tool_timeout_s={self.timeout_s:g}, so that the interpreter reports its "
                    f"own time-out before the tool process is killed; use at most {defaults['timeout_s']:g}"
                )
            memory = spec.config.get("memory_mb")
            if memory is not None and memory > self.memory_mb:
                raise ToolConfigError(
                    f"tool {spec.name} (builtin python): config.memory_mb={memory} exceeds "
                    f"rollout.multi_turn.tool_memory_mb={self.memory_mb}, the limit the interpreter inherits; "
                    "lower it or raise tool_memory_mb"
                )
        return defaults


def _write_all(fd: int, data: bytes, deadline: float) -> None:
    """Write ``data`` to a non-blocking pipe, TimeoutError past ``deadline`` (a reader that stopped
    reading must not block the caller), another OSError when the reader is gone."""
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        if not select.select([], [fd], [], remaining)[1]:
            continue
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            continue


def _kill_all(pool: list[_Worker], log: _Log | None = None) -> None:
    """Kill every worker's group. The pipes of workers in a call are left to the calling thread,
    which sees the end of its reply pipe and closes them (closing them here could hand their fd
    numbers to another file while that thread still reads)."""
    for worker in list(pool):
        if worker.proc is not None and worker.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.proc.pid, signal.SIGKILL)
        if worker.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=_KILL_WAIT_S)
        if not worker.busy:
            for fd in (worker.requests_fd, worker.replies_fd):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            worker.requests_fd = worker.replies_fd = -1
        worker.dead = True
    pool.clear()
    if log is not None:
        log.close()


def _jsonable(value: Any) -> Any:
    """JSON fallback for numpy scalars and arrays (parquet tools_kwargs) and anything else."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
