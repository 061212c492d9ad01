"""An engine that dies mid-rollout: the step finishes on the other engine with nothing lost, then
the dead engine is restarted and gets the new weights before the manager gives it work again.

The step loop is the real `DAPOTrainer` and `RolloutManager`; the engines are the scripted ones of
test_rollout_manager with a supervised "server" that can be restarted; the actor ranks are fakes.
"""

from __future__ import annotations

from rollout_fakes import MIXED, Dataset, Scorer, ScriptedEngine, Tokenizer, accounted, manager_config
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

    def generate(self, requests):
        out = super().generate(requests)
        self.served_versions.append(self.version)
        return out

    def health(self, check_process=True):
        return self._alive


class Data(Dataset):
    def state_dict(self):
        return {"cursor": self.cursor}

    def load_state_dict(self, d):
        self.cursor = d["cursor"]


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
    steps = []
    collect = manager.collect

    def collect_and_check(dataset, version):
        batch = collect(dataset, version)
        steps.append((dict(batch.metrics), set(manager.down), list(dying.served)))
        return batch

    manager.collect = collect_and_check

    def sync(version):
        for e in (dying, healthy):
            if not e._alive:  # what a real transport does with a dead server
                raise ConnectionError(f"weight sync: {e.name} is gone")
            e.version = version
        log.append(f"sync{version} down={sorted(manager.down)}")
        return {}

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
    ranks = LoggingRanks(log)
    DAPOTrainer(
        conf,
        run=RunDir.create(tmp_path, "r"),
        ranks=ranks,
        manager=manager,
        dataset=Data([MIXED]),
        transport_sync=sync,
    ).fit()

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
