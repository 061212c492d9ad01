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
import sys
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


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_forking_parent() -> None:
    """From now on, every process this one forks (without exec) is SIGKILLed when this one dies.

    megatron-core's checkpoint save forks its file writers (`filesystem_async`, a "fork" context)
    from the rank. A fork inherits every file descriptor, the rank's gloo/NCCL sockets included:
    if the rank is killed mid-save, its orphaned writers hold those sockets open, so the peers
    never see the connection close and wait in their collective instead of reporting the dead
    rank. The kernel's parent-death signal ends such a child with its parent (Linux only; the
    signal follows the forking thread, and megatron forks and joins its writers within one call
    of that thread). Exec'd children (subprocess) do not run these hooks and need none:
    `close_fds` keeps the sockets out of them."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    forking = {"pid": 0}

    def remember_parent() -> None:
        forking["pid"] = os.getpid()

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != forking["pid"]:  # the parent died before the signal was armed
            os._exit(1)

    os.register_at_fork(before=remember_parent, after_in_child=arm)
