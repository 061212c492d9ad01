"""trainer.mode=one_step_off/async with stand-in ranks and manager: colocated placement refuses both
modes, and a SIGTERM during the prefetch saves the finished step without the abandoned prefetch.

The schedule end to end with the real stack (Ray, 2 Megatron ranks, the HF engine) at async K=2 is
test_agent_e2e.py's, on tool episodes (the same code as single-turn responses): every token of
step k's batch from the weights of version max(k-3, 0), staleness 0 at step 1 and exactly 2 from
step 3, the rollout's log-probs as the behaviour policy, and the batches generated ahead carried
by a checkpoint through SIGKILL and resume. test_async.py checks K=1 (one_step_off) with stand-ins.
"""

from __future__ import annotations

import pytest
from trainer_fakes import FakeDataset, FakeManager, FakeRanks, fake_sample, make_trainer, trainer_config

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.driver.stop import StopFlag
from megatron_dapo.rollout.manager import RolloutAbandoned
from megatron_dapo.rollout.types import RolloutBatch

# trainer.mode=async K=2 as the end-to-end tests run it
ASYNC_K2 = {
    "trainer.mode": "async",
    "trainer.max_staleness": 2,
    "trainer.placement": "disaggregated",
    "trainer.val_before_train": "false",
    "trainer.test_freq": 0,
}


def test_one_step_off_needs_engines_on_their_own_devices():
    base = ["model.path=/nonexistent", "trainer.mode=one_step_off"]
    with pytest.raises(ConfigError, match="trainer.mode=one_step_off") as e:
        load_config(None, base)  # placement defaults to colocated
    assert "trainer.placement=disaggregated" in str(e.value) and "\n" not in str(e.value)
    assert load_config(None, [*base, "trainer.placement=disaggregated"]).trainer.mode == "one_step_off"


# ---------------------------------------------------------------- stand-in ranks (no Ray)
class TrainingRanks(FakeRanks):
    def call(self, method, *args, **kwargs):
        out = super().call(method, *args, **kwargs)
        return [{}] if method == "train_step" else out


class SigtermInPrefetch(FakeManager):
    """Step 1's rollout comes back; the prefetch of step 2 draws its prompts, then the run finds
    itself stopping (a SIGTERM while the actor trains step 1)."""

    def __init__(self, stop: StopFlag):
        super().__init__()
        self.stop = stop
        self.keep_rate = 0.5
        self.versions: list[int] = []

    def state_dict(self):
        return {"keep_rate": self.keep_rate}

    def load_state_dict(self, state):
        self.keep_rate = state["keep_rate"]

    def collect(self, dataset, version):
        self.versions.append(version)
        dataset.next_batch(4)
        if len(self.versions) == 1:
            samples = [
                fake_sample(g, j, [version, version], prompt_ids=[1, 2], logprobs=[-0.5, -1.25])
                for g in range(4)
                for j in range(2)
            ]
            return RolloutBatch(samples, {"rollout/prompts_drawn": 4})
        self.keep_rate = 0.1  # the abandoned round's observation must not be kept
        self.stop.set("SIGTERM")
        assert self.should_stop()
        raise RolloutAbandoned("stopping")


def test_sigterm_during_the_prefetch_saves_the_finished_step_without_it(tmp_path):
    cfg = trainer_config(
        tmp_path,
        **{
            "trainer.resume": "never",
            **{k: v for k, v in ASYNC_K2.items() if "." in k},
            "trainer.mode": "one_step_off",
        },
    )
    stop = StopFlag()
    ranks, dataset, manager = TrainingRanks(), FakeDataset(), SigtermInPrefetch(stop)
    summary = make_trainer(cfg, ranks, manager, dataset, stop).fit()
    assert manager.versions == [0, 0], "step 2's rollout must start with the weights step 1 trained on"
    assert [m for m, _ in ranks.calls if m == "train_step"] == ["train_step"]  # step 1 finished
    saves = [a for m, a in ranks.calls if m == "save_checkpoint"]
    assert len(saves) == 1
    _root, step, state, _ = saves[0]
    assert step == 1 and summary["stopped_by"] == "SIGTERM" and summary["step"] == 1
    assert state["data_cursor"] == {"index": 4}, "the abandoned prefetch's prompts must be drawn again"
    assert state["manager_state"] == {"keep_rate": 0.5}
    assert state["carried"] == {} and "prefetched" not in state
