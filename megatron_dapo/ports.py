"""Choosing a free TCP port for a listener started later (a rendezvous, an SGLang server).

Kept free of torch: Ray's placement probes import this, and a worker that imports torch for a
port number costs a second of CPU per bundle.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# The kernel's range for the local ports of outgoing connections (Linux). A port to listen on
# chosen inside it can be taken by any client socket between the choice and the listener's bind,
# which for an SGLang server is its whole start-up (a minute on a loaded CPU machine): seen as
# "address already in use". Ports below it are only taken by a bind that names them.
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_LISTEN_PORT = 20000  # above Ray's worker ports (10002-19999 by default)


def listen_port_range(ephemeral: str | None) -> tuple[int, int] | None:
    """``[low, high)`` for :func:`free_port`: from 20000 up to the first ephemeral port, given the
    text of ``ip_local_port_range``; None when that is unknown or leaves no room below it."""
    try:
        first = int(ephemeral.split()[0]) if ephemeral else 0
    except ValueError:
        return None
    return (LOWEST_LISTEN_PORT, first) if first - LOWEST_LISTEN_PORT >= 1000 else None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A free TCP port on this machine for a listener started later (a rendezvous, a server),
    outside the ephemeral range where the machine can give it away first."""
    try:
        found = listen_port_range(EPHEMERAL_RANGE.read_text())
    except OSError:
        found = None
    if found is not None:
        pick = random.SystemRandom()  # not the seeded global generator: forked ranks would agree
        for _ in range(200):
            port = pick.randrange(*found)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
