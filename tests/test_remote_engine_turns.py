"""A Ray-hosted HF engine's one-request calls (episodes' later turns) cross to the actor together:
the first waits ``gather_s`` for the calls made meanwhile, a message never waits for the one out
before it, and an abort answers the waiting ones "abort" without sending them. The actor is a stand-in handle whose
messages the test holds and counts (the object refs are real)."""

from __future__ import annotations

import threading

import pytest
import ray

from megatron_dapo.driver.engine_host import RemoteEngine
from megatron_dapo.rollout.types import GenerationRequest, GenerationResult, SamplingParams


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return ray.put(self.fn(*args))


class Host:
    """``generate_apart`` answers each request with its id's length in tokens; the first message
    is held until ``gate`` opens."""

    def __init__(self):
        self.messages, self.gate, self.holding = [], threading.Event(), threading.Event()
        self.generate_apart = _Method(self._apart)
        self.abort = _Method(lambda: None)

    def _apart(self, requests):
        self.messages.append([q.request_id for q in requests])
        if len(self.messages) == 1:
            self.holding.set()
            assert self.gate.wait(timeout=60)
        return [
            GenerationResult(q.request_id, [7] * len(q.request_id), [-0.5] * len(q.request_id), "stop", 3)
            for q in requests
        ]


def _turn(rid):
    return GenerationRequest(rid, [1, 2], SamplingParams(max_new_tokens=4))


def _calls(engine, ids):
    out = {}
    threads = [
        threading.Thread(target=lambda r=r: out.setdefault(r, engine.generate([_turn(r)]))) for r in ids
    ]
    return out, threads


def _queued(engine, n):
    for _ in range(6000):
        if len(engine._waiting) >= n:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{n} calls never queued")


def test_one_request_calls_made_within_the_gather_time_cross_in_one_message(ray_local):
    host = Host()
    host.gate.set()
    engine = RemoteEngine("hf-0", host, timeout_s=60)
    engine.gather_s = 2.0  # far longer than the threads take to start
    out, threads = _calls(engine, ["a", "bb", "ccc"])
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(host.messages) == 1 and sorted(host.messages[0]) == ["a", "bb", "ccc"]  # alone: three
    assert {rid: [(r.request_id, len(r.output_ids)) for r in res] for rid, res in out.items()} == {
        rid: [(rid, len(rid))] for rid in ["a", "bb", "ccc"]
    }


def test_a_message_does_not_wait_for_the_one_out_before_it(ray_local):
    host = Host()
    engine = RemoteEngine("hf-0", host, timeout_s=60)
    engine.gather_s = 0.01
    out, threads = _calls(engine, ["a", "bb"])
    threads[0].start()
    assert host.holding.wait(timeout=60)  # a's message is out and held
    threads[1].start()
    for _ in range(6000):
        if len(host.messages) == 2:
            break
        threading.Event().wait(0.01)
    assert host.messages == [["a"], ["bb"]]
    host.gate.set()
    for t in threads:
        t.join(timeout=60)
    assert [r.finish_reason for rid in ("a", "bb") for r in out[rid]] == ["stop", "stop"]


def test_an_abort_answers_the_calls_waiting_on_the_driver_without_sending_them(ray_local):
    host = Host()
    host.gate.set()
    engine = RemoteEngine("hf-0", host, timeout_s=60)
    engine.gather_s = 2.0
    out, threads = _calls(engine, ["bb"])
    threads[0].start()
    _queued(engine, 1)
    engine.abort()
    threads[0].join(timeout=60)
    assert host.messages == []
    (late,) = out["bb"]
    assert (late.finish_reason, late.output_ids) == ("abort", [])
    engine.gather_s = 0.0
    assert engine.generate([_turn("e")])[0].finish_reason == "stop"  # a call after the abort runs
