"""A server of this node that hangs (SIGSTOP: its port accepts, nothing answers) is taken as dead
(issue 10): found by the check before the weight sync (its GET /health is not answered within the
engine's health timeout), its process group SIGKILLed without waiting out a SIGTERM grace, and a new
one started; an abort sent to it gives up after the health timeout instead of ending the rollout.

The server is the stand-in HTTP server (answers every GET with its pid and parent pid) under a real
`SGLangServer`, the engine a real `SGLangEngine`; the Ray node host restarts through the same
`SGLangServer.restart`, so one server object covers both local placements.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from megatron_dapo.ports import free_port
from megatron_dapo.rollout.engine_pool import EnginePool
from megatron_dapo.sglang.client import SGLangEngine
from megatron_dapo.sglang.node_host import SGLangNodeHost
from megatron_dapo.sglang.server import SGLangServerConfig

STANDIN = Path(__file__).with_name("standin_http_server.py")


def _pid(url: str) -> int:
    return httpx.get(url + "/health", timeout=30).json()["pid"]


@pytest.fixture
def host(tmp_path):
    """A started stand-in server under a node host (in process: the Ray actor's own class)."""
    port = free_port()
    cfg = SGLangServerConfig(
        model_path="unused",
        port=port,
        startup_timeout_s=60,
        log_file=str(tmp_path / "e.log"),
        env={"STANDIN_REQUEST_LOG": str(tmp_path / "requests.log")},
    )
    h = SGLangNodeHost([cfg], [[sys.executable, str(STANDIN), "127.0.0.1", str(port)]])
    h.servers[0].poll_s = 0.2
    h.start()
    yield h
    h.stop()  # SIGTERM + SIGCONT: also ends a server a failed test left stopped


def test_hung_server_is_found_before_the_sync_killed_and_restarted(host):
    server = host.servers[0]
    engine = SGLangEngine(server.cfg.url, name="sglang-0", server=server, health_timeout_s=2)
    try:
        pool = EnginePool([engine])
        assert pool.restart_down() == [] and pool.down == {}  # a serving one is left alone
        stopped = _pid(server.cfg.url)
        os.killpg(stopped, signal.SIGSTOP)
        assert pool.restart_down() == ["sglang-0"]
        assert "GET /health within 2s" in pool.down["sglang-0"]
        new = httpx.get(server.cfg.url + "/health", timeout=30).json()
        assert new["pid"] != stopped and new["ppid"] == os.getpid()
        assert not Path(f"/proc/{stopped}").exists()  # SIGKILLed and reaped, not left stopped
    finally:
        engine.close()


def test_node_host_restart_kills_a_stopped_server(host):
    stopped = _pid(host.servers[0].cfg.url)
    os.killpg(stopped, signal.SIGSTOP)
    # the Ray placement's restart (SGLangNodeHost.restart, run inside the node's actor): the stopped
    # group is killed, not left waiting on a SIGTERM it cannot handle while stopped
    new = host.restart(0)
    assert new != stopped and _pid(host.servers[0].cfg.url) == new
    assert not Path(f"/proc/{stopped}").exists()


def test_abort_on_a_hung_server_gives_up_after_the_health_timeout(host):
    """The abort waits one health timeout for its POST, sent once, then asks GET /health, which
    waits another: about 2 x 2 s, not the request timeout (600 s) nor a retried POST. The stopped
    server's request log, read after SIGCONT, says what reached it."""
    server = host.servers[0]
    requests_log = Path(server.cfg.env["STANDIN_REQUEST_LOG"])
    # the request timeout (and its retries) is what a hung server would make abort wait before
    engine = SGLangEngine(server.cfg.url, name="sglang-0", server=server, health_timeout_s=2, timeout_s=600)
    pgid = _pid(server.cfg.url)
    requests_log.unlink()  # the start-up's health checks
    os.killpg(pgid, signal.SIGSTOP)
    done, raised, took = threading.Event(), [], []

    def abort():
        start = time.monotonic()
        try:
            engine.abort()
        except BaseException as e:  # noqa: BLE001 - reported below
            raised.append(e)
        took.append(time.monotonic() - start)
        done.set()

    threading.Thread(target=abort, daemon=True).start()
    try:
        assert done.wait(120), "abort on a hung server did not return"
        assert raised == [], raised
        # both health timeouts waited out (a hair under, for timer rounding), and 6 s of slack
        # for a loaded machine on top: a POST not waited for, or the request timeout, fail it
        assert 2 * 2.0 - 0.1 <= took[0] < 2 * 2.0 + 6.0, took
        os.killpg(pgid, signal.SIGCONT)  # it reads the requests that waited in its backlog
        deadline = time.monotonic() + 60
        while "GET /health" not in _read(requests_log) and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = _read(requests_log).splitlines()
        # in arrival order: the one abort, then the health check that found it hung
        assert [line.split(" HTTP/")[0] for line in lines] == ["POST /abort_request", "GET /health"], lines
    finally:
        os.killpg(server.proc.pid, signal.SIGKILL)
        engine.close()


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_a_serving_server_costs_no_liveness_call_to_its_node_before_the_sync(host):
    # on the Ray path `server.alive()` is a call to the node's host actor (60 s timeout); a server
    # that answers GET /health needs no such call every step (before: one per engine per step)
    class RemoteLike:
        def __init__(self, server):
            self.server, self.alive_calls = server, 0

        def alive(self):
            self.alive_calls += 1
            return self.server.alive()

        def restart(self):
            return self.server.restart()

    remote = RemoteLike(host.servers[0])
    engine = SGLangEngine(remote.server.cfg.url, name="sglang-0", server=remote, health_timeout_s=2)
    try:
        pool = EnginePool([engine])
        assert pool.restart_down() == [] and remote.alive_calls == 0
        os.killpg(_pid(remote.server.cfg.url), signal.SIGKILL)  # a dead one is still told apart
        # a SIGKILL is delivered asynchronously: once reaped the process is gone for sure (CI once
        # checked in between: no /health answer yet a live process, "does not answer GET /health")
        remote.server.proc.wait(timeout=60)
        assert pool.restart_down() == ["sglang-0"]
        assert pool.down["sglang-0"] == "its server is gone" and remote.alive_calls == 1
    finally:
        engine.close()


def test_health_timeout_must_be_positive():
    from megatron_dapo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rollout\.sglang\.health_timeout_s=0\.0 must be > 0"):
        load_config(None, ["model.path=/m", "rollout.sglang.health_timeout_s=0"])


def test_health_probe_interval_must_be_positive():
    from megatron_dapo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rollout\.health_probe_interval_s=-1\.0 must be > 0"):
        load_config(None, ["model.path=/m", "rollout.health_probe_interval_s=-1"])
    from megatron_dapo.rollout.manager import RolloutManagerConfig

    cfg = load_config(None, ["model.path=/m", "rollout.health_probe_interval_s=5"])
    assert RolloutManagerConfig.from_config(cfg).health_probe_interval_s == 5.0


def test_the_check_before_a_sync_asks_only_engines_not_heard_from_since_the_last_one():
    class Engine:
        """A launched engine that counts the health checks it gets and how they were asked."""

        def __init__(self, name):
            self.name, self.server, self.asked = name, self, []

        def alive(self):
            raise AssertionError("a server that answers /health is not asked whether it lives")

        def health(self, check_process=True):
            self.asked.append(check_process)
            return True

    a, b = Engine("a"), Engine("b")
    pool = EnginePool([a, b])
    pool.mark_heard("a")  # a answered a call this step
    assert pool.restart_down() == [] and pool.down == {}
    assert a.asked == [] and b.asked == [False]  # only the silent one, and only its /health
    assert pool.heard == set()  # the sync starts a new period
    assert pool.restart_down() == [] and a.asked == [False] and b.asked == [False, False]
