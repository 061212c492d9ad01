"""Graceful stop on SIGTERM / SIGINT (Slurm preemption, Kubernetes eviction, Ctrl-C).

The first signal only sets a flag: the step loop abandons a rollout in flight (or finishes an
update in flight), saves a checkpoint of the last finished step and exits 0, so `--requeue` +
`resume: auto` continue where it stopped. A watchdog bounds the whole stop: when the process is
still running `timeout_s` after the first signal it exits at once (status 1), naming the last
checkpoint, so that the scheduler's SIGKILL never lands in the middle of a save. A second
signal exits at once too, unless it follows the first within `duplicate_window_s`: Slurm signals
every process of the job, and torchrun's agent then forwards the same signal to its workers
again, so one preemption reaches a rank twice within milliseconds.

Slurm and `kill -- -PGID` deliver the signal to the whole process group, not only to the
driver. The helpers below keep every other process of ours out of it: the local Ray cluster
(its daemons and every worker they start inherit a blocked SIGTERM/SIGINT, see
`blocked_signals`) and the reward worker (`ignore_stop_signals`). They are stopped by the
driver on its way out instead, so nothing dies before the checkpoint is written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A repeat this soon after the first signal is the same stop delivered twice (scheduler + launcher).
DUPLICATE_WINDOW_S = 5.0


@contextlib.contextmanager
def blocked_signals() -> Iterator[None]:
    """Block SIGTERM/SIGINT in this thread while child processes are started.

    A signal mask survives fork and exec, so processes started inside (Ray's GCS and raylet,
    and the workers the raylet forks in turn) never receive the process group's SIGTERM; the
    driver kills them at the end (`launch.shutdown_local_ray`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stop_signals() -> None:
    """For helper processes the driver stops itself (reward worker, follower ranks)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class StopFlag:
    def __init__(
        self,
        timeout_s: float | None = None,
        on_timeout: Callable[[], str] | None = None,
        duplicate_window_s: float = DUPLICATE_WINDOW_S,
    ) -> None:
        """timeout_s: the longest a stop may take after the first signal (None: unbounded).
        on_timeout: returns the line printed when that time is up (e.g. naming the last checkpoint).
        duplicate_window_s: a signal this soon after the first is the same stop, not a second one."""
        self._event = threading.Event()
        self._first_at: float | None = None
        self.duplicate_window_s = duplicate_window_s
        self._done = threading.Event()
        self.signal_name: str | None = None
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self._previous: dict[int, object] = {}
        self._signalled = threading.Event()  # a stop signal arrived: the watchdog's time starts
        self._watching = False

    def install(self) -> StopFlag:
        """Take SIGTERM/SIGINT (again: `ray.init` replaces the SIGTERM handler with its own)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        if self.timeout_s and not self._watching:
            # started here, never from the signal handler: a thread started inside a handler
            # races CPython's thread bookkeeping (a KeyError traceback in threading._bootstrap)
            self._watching = True
            threading.Thread(target=self._watchdog, name="stop-watchdog", daemon=True).start()
        return self

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._first_at is not None and time.monotonic() - self._first_at < self.duplicate_window_s:
            return  # the launcher forwarding the signal the scheduler sent us already
        if self._event.is_set():
            # the user (or the scheduler) insists: no cleanup that could hang
            sys.stderr.write(f"second {name}: exiting now; resume continues from the last checkpoint\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signal_name = name
        self._first_at = time.monotonic()
        self._event.set()
        sys.stderr.write(
            f"{name} received: stopping after a checkpoint of the last finished step "
            f"(within {self.timeout_s:g}s, trainer.stop_timeout_s); send it again to exit at once\n"
            if self.timeout_s
            else f"{name} received: stopping after a checkpoint of the last finished step\n"
        )
        sys.stderr.flush()
        self._signalled.set()

    def _watchdog(self) -> None:
        while not self._signalled.wait(1.0):
            if self._done.is_set():
                return
        if self._done.wait(self.timeout_s):
            return
        line = f"stop did not finish within trainer.stop_timeout_s={self.timeout_s:g}s; exiting now"
        if self.on_timeout is not None:
            with contextlib.suppress(Exception):  # the exit must happen whatever the message does
                line += "; " + self.on_timeout()
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        os._exit(1)

    def finished(self) -> None:
        """The stop is complete (or the run ended): the watchdog stands down."""
        self._done.set()

    def uninstall(self) -> None:
        self.finished()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def set(self, reason: str = "requested") -> None:
        self.signal_name = reason
        self._event.set()

    def wait(self, timeout: float) -> bool:
        """True once a stop is requested; False if ``timeout`` seconds pass first."""
        return self._event.wait(timeout)

    @property
    def requested(self) -> bool:
        return self._event.is_set()
