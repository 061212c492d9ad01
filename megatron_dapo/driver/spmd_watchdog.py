"""Bounded calls under torchrun: a rank that hangs ends the job with one line, not a 24-hour wait.

Under Ray the driver is a separate process and `ray.get(timeout=)` returns control to it. Under
torchrun the driver is rank 0 itself, and a hung call leaves rank 0's main thread inside a gloo
collective or the hung method, where no exception can reach it. So a watchdog thread does the
ending: when the call is not back within its `timeout_s`, it asks the job's store which ranks
have answered, prints the one `failed:` line (the call, the ranks that did not answer, the knob,
the checkpoint a resume uses), posts an abort key to the store and leaves with `os._exit(1)`.
Each follower runs a thread that polls the store for that key and leaves the same way, printing
one `[rank N] stopped: ...` line, so a follower hung in the same call (or blocked in the
collective behind it) does not wait for torchrun's shutdown timeout. The store is torchrun's
agent store, which outlives rank 0, and also the job's failed attempts: with `--max-restarts` the
next attempt's ranks talk to the same store, so every key carries the attempt number
(TORCHELASTIC_RESTART_COUNT); otherwise the next attempt's followers would read the last one's
abort key and stop at once.

`os._exit` skips Python's cleanup on purpose: the main thread is stuck and would never let a
normal exit finish. Checkpoints stay intact because a checkpoint is published (`latest`) only
after it is complete; a save cut short leaves the previous one as the resume point.

A rank that dies is named the same way. Normally its death breaks rank 0's collective and the
call raises at once; but a connection stays open as long as any process holds it, and a rank's
forked children hold its sockets (weights/orphan_guard.py arms them to die with the rank, this
is the second line of defence). So while a call is in flight a second thread looks at the
peers' pids: a peer dead for `PEER_GRACE_S` while rank 0 is still inside the call means rank 0
is blocked for good, and the thread prints the dead-rank line (the main thread's stack in
error.log) and exits the same way. Ranks on other hosts cannot be seen from here; their
torchrun agent ends them.

On GPU: a rank stuck in an NCCL kernel cannot be interrupted from Python either; `os._exit`
still ends the process, and the driver frees its CUDA context when the process is reaped (a
kernel spinning on a dead peer may hold the GPU until then). NCCL's own watchdog
(TORCH_NCCL_ASYNC_ERROR_HANDLING) may abort such a rank earlier, with its own message.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Any

from megatron_dapo.driver.rank_failures import RankCallError, dead_peers, rank_died
from megatron_dapo.errors import report

POLL_S = 0.5
# How long a dead peer may go unreported while rank 0 is still inside the call: the main thread
# reports a broken collective in milliseconds; torchrun's agent SIGKILLs rank 0 30 s after a
# worker died, so the line must come well before that.
PEER_GRACE_S = 5.0
PEER_POLL_S = 1.0


def _prefix() -> str:
    return f"megatron_dapo/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def abort_key() -> str:
    return f"{_prefix()}/abort"


def _store():
    import torch.distributed.distributed_c10d as c10d

    return c10d._get_default_store()


def answered_key(seq: int, rank: int) -> str:
    return f"{_prefix()}/answered/{seq}/{rank}"


def mark_answered(store: Any, seq: int, rank: int) -> None:
    """A rank's method returned: it is not the one hung in call `seq`."""
    store.set(answered_key(seq, rank), "1")


def _exit_with(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


class CallWatchdog:
    """Rank 0: `start(...)` before a call's first collective, `done()` after its last one.

    `peers`: (host, pid) per rank; when given, a dead peer ends a call that does not end itself."""

    def __init__(
        self, world_size: int, peers: list[tuple[str, int]] | None = None, grace_s: float = PEER_GRACE_S
    ):
        self.world_size = world_size
        self.store = _store()
        self.seq = 0
        self._timer: threading.Timer | None = None
        self._mine_done = False
        self._lock = threading.Lock()  # the main thread's `done` vs the peer thread's exit
        self._active: tuple[int, str, str] | None = None  # (seq, method, context) of the call
        self._closed = threading.Event()
        if peers:
            threading.Thread(
                target=self._watch_peers, args=(peers, grace_s), name="megatron-dapo-peer-watch", daemon=True
            ).start()

    def start(self, method: str, timeout_s: float | None, note: str, context: str = "") -> int:
        """`note` and `context` end the line of a timeout; `context` that of a dead peer."""
        self.seq += 1
        self._mine_done = False
        with self._lock:
            self._active = (self.seq, method, context)
        if timeout_s is not None:
            line_end = f"{note}; {context}" if note and context else note or context
            self._timer = threading.Timer(
                timeout_s, self._expired, args=(self.seq, method, timeout_s, line_end)
            )
            self._timer.daemon = True
            self._timer.start()
        return self.seq

    def mine_done(self) -> None:
        self._mine_done = True

    def done(self) -> None:
        with self._lock:
            self._active = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        self._closed.set()

    def late_ranks(self, seq: int) -> list[int]:
        late = [] if self._mine_done else [0]
        for rank in range(1, self.world_size):
            if not self.store.check([answered_key(seq, rank)]):
                late.append(rank)
        return late

    def _expired(self, seq: int, method: str, timeout_s: float, note: str) -> None:
        try:
            late = self.late_ranks(seq)
            who = (
                f"ranks {late}"
                if late
                else "no rank named (every rank answered; the collective after it hung)"
            )
        except Exception as e:  # noqa: BLE001 - the line must be printed whatever the store does
            who = f"ranks unknown (store: {e})"
        line = f"failed: {method}: {who} did not finish within {timeout_s:.0f}s"
        if note:
            line += f" {note}"
        self._abort(line)

    def _abort(self, line: str) -> None:
        # if the store fails, followers end by torchrun's shutdown instead
        with contextlib.suppress(Exception):
            self.store.set(abort_key(), line)
        _exit_with(line)

    def _watch_peers(self, peers: list[tuple[str, int]], grace_s: float) -> None:
        first_seen: tuple[int, float] | None = None  # (call, when a dead peer was first seen in it)
        while not self._closed.wait(PEER_POLL_S):
            active = self._active
            dead = dead_peers(peers) if active is not None else []
            if not dead:
                first_seen = None
                continue
            if first_seen is None or first_seen[0] != active[0]:
                first_seen = (active[0], time.monotonic())
                continue
            if time.monotonic() - first_seen[1] < grace_s:
                continue
            with self._lock:  # held until the exit: the main thread cannot report a second line
                if self._active is not None and self._active[0] == first_seen[0]:
                    self._report_dead(*self._active[1:], dead)

    def _report_dead(self, method: str, context: str, dead: list[tuple[int, int]]) -> None:
        causes = [rank_died(rank, pid, method) for rank, pid in dead]
        error = RankCallError(f"{method} failed: " + "; ".join(map(str, causes)), causes)
        error.megatron_dapo_context = context
        main = sys._current_frames().get(threading.main_thread().ident)
        if main is not None:
            stack = "".join(traceback.format_stack(main))
            error.add_note(
                f"rank 0's main thread, blocked in the call:\nTraceback (most recent call last):\n{stack}"
            )
        try:
            line = report(error)[1]
        except Exception:  # noqa: BLE001 - the line must be printed whatever the report does
            line = f"failed: {error}; {context}"
        self._abort(line)


def watch_for_abort(rank: int) -> threading.Thread:
    """Followers: leave as soon as rank 0's watchdog posts the abort key."""
    store, key = _store(), abort_key()
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(POLL_S):
            try:
                if store.check([key]):
                    reason = store.get(key).decode()
                    _exit_with(
                        f"[rank {rank}] stopped: rank 0 ended the run ({reason.removeprefix('failed: ')})"
                    )
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return

    thread = threading.Thread(target=poll, name="megatron-dapo-abort-watch", daemon=True)
    thread.stop = stop  # type: ignore[attr-defined]
    thread.start()
    return thread
