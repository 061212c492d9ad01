"""Graceful stop on SIGTERM / SIGINT (Slurm preemption, Ctrl-C).

The first signal only sets a flag: the step loop finishes the step in flight, saves a checkpoint
and exits 0, so `--requeue` + `resume: auto` continue where it stopped. A second signal restores
the default handler and interrupts at once.
"""

from __future__ import annotations

import signal
import threading


class StopFlag:
    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopFlag:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self._event.is_set():
            self.uninstall()
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        self._event.set()

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def set(self, reason: str = "requested") -> None:
        self.signal_name = reason
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()
