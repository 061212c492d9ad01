"""free_port: ports for listeners started later (rendezvous, SGLang servers) come from below the
kernel's ephemeral range, where no outgoing connection can take them during a minute-long server
start (an SGLang server once failed its start with "address already in use" beside make test)."""

from __future__ import annotations

import socket

from megatron_dapo.ports import EPHEMERAL_RANGE, free_port, listen_port_range


def test_ports_come_from_below_the_ephemeral_range():
    first = int(EPHEMERAL_RANGE.read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(20000 <= p < first for p in ports), sorted(ports)
    assert len(ports) > 40  # drawn at random: two callers rarely race for the same one
    for port in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when returned


def test_a_port_in_use_is_not_returned(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    try:
        taken = held.getsockname()[1]
        # the third draw is a port just seen free (taken + 1 may be any other process's)
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
        probe.close()
        ranges = iter([taken, taken, free])

        class Fixed:  # the random draw: the held port twice, then a free one
            def randrange(self, low, high):
                return next(ranges)

        monkeypatch.setattr("megatron_dapo.ports.random.SystemRandom", Fixed)
        monkeypatch.setattr("megatron_dapo.ports.listen_port_range", lambda text: (20000, 70000))
        assert free_port() == free
    finally:
        held.close()


def test_listen_range_from_the_kernels_setting():
    assert listen_port_range("32768\t60999\n") == (20000, 32768)
    assert listen_port_range("1024 65535") is None  # no room below it: any free port (bind to 0)
    assert listen_port_range("") is None and listen_port_range("x y") is None


def test_rays_placement_probe_imports_no_torch():
    """bundle_slots runs `_probe_where` in a Ray worker per bundle, which imports its module:
    with torch among that module's imports, each probe cost a second of CPU for a port helper."""
    import subprocess
    import sys

    code = "import sys, megatron_dapo.driver.rank_group; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
