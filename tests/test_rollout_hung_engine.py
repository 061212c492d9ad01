"""An engine that hangs in the middle of a rollout (issue 10): its calls are in flight and never
come back. The manager asks a silent engine's health once per ``health_probe_interval_s`` (a clock
the test steps, no sleeps), takes a failed one as hung, re-queues its groups on the others and
finishes the step long before ``request_timeout_s`` (an hour here), with the batch a run on a
healthy engine alone gives. A server given by URL that hangs while it is the only engine stops the
step with one line naming it, what failed and the settings.

The hung server in the HTTP tests is the stand-in server (tests/standin_http_server.py) stopped
with SIGSTOP: its port accepts connections and nothing answers, /generate or /health; the engine
is the real `SGLangEngine` client.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rollout_fakes import (
    MIXED,
    Dataset,
    GatedEngine,
    HungEngine,
    Scorer,
    ScriptedEngine,
    StepClock,
    TickingClock,
    Tokenizer,
    accounted,
    manager_config,
)

from megatron_dapo.ports import free_port
from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.rollout.manager import NoEngineAliveError, RolloutManager
from megatron_dapo.sglang.client import SGLangEngine
from megatron_dapo.sglang.health import poll_health

STANDIN = Path(__file__).with_name("standin_http_server.py")
HOUR = 3600.0


def _reference(cfg):
    """The batch of the same step on one healthy engine."""
    return RolloutManager([ScriptedEngine("ref")], Scorer(), cfg, Tokenizer()).collect(Dataset([MIXED]), 0)


def _rows(batch):
    return [(s.prompt.index, s.response_ids, s.final_reward) for s in batch.samples]


def test_an_engine_hung_mid_rollout_is_dropped_after_one_probe_and_the_step_finishes(caplog):
    hung = HungEngine("hung")
    ok = GatedEngine("ok", gate=hung.returned)  # answers only after the hung one's late answer
    # two calls per engine at once (8 requests // (n=4 x 1 group)); the request timeout is an hour
    cfg = manager_config(
        gen_batch_size=8,
        train_batch_size=8,
        max_concurrency_per_engine=8,
        request_timeout_s=HOUR,
        health_probe_interval_s=30,
    )
    mgr = RolloutManager([hung, ok], Scorer(), cfg, Tokenizer())
    mgr.clock = clock = StepClock()
    out = {}
    worker = threading.Thread(target=lambda: out.update(batch=mgr.collect(Dataset([MIXED]), 0)), daemon=True)
    with caplog.at_level(logging.ERROR, logger="megatron_dapo.rollout.manager"):
        worker.start()
        assert hung.entered.wait(60) and ok.entered.wait(60)  # both hold calls, neither answers
        clock.t = 30.0  # both silent for the interval: each is asked once
        worker.join(120)  # a bound for a broken test, far below the request timeout
    assert not worker.is_alive(), "the step waited on the hung engine"
    batch, m = out["batch"], out["batch"].metrics
    assert _rows(batch) == _rows(_reference(cfg))  # same groups, same samples, same order
    # one probe for the hung engine's 2 calls (8 requests), one for the silent healthy one
    assert hung.health_calls == 1 and ok.health_calls == 1
    assert hung.aborts == 1 and len(hung.served) == 2  # it answered late; the answers were dropped
    assert sorted(ok.served) == list(range(m["rollout/prompts_drawn"]))  # each group once
    assert accounted(m) == m["rollout/prompts_drawn"]
    assert (
        m["rollout/engines_hung"] == 1 and m["rollout/engines_down"] == 1 and m["rollout/engines_lost"] == 1
    )
    assert mgr.pool.down["hung"].startswith("hung (no reply for 30s to 2 calls in flight")
    assert "ok" not in mgr.pool.down and mgr.pool.heard == {"ok"}  # the check before the sync skips "ok"
    assert "engine hung hung" in caplog.text and "continues without it" in caplog.text


def test_a_silent_engine_that_answers_its_probe_keeps_its_work():
    gate = threading.Event()
    slow = GatedEngine("slow", gate=gate)
    cfg = manager_config(request_timeout_s=HOUR, health_probe_interval_s=30)
    mgr = RolloutManager([slow], Scorer(), cfg, Tokenizer())
    mgr.clock = clock = StepClock()
    out = {}
    worker = threading.Thread(target=lambda: out.update(batch=mgr.collect(Dataset([MIXED]), 0)), daemon=True)
    worker.start()
    probed = threading.Event()
    health = slow.health

    def counted(check_process=True):
        probed.set()
        return health(check_process)

    slow.health = counted
    assert slow.entered.wait(60)
    clock.t = 30.0
    assert probed.wait(60)  # asked once it was silent for the interval, and it answers
    gate.set()
    worker.join(120)
    assert not worker.is_alive()
    assert _rows(out["batch"]) == _rows(_reference(cfg)) and mgr.pool.down == {}
    assert out["batch"].metrics["rollout/engines_hung"] == 0 and slow.health_calls == 1


# ------------------------------------------------------------------ a real HTTP client, a stopped server
@pytest.fixture
def stopped_server():
    """A stand-in server that answered /health, then SIGSTOPped: it accepts, never answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(STANDIN), "127.0.0.1", str(port)], start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert poll_health(url, 60, poll_s=0.1).healthy
        os.kill(proc.pid, signal.SIGSTOP)
        yield url, proc
    finally:
        proc.kill()  # also ends a stopped one; its sockets close, so stuck client calls return
        proc.wait()


def _url_engine(url):
    # given by URL (no `server`): this run cannot restart it; timeouts as a run would set them
    return SGLangEngine(url, name=f"sglang-0@{url[7:]}", health_timeout_s=1, timeout_s=HOUR)


def _http_config(**kw):
    return manager_config(
        n=2, max_concurrency_per_engine=2, request_timeout_s=HOUR, health_probe_interval_s=2, **kw
    )


def test_a_hung_url_server_alone_stops_the_step_with_one_line(stopped_server):
    url, proc = stopped_server
    engine = _url_engine(url)
    mgr = RolloutManager([engine], Scorer(), _http_config(), Tokenizer())
    mgr.clock = TickingClock()
    try:
        with pytest.raises(NoEngineAliveError) as raised:
            mgr.collect(Dataset([MIXED]), 0)
    finally:
        proc.kill()  # first: the client's stuck calls end with the connection
        proc.wait()
        engine.close()
    line = str(raised.value)
    assert "\n" not in line
    assert f"the server at {url} (engine sglang-0@{url[7:]}) hung" in line
    assert f"GET {url}/health unanswered within 1s" in line
    assert "given by rollout.sglang.urls" in line and "rollout.sglang.health_timeout_s" in line


def test_the_step_goes_on_without_a_hung_url_server(stopped_server, caplog):
    url, proc = stopped_server
    engine, ok = _url_engine(url), ScriptedEngine("ok")
    cfg = _http_config(gen_batch_size=4, train_batch_size=4)
    mgr = RolloutManager([engine, ok], Scorer(), cfg, Tokenizer())
    mgr.clock = TickingClock()
    try:
        with caplog.at_level(logging.ERROR, logger="megatron_dapo.rollout.manager"):
            batch = mgr.collect(Dataset([MIXED]), 0)
    finally:
        proc.kill()
        proc.wait()
        engine.close()
    m = batch.metrics
    assert _rows(batch) == _rows(_reference(cfg))  # group 0 went to the hung server first
    assert sorted(ok.served) == list(range(m["rollout/prompts_drawn"]))
    assert m["rollout/engines_hung"] == 1 and m["rollout/engines_lost"] == 1
    assert f"GET {url}/health unanswered within 1s" in mgr.pool.down[engine.name]
    assert "continues without it" in caplog.text


def test_closing_an_engine_ends_its_calls_stuck_on_a_hung_server(stopped_server):
    from concurrent.futures import CancelledError, ThreadPoolExecutor

    from megatron_dapo.rollout.types import GenerationRequest, SamplingParams

    url, _ = stopped_server
    engine = _url_engine(url)
    sent, generate = threading.Event(), engine.client.generate

    async def sending(req):
        sent.set()
        return await generate(req)

    engine.client.generate = sending
    request = GenerationRequest("r0", [1, 2], SamplingParams(max_new_tokens=1))
    with ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(engine.generate, [request])
        assert sent.wait(60)
        engine.close()  # before: the call's thread waited on a stopped loop, and so did the exit
        with pytest.raises(CancelledError):
            stuck.result(timeout=60)
        # a call after the close fails at once instead of waiting on the stopped loop
        with pytest.raises(EngineError, match="the engine is closed"):
            pool.submit(engine.generate, [request]).result(timeout=60)
