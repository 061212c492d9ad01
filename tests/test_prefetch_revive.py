"""Issue 13 (an engine that dies mid-round): in one_step_off / async mode, every engine dying while
the next batches are prefetched does not end the run when this run launched them.

The real rollout manager and PromptDataset, scripted engines (rollout_fakes) that die when they
are handed a "doomed" prompt until their server is restarted, stand-in ranks (no Ray, no
Megatron). Reference for what is trained: the dataset's shuffled order for its seed, computed
here from NumPy's RandomState (as data/dataset.py documents), 4 prompts a step, each once.
"""

from __future__ import annotations

import json
import logging
import threading

import numpy as np
import pytest
from rollout_fakes import MIXED, Scorer, ScriptedEngine, Tokenizer, manager_config
from trainer_fakes import FakeRanks, trainer_config

from megatron_dapo.data.dataset import PromptDataset
from megatron_dapo.driver.run_dir import RunDir
from megatron_dapo.driver.stop import StopFlag
from megatron_dapo.driver.trainer import DAPOTrainer
from megatron_dapo.rollout.manager import NoEngineAliveError, RolloutManager
from megatron_dapo.rollout.partial import CarriedGroup
from megatron_dapo.rollout.types import GenerationResult

PROMPTS, SEED, STEPS, BATCH = 40, 7, 5, 4
ORDER = [int(i) for i in np.random.RandomState(SEED).permutation(PROMPTS)]  # epoch 0's order


class PromptTokenizer:
    """'prompt i' -> [MIXED, 7, i]: the scripted engine reads the class and the prompt's index."""

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[MIXED, 7, int(t.split()[1])] for t in texts]}


def dataset():
    rows = [
        {
            "index": i,
            "data_source": "scripted",
            "messages": [{"role": "user", "content": f"prompt {i}"}],
            "ground_truth": "right",
            "extra_info": {},
        }
        for i in range(PROMPTS)
    ]
    return PromptDataset(rows, PromptTokenizer(), max_prompt_length=8, apply_chat_template=False, seed=SEED)


class World:
    """What the engines share: the prompts that kill an engine handed them (until a restart).

    ``when``: "before_sync": the actor's first update ends only once the rollout failed (the
    step's sync then restarts the engines); "after_sync" (rollout.partial): a doomed call waits
    for the sync's pause, and the engines die once the paused rollout resumes after the sync."""

    def __init__(self, doomed, when="before_sync"):
        self.doomed = set(doomed)
        self.when = when
        self.manager = None
        self.carried_at_death = None  # rollout.partial: the manager's tail when the engines died
        self.failed = threading.Event()  # a rollout raised NoEngineAliveError
        self.pausing = False
        self.paused = threading.Event()  # the sync's pause aborted the engines' calls

    def watch(self, manager):
        self.manager = manager
        collect, pause = manager.collect, manager.pause

        def watched_collect(dataset, version):
            try:
                return collect(dataset, version)
            except NoEngineAliveError:
                self.failed.set()
                raise

        def watched_pause(timeout_s):
            self.pausing = True
            return pause(timeout_s)

        manager.collect, manager.pause = watched_collect, watched_pause


class Engine(ScriptedEngine):
    """Dies (its process gone, health False) when handed a doomed prompt; its server's restart
    brings it back and disarms the doom. ``server=None``: a server given by URL."""

    def __init__(self, name, world, restartable=True):
        super().__init__(name)
        self.world = world
        self.version = 0  # set by the weight sync
        self.restarts = 0
        self.server = self if restartable else None

    def generate(self, requests, on_result=None):
        w = self.world
        if w.doomed & {r.prompt_ids[2] for r in requests}:
            if w.when == "after_sync" and not w.paused.is_set():
                assert w.paused.wait(60), "the sync never paused the rollout"
                return [GenerationResult(r.request_id, [], [], "abort", self.version) for r in requests]
            if w.carried_at_death is None and w.manager is not None:
                w.carried_at_death = w.manager.partial_groups()
            self._alive = False
        return super().generate(requests, on_result)

    def abort(self):
        super().abort()
        if self.world.pausing:
            self.world.paused.set()

    # the server this run launched (EnginePool.restart_down)
    def alive(self):
        return self._alive

    def restart(self):
        self.restarts += 1
        self._alive = True
        self.world.doomed.clear()


class Ranks(FakeRanks):
    def __init__(self, world):
        super().__init__()
        self.world = world

    def call(self, method, *args, **kwargs):
        out = super().call(method, *args, **kwargs)
        if method != "train_step":
            return out
        if self.world.when == "before_sync" and self.world.doomed:  # the first update, with the doom armed
            assert self.world.failed.wait(60), "the prefetch never failed"
        return [{}]


def run(tmp_path, mode, k, doomed, partial=False, restartable=True, when="before_sync"):
    cfg = trainer_config(
        tmp_path,
        **{
            "trainer.placement": "disaggregated",
            "trainer.mode": mode,
            "trainer.max_staleness": k,
            "trainer.total_steps": STEPS,
            "trainer.resume": "never",
            "trainer.save_freq": 0,
            "rollout.partial": str(partial).lower(),
        },
    )
    world = World(doomed, when)
    engines = [Engine(f"e{i}", world, restartable) for i in range(2)]
    # rollout.partial: 6 drawn a round, the 4 first in draw order train, 2 are carried
    mcfg = manager_config(
        n=2, train_batch_size=BATCH, gen_batch_size=BATCH + 2 if partial else BATCH, partial=partial
    )
    manager = RolloutManager(engines, Scorer(), mcfg, Tokenizer())
    world.watch(manager)

    def sync(version):
        for e in engines:
            e.version = version
        return {}

    trained = {}  # step -> its samples

    def dump(rollout, path):
        trained[int(path.stem.split("_")[1])] = list(rollout.samples)

    trainer = DAPOTrainer(
        cfg,
        run=RunDir.create(cfg.trainer.runs_dir, cfg.trainer.run_name),
        ranks=Ranks(world),
        manager=manager,
        dataset=dataset(),
        transport_sync=sync,
        stop=StopFlag(),
        dump_rollouts=dump,
    )
    summary = trainer.fit()
    metrics = {r["step"]: r for r in map(json.loads, trainer.run.metrics.read_text().splitlines())}
    return summary, trained, metrics, engines, world


def prompts(samples):
    """The prompt indices of a step's groups, in batch order."""
    return list(dict.fromkeys(s.prompt.index for s in sorted(samples, key=lambda s: s.group_id)))


def versions(samples):
    return {v for s in samples for v in s.token_versions}


def test_one_step_off_survives_every_engine_dying_during_the_prefetch(tmp_path, caplog):
    """Both engines die on batch 2's prompts while the actor trains step 1: batch 2 is drawn
    again at step 2 with the weights of version 1 (restarted and synced once), and the run
    trains every prompt of the dataset's order exactly once."""
    caplog.set_level(logging.WARNING)
    summary, trained, metrics, engines, _ = run(tmp_path, "one_step_off", 1, ORDER[4:8])
    assert summary["step"] == STEPS
    assert [prompts(trained[s]) for s in range(1, STEPS + 1)] == [
        ORDER[i : i + BATCH] for i in range(0, STEPS * BATCH, BATCH)
    ]
    assert [e.restarts for e in engines] == [1, 1]
    # batch 2 came from the restarted engines with the new weights (staleness 0, not 1); the
    # pipeline then runs one ahead again
    assert [versions(trained[s]) for s in range(1, STEPS + 1)] == [{0}, {1}, {1}, {2}, {3}]
    assert [metrics[s]["rollout/prefetch_redrawn"] for s in range(1, STEPS + 1)] == [1, 0, 0, 0, 0]
    lines = [r.getMessage() for r in caplog.records if "drawn again" in r.getMessage()]
    assert len(lines) == 1 and "step 1: every engine was lost" in lines[0], lines
    assert "for steps 2-2 are drawn again" in lines[0] and "all 2 engines are down" in lines[0]


@pytest.mark.parametrize(
    "partial, when", [(False, "before_sync"), (True, "before_sync"), (True, "after_sync")]
)
def test_async_k2_keeps_the_finished_batch_and_redraws_the_one_that_failed(tmp_path, partial, when):
    """Step 1 prefetches batches 2 and 3; batch 2 finishes, the engines die on batch 3's new
    prompts. Batch 2 is kept (trained at step 2 as generated, version 0); batch 3 goes back and
    is generated again at step 2's prefetch with version 1. With rollout.partial the two groups
    batch 2 left past its cut (carried into batch 3) come back as they were: step 3 trains them
    with the responses the tail held, continued, not regenerated. ``after_sync``: the prefetch
    was paused for step 1's sync and lost its engines once resumed; they are restarted and given
    version 1 right then, so step 2's prefetch finds them serving (one restart, one redraw)."""
    new_of_batch_3 = ORDER[10:14] if partial else ORDER[8:12]
    summary, trained, metrics, engines, world = run(
        tmp_path, "async", 2, new_of_batch_3, partial=partial, when=when
    )
    assert summary["step"] == STEPS
    assert [prompts(trained[s]) for s in range(1, STEPS + 1)] == [
        ORDER[i : i + BATCH] for i in range(0, STEPS * BATCH, BATCH)
    ]
    assert [e.restarts for e in engines] == [1, 1]
    assert [metrics[s]["rollout/prefetch_redrawn"] for s in range(1, STEPS + 1)] == [1, 0, 0, 0, 0]
    # the finished batch, kept: generated with version 0 (rollout.partial: paused for step 1's
    # sync, its unfinished responses continued with version 1)
    assert 0 in versions(trained[2]) and versions(trained[2]) <= ({0, 1} if partial else {0})
    # batch 3's new prompts: generated again after the restart, never with version 0
    fresh = [s for s in trained[3] if s.prompt.index in new_of_batch_3]
    assert fresh and 0 not in versions(fresh)
    if partial:
        carried = world.carried_at_death
        assert [g.prompt.index for g in carried] == ORDER[8:10]
        for g in carried:  # each response continues from the tokens the tail held, as they were
            got = [
                s
                for s in sorted(trained[3], key=lambda s: s.response_ids)
                if s.prompt.index == g.prompt.index
            ]
            want = sorted(g.samples, key=lambda s: s.output_ids)
            assert len(got) == len(want) == 2
            for x, c in zip(got, want):
                assert x.response_ids[: len(c.output_ids)] == c.output_ids
                assert x.token_versions[: len(c.output_ids)] == c.token_versions


def test_engines_given_by_url_end_the_run_with_the_rollouts_error(tmp_path):
    """No down engine can be restarted: the rollout's own error ends the run, once."""
    with pytest.raises(NoEngineAliveError, match=r"^rollout: all 2 engines are down \(") as e:
        run(tmp_path, "one_step_off", 1, ORDER[4:8], restartable=False)
    assert "e0: e0 is gone" in str(e.value) and "e1: e1 is gone" in str(e.value)
    assert "\n" not in str(e.value)


class ChangingManager:
    """Draws 4 prompts a batch, observes a keep rate and replaces its carried tail on every batch;
    the second batch changes all three, then loses every engine."""

    def __init__(self, data):
        self.data = data
        self.keep_rate, self.carry, self.calls = 0.5, [self._tail(0)], 0

    def _tail(self, batch: int) -> CarriedGroup:
        """The carried tail after ``batch``: one group, of the dataset's prompt at that position."""
        return CarriedGroup(self.data[batch], [])

    def state_dict(self):
        return {"keep_rate": self.keep_rate}

    def load_state_dict(self, state):
        self.keep_rate = state["keep_rate"]

    def partial_groups(self):
        return list(self.carry)

    def load_partial_groups(self, groups):
        self.carry = list(groups)

    def collect(self, dataset, version):
        self.calls += 1
        drawn = [p.index for p in dataset.next_batch(BATCH)]
        self.keep_rate, self.carry = 0.1 * self.calls, [self._tail(self.calls)]
        if self.calls == 2:
            raise NoEngineAliveError("rollout: all 2 engines are down (e0: gone; e1: gone)")
        return drawn


def test_a_prefetch_that_lost_its_engines_keeps_the_finished_batch_and_rewinds_the_rest():
    """Prefetch of 3 batches, the 2nd fails: the 1st is kept; the data cursor, the manager's state
    and its carried tail are back to where the 1st batch left them, so the next draw is the 2nd
    batch's prompts."""
    from megatron_dapo.driver.pipeline import Prefetch

    data = dataset()
    manager = ChangingManager(data)
    prefetch = Prefetch(manager, data, version=0, count=3)
    with pytest.raises(NoEngineAliveError):
        prefetch.result()
    assert prefetch.keep_finished() == [ORDER[0:4]] and len(prefetch.starts) == 1
    assert manager.calls == 2 and manager.state_dict() == {"keep_rate": 0.1}
    assert manager.carry == [manager._tail(1)]
    assert [p.index for p in data.next_batch(BATCH)] == ORDER[4:8]
