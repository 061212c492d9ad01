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
from typing import Any

POLL_S = 0.5


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
    """Rank 0: `start(...)` before a call's first collective, `done()` after its last one."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.store = _store()
        self.seq = 0
        self._timer: threading.Timer | None = None
        self._mine_done = False

    def start(self, method: str, timeout_s: float | None, note: str) -> int:
        self.seq += 1
        self._mine_done = False
        if timeout_s is not None:
            self._timer = threading.Timer(timeout_s, self._expired, args=(self.seq, method, timeout_s, note))
            self._timer.daemon = True
            self._timer.start()
        return self.seq

    def mine_done(self) -> None:
        self._mine_done = True

    def done(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

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
        # if the store fails, followers end by torchrun's shutdown instead
        with contextlib.suppress(Exception):
            self.store.set(abort_key(), line)
        _exit_with(line)


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
