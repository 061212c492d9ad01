"""How a call to the training ranks fails: the error types, and which peer processes are gone.

Below both the rank groups (`rank_group.py`) and the SPMD call watchdog (`spmd_watchdog.py`),
which report a dead peer the same way.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Callable


class RankCallError(RuntimeError):
    """A rank method failed or timed out; names the method and the ranks concerned.

    `causes` holds each failed rank's own exception (the CLI reports the one a user can act
    on); a rank process that died is named with its pid."""

    def __init__(self, message: str, causes: list[BaseException] | None = None, timed_out: bool = False):
        super().__init__(message)
        self.causes = list(causes or [])
        self.timed_out = timed_out


class RankDied(RuntimeError):
    """A rank's process is gone (killed, out of memory, a crash in native code)."""


def rank_died(rank: int, pid: int, method: str) -> RankDied:
    """The error naming a torchrun rank that died during `method`."""
    return RankDied(
        f"training rank {rank} (pid {pid}) died during {method} (killed, out of memory, "
        "or a crash in native code; torchrun's report names its exit code)"
    )


# What a collective raises when a peer's connection drops (gloo's tcp transport).
_TRANSPORT_ERROR = re.compile(r"gloo/transport|Connection (reset|closed) by peer|Broken pipe")


def dead_peers_after_failure(
    peers: list[tuple[str, int]],
    error: BaseException,
    wait_s: float = 10.0,
    poll: Callable[[list[tuple[str, int]]], list[tuple[int, int]]] | None = None,
) -> list[tuple[int, int]]:
    """The dead peers behind a failed call. A SIGKILLed peer's sockets are reset while the kernel
    tears it down, so rank 0 can read the reset before the peer shows as exited (seen under load:
    the line then named the reset, not the dead rank). After a transport error, wait up to
    ``wait_s`` for the peer to show; any other error is rank 0's own and returns at once."""
    poll = poll or dead_peers
    dead = poll(peers)
    if dead or not _TRANSPORT_ERROR.search(str(error)):
        return dead
    deadline, tick = time.monotonic() + wait_s, threading.Event()
    while not dead and time.monotonic() < deadline:
        tick.wait(0.05)
        dead = poll(peers)
    return dead


def dead_peers(peers: list[tuple[str, int]]) -> list[tuple[int, int]]:
    """(rank, pid) of the ranks on this host whose process is gone (or a zombie torchrun has not
    reaped yet). Ranks on other hosts cannot be checked from here; torchrun's agent there reports them."""
    import psutil

    host, me = socket.gethostname(), os.getpid()
    dead = []
    for rank, (peer_host, pid) in enumerate(peers):
        if peer_host != host or pid == me:
            continue
        try:
            gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            gone = True
        if gone:
            dead.append((rank, pid))
    return dead
