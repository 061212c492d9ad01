"""The tool workers under load (agent/tools/host.py, agent/runner.py): how many calls run at once,
where a tool's stderr and tracebacks go, and the life of verl class tool instances."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import function_tool_spec

from megatron_dapo.agent.calls import ToolCall
from megatron_dapo.agent.runner import AppendOnly, MultiTurn, MultiTurnSettings
from megatron_dapo.agent.tool_instances import ToolInstances
from megatron_dapo.agent.tools.host import ToolHost
from megatron_dapo.agent.tools.spec import ToolSpec
from megatron_dapo.config.schema import MultiTurnConfig
from megatron_dapo.rollout.engine import EngineError
from megatron_dapo.rollout.types import GenerationRequest, GenerationResult, SamplingParams

EOT = ord("$")


def _toks(text: str) -> list[int]:
    return [ord(c) for c in text]


class _CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


@dataclass
class _Call:
    name: str
    arguments: dict
    error: str | None = None


class _OneCall:
    """Every ``[...]`` in a turn is one call of ``wait``."""

    def parse(self, text):
        return [_Call("wait", {}) for _ in range(text.count("["))]


class _CharChat:
    end_of_turn_ids = [EOT]

    def env_ids(self, messages, *, ended_with_eot=True):
        return ([] if ended_with_eot else [EOT]) + _toks("".join(f"<{m['content']}>" for m in messages))

    def truncate(self, text, max_tokens, side):
        return text[:max_tokens]


class _CallThenStop:
    """Turn 0 of every episode calls the tool; turn 1 answers."""

    name = "scripted"

    def generate(self, requests, on_result=None):
        out = []
        for q in requests:
            text = "[w]$" if q.request_id.endswith("/t0") else "ok$"
            ids = _toks(text)
            out.append(GenerationResult(q.request_id, ids, [0.0] * len(ids), "stop", weight_version=0))
        return out


def _loop(tools) -> MultiTurn:
    settings = MultiTurnSettings(
        max_assistant_turns=2,
        max_turn_tokens=None,
        max_tool_response_tokens=50,
        tool_response_truncate_side="right",
        max_parallel_calls=1,
        # the tool pool's tests: no re-render of the whole conversation (test_agent_runner's)
        tokenization_sanity_check_mode="disable",
    )
    return MultiTurn(settings, AppendOnly(_CharChat()), tools, _OneCall(), _CharTokenizer())


def _episodes(n: int) -> list[GenerationRequest]:
    return [GenerationRequest(f"e{i}", _toks("Q"), SamplingParams(max_new_tokens=40)) for i in range(n)]


@dataclass
class _Answer:
    text: str
    status: str


class _Gathering:
    """Stand-in tools with ``workers`` workers whose call returns once ``workers`` calls are in it
    at once (a barrier): a loop that runs fewer at a time sees its calls time out."""

    def __init__(self, workers: int, wait_s: float):
        self.workers = workers
        self.barrier = threading.Barrier(workers, timeout=wait_s)
        self.lock = threading.Lock()
        self.inside = self.most = 0

    def call(self, episode_id, call, *, tools_kwargs=None):
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        try:
            self.barrier.wait()
            return _Answer("met", "ok")
        except threading.BrokenBarrierError:
            return _Answer("alone", "timeout")
        finally:
            with self.lock:
                self.inside -= 1

    def release(self, episode_id):
        pass

    def close(self):
        pass


# -- how many calls run at once ---------------------------------------------------------------


def test_the_episode_loop_runs_as_many_tool_calls_at_once_as_the_host_has_workers():
    # 96 episodes each call a tool in the same turn, on a host of 96 workers: all 96 calls are in
    # the tools at once (the loop used to cap them at 64 threads, the rest waited a round)
    tools = _Gathering(workers=96, wait_s=10.0)
    loop = _loop(tools)
    try:
        results = loop.run(_CallThenStop(), _episodes(96), threading.Event())
    finally:
        loop.close()
    assert tools.most == 96
    assert [r.episode.turns[1].timeouts for r in results] == [0] * 96
    assert [r.finish_reason for r in results] == ["stop"] * 96


def test_the_default_tool_workers_are_the_cores_this_process_may_use():
    # the default follows the machine: its CPU affinity (a Slurm step's share), counted here by hand
    assert MultiTurnConfig().tool_workers == len(os.sched_getaffinity(0))


SLEEPER = """
import time


def nap(seconds):
    start = time.time()
    time.sleep(float(seconds))
    return f"{start} {time.time()}"
"""


def test_calls_of_a_waiting_tool_all_run_at_once_in_worker_processes(tmp_path):
    # 12 episodes call a tool that sleeps 1 s on a host of 12 workers: the 12 sleeps overlap (the
    # ideal wall time of 1 s, not 12 / workers s), measured by the tool's own clock
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    spec = function_tool_spec("nap", tmp_path / "sleeper.py", seconds="number")
    n = 12
    with ToolHost([spec], timeout_s=20, workers=n, memory_mb=512) as host:
        host.start()
        answers: list = [None] * n

        def one(i: int) -> None:
            answers[i] = host.call(f"e{i}", ToolCall("nap", {"seconds": 1.0}))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [a.status for a in answers] == ["ok"] * n
    spans = [tuple(map(float, a.text.split())) for a in answers]
    assert max(s for s, _ in spans) < min(e for _, e in spans)  # every sleep overlaps every other


PID_TOOL = """
import os
import time


def pid():
    time.sleep(0.5)
    return str(os.getpid())
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_workers_a_burst_started_end_once_idle(tmp_path):
    # three calls at once start three workers; idle past idle_s, they end (the next call starts
    # one afresh) instead of staying for the rest of the run
    (tmp_path / "pid.py").write_text(PID_TOOL)
    spec = function_tool_spec("pid", tmp_path / "pid.py")
    with ToolHost([spec], timeout_s=20, workers=3, memory_mb=512, idle_s=1.0) as host:
        burst: list = [None] * 3

        def one(i: int) -> None:
            burst[i] = int(host.call(f"e{i}", ToolCall("pid", {})).text)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(burst)) == 3 and all(map(_alive, burst))
        time.sleep(2.5)
        later = int(host.call("e3", ToolCall("pid", {})).text)
        assert [_alive(p) for p in burst] == [False] * 3
        assert later not in burst and _alive(later) and host.stats()["workers"] == 1


# -- where a tool's errors go -----------------------------------------------------------------

NOISY = """
import sys


def noisy(n):
    print(f"NOISE-{n} from the tool", file=sys.stderr, flush=True)
    raise ValueError("boom")


def other():
    raise KeyError("missing")
"""


def test_a_tools_stderr_and_tracebacks_go_to_the_tool_log_and_the_console_counts(tmp_path, capfd, caplog):
    (tmp_path / "noisy.py").write_text(NOISY)
    specs = [
        function_tool_spec("noisy", tmp_path / "noisy.py", n="integer"),
        function_tool_spec("other", tmp_path / "noisy.py"),
    ]
    log = tmp_path / "run" / "tools.log"
    caplog.set_level("WARNING", logger="megatron_dapo.agent.tools.host")
    with ToolHost(specs, timeout_s=20, workers=2, memory_mb=512, log_path=log) as host:
        answers = [host.call(f"e{i}", ToolCall("noisy", {"n": i})) for i in range(5)]
        answers.append(host.call("e5", ToolCall("other", {})))
    assert [a.text for a in answers] == ["Error: ValueError: boom"] * 5 + ["Error: KeyError: 'missing'"]
    # the console (the trainer's stderr) never sees the tool's own output
    assert "NOISE" not in capfd.readouterr().err
    text = log.read_text()
    assert [f"NOISE-{i} from the tool" in text for i in range(5)] == [True] * 5
    assert text.count('raise ValueError("boom")') == 5 and text.count('raise KeyError("missing")') == 1
    # one line when an error first happens, one with its count when it recurred (at close here)
    boom = [r.getMessage() for r in caplog.records if "boom" in r.getMessage()]
    assert len(boom) == 2 and str(log) in boom[0] and "Traceback" not in boom[0]
    assert boom[1] == "tool noisy: Error: ValueError: boom: 5 times (4 since the last count)"
    assert len([r for r in caplog.records if "missing" in r.getMessage()]) == 1


# -- verl class tools: whose instance is whose ------------------------------------------------


def _recording_tool(record: Path) -> ToolSpec:
    parameters = {"type": "object", "properties": {"step": {"type": "integer"}, "sleep": {"type": "number"}}}
    return ToolSpec(
        name="count",
        schema={"type": "function", "function": {"name": "count", "parameters": parameters}},
        kind="verl_class",
        target="tests.fixtures.agent_tools.verl_recorder.RecordingTool",
        config={"record": str(record)},
    )


def _records(record: Path) -> list[tuple[str, str]]:
    """(op, instance id) of what the tool recorded, in order."""
    if not record.exists():
        return []
    return [(r["op"], r["id"]) for r in map(json.loads, record.read_text().splitlines())]


class _CountCalls:
    def parse(self, text):
        return [_Call("count", {"step": 1}) for _ in range(text.count("["))]


class _Turns:
    """Turn 0 calls the tool; turn 1 does ``then``: stop, abort, fail (raise) or wait for
    ``self.go`` and stop (an engine that hangs until let go)."""

    name = "scripted"

    def __init__(self, then: str):
        self.then = then
        self.go = threading.Event()
        self.waiting = threading.Event()

    def generate(self, requests, on_result=None):
        out = []
        for q in requests:
            if q.request_id.endswith("/t0"):
                ids, finish = _toks("[c]$"), "stop"
            elif self.then == "fail":
                raise EngineError("engine died mid-episode")
            elif self.then == "abort":
                ids, finish = _toks("o"), "abort"
            else:
                if self.then == "hang":
                    self.waiting.set()
                    self.go.wait(30)
                ids, finish = _toks("ok$"), "stop"
            out.append(GenerationResult(q.request_id, ids, [0.0] * len(ids), finish, weight_version=0))
        return out


def _episodes_of(host: ToolHost, keep_aborted: bool = False) -> ToolInstances:
    settings = MultiTurnSettings(
        max_assistant_turns=3,
        max_turn_tokens=None,
        max_tool_response_tokens=50,
        tool_response_truncate_side="right",
        max_parallel_calls=1,
        tokenization_sanity_check_mode="disable",
    )
    loop = MultiTurn(settings, AppendOnly(_CharChat()), host, _CountCalls(), _CharTokenizer())
    return ToolInstances(loop, keep_aborted=keep_aborted)


def _flush(host: ToolHost) -> None:
    """On a one-worker host, a call on another episode answers only after every release sent
    before it has run (the worker reads its pipe in order)."""
    host.call("flush", ToolCall("count", {"step": 0}))
    host.release("flush")
    host.call("flush2", ToolCall("count", {"step": 0}))


def _text(result: GenerationResult) -> str:
    return "".join(chr(i) for i in result.output_ids)


@pytest.fixture
def recorder(tmp_path):
    record = tmp_path / "record.jsonl"
    with ToolHost([_recording_tool(record)], timeout_s=10, workers=1, memory_mb=1024) as host:
        yield host, record


@pytest.mark.parametrize("keep_aborted", [False, True])
def test_an_aborted_episodes_instance_is_released_unless_it_may_be_continued(recorder, keep_aborted):
    host, record = recorder
    (result,) = _episodes_of(host, keep_aborted).run(_Turns("abort"), _episodes(1), threading.Event())
    assert result.finish_reason == "abort" and "<total=1>" in _text(result)
    _flush(host)
    records = _records(record)
    assert records[:3] == [("create", records[0][1]), ("start", records[0][1]), ("end", records[0][1])]
    # without partial rollouts nothing continues it: the tool saw its release
    assert [op for op, i in records if i == records[0][1]] == ["create", "start", "end"] + (
        [] if keep_aborted else ["release"]
    )


def test_a_dropped_episodes_instance_is_released_and_its_retry_gets_a_fresh_one(recorder):
    host, record = recorder
    episodes = _episodes_of(host)
    with pytest.raises(EngineError):
        episodes.run(_Turns("fail"), _episodes(1), threading.Event())
    # the manager retries the call: the same request id, from the start
    (again,) = episodes.run(_Turns("stop"), _episodes(1), threading.Event())
    assert "<total=1>" in _text(again)  # not total=2: the failed run's instance is not reused
    _flush(host)
    first, second = [i for op, i in _records(record) if op == "create"][:2]
    assert first != second
    assert _records(record)[:5] == [
        ("create", first),
        ("start", first),
        ("end", first),
        ("release", first),  # the failed run's, before its retry started
        ("create", second),
    ]


def test_a_retry_never_shares_the_instance_a_dropped_call_still_holds(recorder):
    host, record = recorder
    episodes = _episodes_of(host)
    hung = _Turns("hang")
    dropped = threading.Thread(target=episodes.run, args=(hung, _episodes(1), threading.Event()))
    dropped.start()
    try:
        assert hung.waiting.wait(30)  # the dropped call made its tool call and now hangs
        (retry,) = episodes.run(_Turns("stop"), _episodes(1), threading.Event())
    finally:
        hung.go.set()
        dropped.join(30)
    assert "<total=1>" in _text(retry) and retry.episode.key == "e0~2"
    _flush(host)
    records = _records(record)
    created = [i for op, i in records if op == "create"][:2]
    assert len(set(created)) == 2
    assert sorted(i for op, i in records if op == "release" and i in created) == sorted(created)


def test_a_call_past_its_time_out_never_runs_beside_the_next_call_on_its_instance(tmp_path):
    record = tmp_path / "record.jsonl"
    with ToolHost([_recording_tool(record)], timeout_s=1.5, workers=1, memory_mb=1024) as host:
        start = time.monotonic()
        late = host.call("e0", ToolCall("count", {"step": 1, "sleep": 3.0}))
        after = host.call("e0", ToolCall("count", {"step": 1}))
        time.sleep(max(0.0, start + 3.5 - time.monotonic()))  # past the end the late call would have had
    assert late.status == "timeout"
    assert after.status == "error" and "lost" in after.text
    records = _records(record)
    instance = records[0][1]
    # the late call was stopped where it stood (its worker killed): it never ended, and nothing
    # else ran on its instance, before or after
    assert records == [("create", instance), ("start", instance)]
