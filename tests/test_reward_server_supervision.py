"""Supervision of the run's reward servers (sglang/reward_servers.py), one poll at a time with
stand-in processes: a server that fails its probe after a restart is stopped and sent nothing, a
crash-looping one stops the run past reward.model.max_restarts with one line naming it, its log
and its restarts, and every restart shows in reward/server_restarts."""

from __future__ import annotations

import threading
import time

import pytest
from reward_model_fixtures import served_settings
from test_rewards_served_failures import StandIn, samples

from megatron_dapo.ports import free_port
from megatron_dapo.rewards.served import BlockingRewardModel, RewardServerDown
from megatron_dapo.sglang.reward_servers import RewardServer, RewardServers


class Process:
    """A server process: ``deaths`` polls it reads dead (one per restart); ``restart`` makes it
    alive again, ``stop`` dead."""

    def __init__(self, dead: bool = False):
        self.running = not dead
        self.restarts = 0
        self.stops = 0

    def alive(self) -> bool:
        return self.running

    def restart(self) -> int:
        self.restarts += 1
        self.running = True
        return 1

    def stop(self) -> None:
        self.stops += 1
        self.running = False


class Events:
    def __init__(self):
        self.down: list[str] = []
        self.back: list[str] = []
        self.lost: list[str] = []
        self.watched = False

    def supervised(self):
        self.watched = True

    def server_down(self, url):
        self.down.append(url)

    def server_back(self, url):
        self.back.append(url)

    def server_lost(self, message):
        self.lost.append(message)


class FailingProbe(RewardServers):
    """Servers whose start-up probe fails (a classifier that no longer scores as transformers)."""

    def check(self, server):
        raise RuntimeError("probe: served 0.31, transformers 0.52")


def settings(**kw):
    return served_settings(kind="judge", path="/judge", **kw)


def test_a_server_failing_its_probe_after_a_restart_is_stopped_and_never_reported_back():
    proc = Process(dead=True)
    servers = FailingProbe(
        settings(max_restarts=3), [RewardServer("http://h:1", "/logs/reward_0.log", proc)], None
    )
    events = Events()
    assert servers.poll(events)
    # restarted once, failed its probe: stopped (not serving wrong scores), the client not told it is back
    assert proc.restarts == 1 and not proc.alive() and proc.stops == 1
    assert events.down == ["http://h:1"] and events.back == []
    assert servers.poll(events) and proc.restarts == 2  # tried again at the next poll, counted


def test_a_restarting_server_gets_no_requests_while_another_is_up(stand_in):
    a, b = stand_in(), stand_in()
    with BlockingRewardModel(
        served_settings(kind="judge", url=a.url, timeout_s=5.0), [a.url, b.url]
    ) as model:
        model.server_down(a.url)
        time.sleep(0.1)  # the event reaches the client's loop
        outs = model.score_many(samples(6))
        assert all(o.scored for o in outs)
        assert a.posts() == 0 and b.posts() == 6
        model.server_back(a.url)  # restarted and probed: it takes its share again
        time.sleep(0.1)
        assert all(o.scored for o in model.score_many(samples(8)))
    assert a.posts() > 0


def test_while_the_only_server_restarts_scores_wait_for_it_instead_of_failing_down():
    """One server, killed and being restarted: a sample scored meanwhile waits for the restart
    (its group is not lost to it). Measured before: a single restart of the demo's classifier left
    the step with 1 of 64 groups and stopped the run. Here the server drops every connection until
    it is back; nothing may reach it before then, and the score is a real one."""
    a = StandIn(default=("drop",))
    try:
        with BlockingRewardModel(
            served_settings(kind="judge", url=a.url, timeout_s=5.0, max_retries=0)
        ) as model:
            model.server_down(a.url)
            time.sleep(0.1)  # the event reaches the client's loop
            out = []
            scorer = threading.Thread(target=lambda: out.extend(model.score_many(samples(3))))
            scorer.start()
            time.sleep(1.0)
            assert scorer.is_alive() and a.posts() == 0  # waiting, not failing
            a.default = ("ok",)  # the restarted server answers
            model.server_back(a.url)
            scorer.join(timeout=10)
            assert [o.scored for o in out] == [True, True, True] and a.posts() == 3
    finally:
        a.close()


def test_a_server_that_dies_between_the_supervisor_s_polls_costs_no_sample():
    """Killed between two polls of the supervisor: requests meet refused connections before it
    notices, marks the server down and restarts it. Measured before: in a demo run whose reward
    server was killed 45 s after each start, the samples scored in those seconds failed "down",
    the step kept 6 of its groups, and the run stopped at the first kill. Here the requests wait
    out the death, the restart and the probe, and every sample gets a real score."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"  # dead: nothing listens yet
    proc = Process(dead=True)
    servers = RewardServers(settings(max_restarts=3), [RewardServer(url, "/logs/reward_0.log", proc)], None)
    started: list[StandIn] = []

    def restart():  # the supervisor's restart: the server listens again on its port
        proc.restarts += 1
        proc.running = True
        started.append(StandIn(port=port))
        return 1

    proc.restart = restart
    model = BlockingRewardModel(served_settings(kind="judge", url=url, timeout_s=5.0, max_retries=0))
    try:
        servers.watch(model)  # the run's supervision: dead servers are restarted
        servers.poll_s = 3600.0  # polled by hand below, after the requests met the dead server
        time.sleep(0.1)
        out = []
        scorer = threading.Thread(target=lambda: out.extend(model.score_many(samples(4))))
        scorer.start()
        time.sleep(1.5)  # every request has met a refused connection by now
        assert scorer.is_alive() and out == []  # waiting for the restart, not failed "down"
        assert servers.poll(model)  # the supervisor notices: restarted, reported back
        scorer.join(timeout=15)
        assert [o.scored for o in out] == [True] * 4
        assert started[0].posts() == 4 and model.restarts == 1
    finally:
        model.close()
        servers.stop()
        for s in started:
            s.close()


def test_a_crash_looping_server_stops_the_run_past_max_restarts_in_one_line():
    proc = Process(dead=True)
    log = "/run/sglang/reward_0.log"
    servers = RewardServers(settings(max_restarts=2), [RewardServer("http://h:7", log, proc)], None)
    events = Events()
    for _ in range(2):  # dies after every start
        assert servers.poll(events)
        proc.running = False
    assert proc.restarts == 2 and servers.restarts == 2 and events.lost == []
    assert not servers.poll(events)  # the third death: past the cap, watching ends
    assert proc.restarts == 2
    [message] = events.lost
    assert "\n" not in message
    assert "http://h:7" in message and log in message and "2 restarts" in message
    assert "reward.model.max_restarts=2" in message


def test_the_client_told_a_server_is_lost_stops_the_run_and_counts_restarts(stand_in):
    s = stand_in()
    model = BlockingRewardModel(served_settings(kind="judge", url=s.url, timeout_s=5.0))
    try:
        model.server_down(s.url)
        model.server_back(s.url)
        assert model.restarts == 1
        model.check_down()  # back: the run goes on
        model.server_lost("reward server http://h:7 died again after 2 restarts")
        time.sleep(0.1)
        with pytest.raises(RewardServerDown, match="died again after 2 restarts"):
            model.check_down()
    finally:
        model.close()


def test_a_server_event_after_the_client_closed_is_dropped_not_a_traceback(stand_in):
    """The run ends (the client closes) while the supervisor restarts a server: its events find
    no loop, and the supervisor's thread must not die on it (seen in a crash-loop run: "Event
    loop is closed" on the console)."""
    s = stand_in()
    model = BlockingRewardModel(served_settings(kind="judge", url=s.url, timeout_s=5.0))
    model.close()
    model.server_down(s.url)
    model.server_back(s.url)
    model.server_lost("gone")
    assert model.restarts == 1


def test_restarts_are_a_step_metric():
    from rollout_fakes import MIXED, Dataset, Scorer, ScriptedEngine, Tokenizer, manager_config
    from test_reward_model_metrics import ScriptedJudge

    from megatron_dapo.rollout.manager import RolloutManager

    judge = ScriptedJudge()
    judge.restarts = 2
    manager = RolloutManager(
        [ScriptedEngine("e0")], Scorer(), manager_config(), Tokenizer(), reward_model=judge
    )
    m = manager.collect(Dataset([MIXED]), weight_version=0).metrics
    assert m["reward/server_restarts"] == 2.0


@pytest.fixture
def stand_in():
    made = []

    def make():
        s = StandIn()
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


CLOSE_WHILE_WAITING = """
import json, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from megatron_dapo.config.schema import RewardModelConfig
from megatron_dapo.rewards.served import BlockingRewardModel, RewardSample, ServedRewardSettings

class Silent(BaseHTTPRequestHandler):  # lists its model, and never answers a verdict
    def do_GET(self):
        body = json.dumps({"data": [{"id": "judge"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        time.sleep(3600)

    def log_message(self, *args):
        pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Silent)
server.daemon_threads = True
threading.Thread(target=server.serve_forever, daemon=True).start()
url = "http://127.0.0.1:%d" % server.server_address[1]
model = BlockingRewardModel(ServedRewardSettings(RewardModelConfig(kind="judge", url=url, timeout_s=600.0)))
outcomes = []
sample = RewardSample(0, [{"role": "user", "content": "q"}], "a")
# a scoring thread that is not a daemon, as a prefetching rollout's is
waiter = threading.Thread(target=lambda: outcomes.append(model.score(sample)))
waiter.start()
many = threading.Thread(target=lambda: outcomes.append(model.score_many([sample, sample])))
many.start()
time.sleep(1.0)
model.close()
waiter.join(30)
many.join(30)
print("ALIVE" if waiter.is_alive() or many.is_alive() else "DONE", outcomes)
print([o.unscored for o in model.score_many([sample])])
"""


def test_closing_wakes_every_score_in_flight_unscored_and_the_process_exits(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", CLOSE_WHILE_WAITING], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    first, after = out.stdout.splitlines()[-2:]
    assert first.startswith("DONE") and first.count("unscored='closed'") == 3, first
    assert after == "['closed']"  # a score asked for after close does not wait either
    assert "Task was destroyed" not in out.stderr and "never retrieved" not in out.stderr


def test_score_one_sample_from_a_thread_and_submit_many_as_coroutines(stand_in):
    s = stand_in()
    with BlockingRewardModel(served_settings(kind="judge", url=s.url, timeout_s=5.0)) as model:
        one = model.score(samples(1)[0])
        futures = [model.submit(x) for x in samples(6)]
        outs = [f.result(timeout=30) for f in futures]
    assert one.scored and one.score == 1.0
    assert [o.sample_id for o in outs] == list(range(6)) and all(o.scored for o in outs)


def test_a_score_failing_after_its_caller_gave_up_leaves_no_traceback(stand_in, caplog):
    """The run stops on a lost server while samples are being scored: their callers have cancelled
    their futures, and nobody reads the tasks' RewardServerDown; asyncio printed "Task exception was
    never retrieved" with a traceback for each on the console (measured: 4 at the end of a crash-loop
    run). A task of the client's that fails is marked as read."""
    import asyncio
    import gc

    s = stand_in()
    model = BlockingRewardModel(served_settings(kind="judge", url=s.url, timeout_s=5.0))
    try:

        async def lost(sample):
            raise RewardServerDown("reward server http://h:7 died again after 3 restarts")

        model.model.score = lost
        loop = asyncio.new_event_loop()
        try:
            with caplog.at_level("ERROR", logger="asyncio"):
                task = loop.create_task(model._within(samples(1)[0], None))
                loop.run_until_complete(asyncio.wait([task]))
                del task
                gc.collect()
        finally:
            loop.close()
        assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    finally:
        model.close()
