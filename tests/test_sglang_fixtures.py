"""The tests' own helpers for real SGLang servers, checked on stand-in process trees."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
from sglang_fixtures import launched_servers

# A stand-in server: forks one child that keeps the parent's command line (as SGLang's scheduler
# and detokenizer do until they rename themselves), then waits on stdin.
_FORKING_SERVER = """
import os, sys
if os.fork() == 0:
    sys.stdin.read()
    os._exit(0)
print("ready", flush=True)
sys.stdin.read()
"""


def test_launched_servers_leaves_out_a_servers_child_that_still_has_its_command_line():
    """ci: a server's child, caught before it renamed itself, was counted as a second server."""
    server = subprocess.Popen(
        [sys.executable, "-c", _FORKING_SERVER, "sglang.launch_server", "--port", "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    children = []
    try:
        assert server.stdout.readline().strip() == "ready"
        children = psutil.Process(server.pid).children()
        (child,) = children
        assert "sglang.launch_server" in " ".join(child.cmdline())  # the moment the test must survive
        mine = [p.pid for p in launched_servers(os.getpid()) if p.pid in (server.pid, child.pid)]
        assert mine == [server.pid]
    finally:
        server.stdin.close()  # both read stdin to its end: closing it ends them
        server.wait(timeout=60)
        psutil.wait_procs(children, timeout=60)
