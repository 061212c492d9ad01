"""trainer.mode=one_step_off/async: the engines generate the next steps' batches while the actor trains.

The promise (issue 13), end to end with the real stack (Ray, 2 Megatron ranks, the HF engine) at
async K=2, one_step_off's schedule K batches deep (test_async.py checks K=1 = one_step_off's
schedule with stand-ins): every token of step k's batch comes from the weights of version
max(k-3, 0), so staleness is 0 at step 1 and reaches exactly 2 at step 3; the loss takes the
rollout's log-probs as the behaviour policy; colocated placement refuses both modes. That a
checkpoint carries the batches generated ahead (carried.safetensors), so that SIGKILL + resume at
async K=2 equals the uninterrupted run, is test_agent_e2e.py's (tool episodes, the same code).
"""

from __future__ import annotations

import json

import pytest
from e2e_harness import DAPO_ON, read_metrics, train_overrides, train_to_end
from trainer_fakes import FakeDataset, FakeManager, FakeRanks, fake_sample, make_trainer, trainer_config

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.driver.stop import StopFlag
from megatron_dapo.rollout.manager import RolloutAbandoned
from megatron_dapo.rollout.types import RolloutBatch

STEPS = 4
ASYNC_K2 = {
    **DAPO_ON,
    "trainer.mode": "async",
    "trainer.max_staleness": 2,
    "trainer.placement": "disaggregated",
    "trainer.val_before_train": "false",
    "trainer.test_freq": 0,
    "logging.plots_at_end": "false",
    "rollout.dump_rollouts": "true",
    # TIS with a cap the stale tokens rarely reach: the correction weight exp(pi_old - rollout)
    # is then visible in the step metrics
    "algorithm.rollout_correction.mode": "tis",
    "algorithm.rollout_correction.threshold": 4.0,
}


def test_one_step_off_needs_engines_on_their_own_devices():
    base = ["model.path=/nonexistent", "trainer.mode=one_step_off"]
    with pytest.raises(ConfigError, match="trainer.mode=one_step_off") as e:
        load_config(None, base)  # placement defaults to colocated
    assert "trainer.placement=disaggregated" in str(e.value) and "\n" not in str(e.value)
    assert load_config(None, [*base, "trainer.placement=disaggregated"]).trainer.mode == "one_step_off"


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """An uninterrupted 4-step async K=2 run (dynamic sampling on)."""
    runs = tmp_path_factory.mktemp("async_runs")
    train_to_end(train_overrides(assets, runs, "ref", STEPS, **ASYNC_K2))
    return runs / "ref"


def test_no_token_is_more_than_two_versions_behind(reference):
    records = read_metrics(reference)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        # the rollout dump records the engine's weight version per sample: step k trains on
        # what the weights of version max(k-3, 0) generated (the initial ones for steps 1-3)
        rows = [json.loads(line) for line in (reference / "rollouts" / f"step_{r['step']}.jsonl").open()]
        assert rows and {row["weight_version"] for row in rows} == {max(r["step"] - 3, 0)}, r["step"]
        lag = float(min(r["step"] - 1, 2))  # the actor trains step k with version k-1
        for key in ("token_mean", "token_max", "sample_mean", "sample_max"):
            assert r[f"rollout/staleness_{key}"] == lag, (r["step"], key)
        assert r["timing/actor_wait_data_s"] >= 0 and r["timing/engine_wait_weights_s"] >= 0
    # step 1 is on-policy: the actor's pi_old reproduces the rollout's log-probs and the
    # correction weight exp(pi_old - rollout) is 1 on every token
    first = records[0]
    assert first["actor/rollout_logprob_abs_diff"] < 1e-4
    assert first["actor/rollout_corr_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert first["actor/rollout_corr_weight_min"] == pytest.approx(1.0, abs=1e-4)
    # from step 2 the behaviour log-probs are the stale rollout's, not the actor's: the loss's
    # correction weights move off 1 by as much as the two policies differ
    for r in records[1:]:
        assert r["actor/rollout_logprob_abs_diff"] > 1e-3, r["step"]
        spread = r["actor/rollout_corr_weight_max"] - r["actor/rollout_corr_weight_min"]
        assert spread > 1e-3, (r["step"], spread)


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
