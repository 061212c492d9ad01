"""A Ray-hosted HF engine's one-request calls (episodes' later turns) cross to the actor together:
while one message is out, the calls made meanwhile wait on the driver and go in the next, and an
abort answers the waiting ones "abort" without sending them. The actor is a stand-in handle whose
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


def test_one_request_calls_made_while_a_message_is_out_go_together_in_the_next(ray_local):
    host = Host()
    engine = RemoteEngine("hf-0", host, timeout_s=60)
    out, threads = _calls(engine, ["a", "bb", "ccc", "dddd"])
    threads[0].start()
    assert host.holding.wait(timeout=60)
    for t in threads[1:]:
        t.start()
    _queued(engine, 3)
    host.gate.set()
    for t in threads:
        t.join(timeout=60)
    assert host.messages[0] == ["a"] and sorted(host.messages[1]) == ["bb", "ccc", "dddd"]
    assert len(host.messages) == 2  # one call at a time: four messages
    assert {rid: [(r.request_id, len(r.output_ids)) for r in res] for rid, res in out.items()} == {
        rid: [(rid, len(rid))] for rid in ["a", "bb", "ccc", "dddd"]
    }


def test_an_abort_answers_the_calls_waiting_on_the_driver_without_sending_them(ray_local):
    host = Host()
    engine = RemoteEngine("hf-0", host, timeout_s=60)
    out, threads = _calls(engine, ["a", "bb"])
    threads[0].start()
    assert host.holding.wait(timeout=60)
    threads[1].start()
    _queued(engine, 1)
    engine.abort()
    host.gate.set()
    for t in threads:
        t.join(timeout=60)
    assert host.messages == [["a"]]
    (late,) = out["bb"]
    assert (late.finish_reason, late.output_ids) == ("abort", [])
    assert engine.generate([_turn("e")])[0].finish_reason == "stop"  # a call after the abort runs
