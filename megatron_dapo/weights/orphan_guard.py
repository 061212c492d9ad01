"""Helper processes that end with the process that started them.

megatron-core's checkpoint writer collects its results through a `multiprocessing` Manager, a
spawned server process that lives as long as the rank and is never told when the rank is killed
(SIGKILL, the OOM killer). Orphaned, it keeps the rank's stdout and stderr open, so a pipe
reading them (`torchrun ... | tee log`, a test harness) never sees its end. Its initializer
below makes it exit once its parent is gone.

It must also outlive a stop signal: torchrun's agent forwards SIGTERM to each worker's whole
session (Slurm signals every process of the job), and the rank's final checkpoint, written
after that signal, needs this process. So it ignores SIGTERM/SIGINT and ends with its rank.
"""

from __future__ import annotations

import os
import signal
import threading

# How often the helper looks for its parent; only bounds how long an orphan lingers.
POLL_S = 1.0


def exit_with_parent(parent_pid: int) -> None:
    """Run in the helper at start-up: ignore stop signals; a daemon thread exits the process once
    `parent_pid` is gone."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)

    def watch() -> None:
        stop = threading.Event()
        while os.getppid() == parent_pid:  # an orphan is re-parented (to init or a subreaper)
            stop.wait(POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
