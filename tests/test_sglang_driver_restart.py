"""An engine that dies mid-rollout: the step finishes on the other engine with nothing lost, then
the dead engine is restarted and gets the new weights before the manager gives it work again.

The step loop is the real `DAPOTrainer` and `RolloutManager`; the engines are the scripted ones of
test_rollout_manager with a supervised "server" that can be restarted; the actor ranks are fakes.
"""

from __future__ import annotations

import threading

from rollout_fakes import (
    MIXED,
    Dataset,
    Scorer,
    ScriptedEngine,
    TickingClock,
    Tokenizer,
    accounted,
    manager_config,
)
from trainer_fakes import LoggingRanks

from megatron_dapo.config import load_config
from megatron_dapo.driver.run_dir import RunDir
from megatron_dapo.driver.trainer import DAPOTrainer
from megatron_dapo.rollout.manager import RolloutManager


class Server:
    """The dying engine's server process: a restart brings it back with the initial weights."""

    def __init__(self, engine, log):
        self.engine, self.log = engine, log

    def alive(self):
        return self.engine._alive

    def restart(self):
        self.log.append(f"restart {self.engine.name}")
        self.engine._alive, self.engine.die_at_call, self.engine.version = True, None, 0


class VersionedEngine(ScriptedEngine):
    """Records the weight version each of its calls ran with."""

    version = 0

    def __init__(self, name, **kw):
        super().__init__(name, **kw)
        self.served_versions = []

    def generate(self, requests, on_result=None):
        out = super().generate(requests, on_result)
        self.served_versions.append(self.version)
        return out

    def health(self, check_process=True):
        return self._alive


class Data(Dataset):
    def state_dict(self):
        return {"cursor": self.cursor}

    def load_state_dict(self, d):
        self.cursor = d["cursor"]


def _two_steps(tmp_path, manager, sync, log, observe) -> list:
    """Two trainer steps over ``manager`` with ``sync`` as the weight transport; per step what
    ``observe(batch)`` records right after that step's rollout."""
    seen = []
    collect = manager.collect

    def collect_and_observe(dataset, version):
        batch = collect(dataset, version)
        seen.append(observe(batch))
        return batch

    manager.collect = collect_and_observe
    conf = load_config(
        None,
        [
            "model.path=/m",
            f"trainer.runs_dir={tmp_path}",
            "trainer.total_steps=2",
            "trainer.train_batch_size=8",
            "actor.ppo_mini_batch_size=1",
            "rollout.n=4",
            "trainer.save_freq=0",
            "trainer.resume=never",
            "logging.progress=false",
            "logging.tensorboard=false",
        ],
    )
    DAPOTrainer(
        conf,
        run=RunDir.create(tmp_path, "r"),
        ranks=LoggingRanks(log),
        manager=manager,
        dataset=Data([MIXED]),
        transport_sync=sync,
    ).fit()
    return seen


def test_dead_engine_is_restarted_and_synced_before_it_gets_work(tmp_path):
    log = []
    dying, healthy = VersionedEngine("dying", die_at_call=2), VersionedEngine("healthy")
    dying.server = Server(dying, log)
    manager = RolloutManager(
        [dying, healthy],
        Scorer(),
        manager_config(gen_batch_size=8, train_batch_size=8, max_concurrency_per_engine=4),
        Tokenizer(),
    )

    def sync(version):
        for e in (dying, healthy):
            if not e._alive:  # what a real transport does with a dead server
                raise ConnectionError(f"weight sync: {e.name} is gone")
            e.version = version
        log.append(f"sync{version} down={sorted(manager.pool.down)}")
        return {}

    steps = _two_steps(
        tmp_path, manager, sync, log, lambda b: (dict(b.metrics), set(manager.pool.down), list(dying.served))
    )

    # step 1: the engine died, the other finished the step, every prompt is accounted for
    m1, down1, served1 = steps[0]
    assert down1 == {"dying"} and m1["rollout/engines_down"] == 1
    assert m1["rollout/groups_in_batch"] == 8 and accounted(m1) == 8
    assert sorted(served1 + healthy.served[: 8 - len(served1)]) == list(range(8))
    # then: restarted, the transport reset, synced to version 1 while still out of service
    i = log.index("restart dying")
    assert log[i : i + 3] == ["restart dying", "actor.reset_transport", "sync1 down=['dying']"]
    # step 2: it is back, and everything it served ran with the weights of version 1
    m2, down2, _ = steps[1]
    assert down2 == set() and m2["rollout/engines_down"] == 0
    assert dying.served_versions[-1] == 1 and len(dying.served) > len(served1)
    assert all(v == 1 for v in dying.served_versions[len(served1) :])


class HangingEngine(VersionedEngine):
    """Its call `hang_at_call` never answers and its health fails (a hung server) until the
    server is restarted, which ends the stuck call like a killed process's connection does."""

    def __init__(self, name, hang_at_call, **kw):
        super().__init__(name, **kw)
        self.hang_at_call, self.hung, self.killed = hang_at_call, False, threading.Event()

    def generate(self, requests, on_result=None):
        with self._lock:
            hang = self.calls + 1 == self.hang_at_call
            if hang:
                self.calls += 1
                self.hung = True
        if hang:
            assert self.killed.wait(120), "the hung server was never restarted"
            raise ConnectionError(f"{self.name}: connection reset")
        return super().generate(requests, on_result)

    def health(self, check_process=True):
        return self._alive and not self.hung


class HungServer(Server):
    def restart(self):
        super().restart()
        self.engine.hung = False
        self.engine.killed.set()


def test_the_only_engine_hung_mid_rollout_is_restarted_synced_and_the_step_drawn_again(tmp_path):
    log = []
    solo = HangingEngine("solo", hang_at_call=2)
    solo.server = HungServer(solo, log)
    cfg = manager_config(
        gen_batch_size=8,
        train_batch_size=8,
        max_concurrency_per_engine=8,
        request_timeout_s=3600.0,  # the run must not wait for it
        health_probe_interval_s=2.0,
    )
    manager = RolloutManager([solo], Scorer(), cfg, Tokenizer())
    manager.clock = TickingClock()

    def sync(version):
        solo.version = version
        log.append(f"sync{version} down={sorted(manager.pool.down)}")
        return {}

    batches = _two_steps(tmp_path, manager, sync, log, lambda b: b)

    # in step 1 the only engine hung: restarted, the transport reset, given version 0 while out
    # of service; then the step was drawn again from the same prompts
    i = log.index("restart solo")
    assert log[i : i + 3] == ["restart solo", "actor.reset_transport", "sync0 down=['solo']"]
    reference = RolloutManager([VersionedEngine("ref")], Scorer(), cfg, Tokenizer()).collect(Data([MIXED]), 0)
    step1 = batches[0]
    assert [(s.prompt.index, s.response_ids) for s in step1.samples] == [
        (s.prompt.index, s.response_ids) for s in reference.samples
    ]
    assert accounted(step1.metrics) == step1.metrics["rollout/prompts_drawn"] == 8
    assert len(batches) == 2 and manager.pool.down == {}
    # what it served after the restart ran with the weights it was synced to
    assert solo.served_versions.count(0) >= 8 and solo.served_versions[-1] == 1


def test_a_hung_server_given_by_url_is_left_behind_and_the_run_goes_on(tmp_path):
    log = []
    url = HangingEngine("url", hang_at_call=2)  # given by URL: no `server`, this run cannot restart it
    healthy = VersionedEngine("healthy")
    cfg = manager_config(
        gen_batch_size=8,
        train_batch_size=8,
        max_concurrency_per_engine=4,
        request_timeout_s=3600.0,
        health_probe_interval_s=2.0,
    )
    manager = RolloutManager([url, healthy], Scorer(), cfg, Tokenizer())
    manager.clock = TickingClock()

    def sync(version):
        healthy.version = version
        log.append(f"sync{version}")
        return {}

    try:
        steps = _two_steps(tmp_path, manager, sync, log, lambda b: (b, [e.name for e in manager.pool]))
    finally:
        url.killed.set()  # ends its stuck call's thread
    (b1, engines1), (b2, engines2) = steps
    # step 1 finished on the other engine; the hung one then left the sync and the rollouts
    assert b1.metrics["rollout/engines_hung"] == 1 and b1.metrics["rollout/engines_lost"] == 1
    assert log.index("actor.drop_engines") < log.index("sync1")
    assert engines2 == ["healthy"] and manager.pool.lost == {"url"} and manager.pool.down == {}
    assert b2.metrics["rollout/engines_lost"] == 1 and b2.metrics["rollout/engines_hung"] == 0
    assert url.calls == 2 and b2.num_groups == 8


def test_transports_stop_sending_to_dropped_engines(tmp_path):
    from megatron_dapo.sync.sglang_transports import (
        EngineEndpoint,
        SGLangDiskTransport,
        SGLangNCCLTransport,
    )

    eps = [EngineEndpoint(n, f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(["a", "b", "c"])]
    disk = SGLangDiskTransport(eps, tmp_path, 10.0)
    disk.drop({"b"})
    # each reloader still addresses its own server after the renumbering
    assert [(n, r.calls.endpoints[r.index].name) for n, r in disk.engines] == [("a", "a"), ("c", "c")]
    nccl = SGLangNCCLTransport(eps, 10.0, backend="gloo")
    group = nccl.group_name
    nccl.drop({"a"})
    assert nccl.names == "b,c" and nccl.group_name != group  # a new, smaller group at the next sync
