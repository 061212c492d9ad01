"""Issue 13: the async mode's pieces, each tested against an independent reference."""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from trainer_fakes import FakeDataset, FakeManager, FakeRanks, fake_sample, trainer_config

from megatron_dapo.actor.checkpoint import MANIFEST, CheckpointError, verify_checkpoint, write_manifest
from megatron_dapo.algo import RolloutCorrection, policy_loss
from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.driver.run_dir import RunDir
from megatron_dapo.driver.run_state import CARRIED_FILE, read_carried
from megatron_dapo.driver.stop import StopFlag
from megatron_dapo.driver.trainer import DAPOTrainer
from megatron_dapo.rollout.staleness import drop_stale_groups
from megatron_dapo.rollout.types import RolloutBatch, RolloutSample


def test_algorithm_tis_is_deprecated_for_rollout_correction_tis():
    """tis.enable warns once, in one line naming the replacement; the replacement is the same
    loss and gradient, bit for bit, on realistic log-prob gaps (|log rho| well below the clamp)."""
    with pytest.warns(FutureWarning, match=r"algorithm\.rollout_correction\.mode=tis") as rec:
        load_config(None, ["model.path=/nonexistent", "algorithm.tis.enable=true", "algorithm.tis.cap=1.5"])
    assert len(rec) == 1 and "\n" not in str(rec[0].message)
    assert "threshold=1.5" in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["model.path=/nonexistent", "algorithm.rollout_correction.mode=tis"])

    g = torch.Generator().manual_seed(0)
    shape = (4, 9)
    lp = (-torch.rand(shape, generator=g) * 3).requires_grad_(True)
    old = lp.detach() + 0.3 * torch.randn(shape, generator=g)
    rollout = old + 0.8 * torch.randn(shape, generator=g)  # some weights above the cap
    adv = torch.randn(shape[0], generator=g)
    mask = torch.rand(shape, generator=g) > 0.2
    common = dict(
        clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean", rollout_logprobs=rollout
    )
    loss_a, m_a = policy_loss(lp, old, adv, mask, tis_cap=1.5, **common)
    (grad_a,) = torch.autograd.grad(loss_a, lp)
    rc = RolloutCorrection(mode="tis", level="token", threshold=1.5)
    loss_b, m_b = policy_loss(lp, old, adv, mask, rollout_correction=rc, **common)
    (grad_b,) = torch.autograd.grad(loss_b, lp)
    assert float(m_a["tis_clipfrac"]) > 0  # the cap is hit, so the comparison covers truncation
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert torch.equal(m_a["tis_clipfrac"], m_b["rc_fraction"])


# ---------------------------------------------------------------- async with stand-ins (no Ray)
ASYNC = {"trainer.placement": "disaggregated", "trainer.save_freq": 1}


class Engine:
    """The weights the engine really holds, set only by the weight sync: the versions the samples
    carry come from here, not from the version the trainer passes to `collect`."""

    def __init__(self):
        self.version = 0
        self.generating = False
        self.syncs: list[int] = []

    def sync(self, version):
        assert not self.generating, "a weight sync changed the weights in the middle of a rollout"
        self.syncs.append(version)
        self.version = version
        return {}


class EngineManager(FakeManager):
    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.calls = 0

    def collect(self, dataset, version):
        self.engine.generating = True
        try:
            self.calls += 1
            drawn = dataset.next_batch(4)
            v = self.engine.version
            samples = [
                fake_sample(g, j, [v, v], prompt_index=p) for g, p in enumerate(drawn) for j in range(2)
            ]
            return RolloutBatch(samples, {"rollout/prompts_drawn": 4})
        finally:
            self.engine.generating = False


class CheckpointingRanks(FakeRanks):
    """Saves the trainer state the driver hands over (with a manifest, so resume=auto accepts it)
    and loads it back; train_step answers like a rank."""

    def call(self, method, *args, **kwargs):
        if method == "load_checkpoint":
            return [json.loads((Path(args[0]) / "state.json").read_text())]
        out = super().call(method, *args, **kwargs)
        if method == "save_checkpoint":
            write_manifest(Path(out[0]))
        return [{}] if method == "train_step" else out


def _positions(samples: list[RolloutSample]) -> list[int]:
    """The dataset positions of a step's prompts, in order (each prompt once per group)."""
    return list(dict.fromkeys(s.prompt.index for s in samples))


def _drawn(*steps: int) -> list[int]:
    """The positions the ``steps``-th batches drawn hold (4 prompts each, in order)."""
    return [p for s in steps for p in range(4 * (s - 1), 4 * s)]


def _run(tmp_path, name, stop_after=None, **over):
    cfg = trainer_config(tmp_path, **{**ASYNC, "trainer.run_name": name, **over})
    engine, dataset, stop = Engine(), FakeDataset(), StopFlag()
    trained: dict[int, list[RolloutSample]] = {}

    def dump(rollout, path):  # called once per trained step, with the samples it trained on
        step = int(Path(path).stem.split("_")[1])
        trained[step] = list(rollout.samples)
        if step == stop_after:
            stop.set("SIGTERM")

    run = RunDir.create(cfg.trainer.runs_dir, name)
    manager = EngineManager(engine)
    trainer = DAPOTrainer(
        cfg,
        run=run,
        ranks=CheckpointingRanks(),
        manager=manager,
        dataset=dataset,
        transport_sync=engine.sync,
        stop=stop,
        dump_rollouts=dump,
    )
    trainer.fit()
    metrics = {r["step"]: r for r in map(json.loads, run.metrics.read_text().splitlines())}
    return trained, metrics, manager, dataset


@pytest.mark.parametrize(
    "mode, k, versions",
    [
        # batch j comes from the weights of version max(j-1-K, 0)
        ("async", 2, [0, 0, 0, 1, 2]),
        ("async", 1, [0, 0, 1, 2, 3]),
        ("one_step_off", 1, [0, 0, 1, 2, 3]),  # async K=1 is one_step_off's schedule
    ],
)
def test_async_never_trains_a_token_more_than_k_versions_behind(tmp_path, mode, k, versions):
    trained, metrics, manager, dataset = _run(
        tmp_path, "r", **{"trainer.mode": mode, "trainer.max_staleness": k}
    )
    assert sorted(trained) == [1, 2, 3, 4, 5]
    for step, samples in trained.items():
        actor_version = step - 1  # the actor trains step k with the weights of k-1 updates
        held = {v for s in samples for v in s.token_versions}
        assert held == {versions[step - 1]}, step
        assert _positions(samples) == _drawn(step), step  # the step's own batch, not another of its version
        lag = actor_version - min(held)
        assert lag <= k, (step, lag)
        assert metrics[step]["rollout/staleness_token_max"] == lag
        assert metrics[step]["rollout/stale_dropped_samples"] == 0
    # the pipeline really runs K ahead (the bound is reached), and no batch past the run is drawn
    assert max(s - 1 - versions[s - 1] for s in trained) == k
    assert manager.calls == 5 and dataset.index == 20


def test_a_resume_with_a_smaller_bound_drops_the_carried_groups_beyond_it(tmp_path):
    """Stopped after step 2 with K=3: the checkpoint carries the batches of steps 3-5 (versions
    0, 0, 1). Resumed with K=1 (actor version 2 at step 3): the two version-0 batches are too
    stale and are dropped and counted; step 3 trains the version-1 batch."""
    _run(tmp_path, "r", stop_after=2, **{"trainer.mode": "async", "trainer.max_staleness": 3})
    carried = read_carried(tmp_path / "r" / "checkpoints" / "step_00000002" / CARRIED_FILE)
    assert [{v for s in b.samples for v in s.token_versions} for b in carried] == [{0}, {0}, {1}]
    trained, metrics, manager, _ = _run(
        tmp_path, "r", **{"trainer.mode": "async", "trainer.max_staleness": 1, "trainer.resume": "auto"}
    )
    assert sorted(trained) == [3, 4, 5]
    assert {v for s in trained[3] for v in s.token_versions} == {1}
    assert _positions(trained[3]) == _drawn(5)  # the carried batch of step 5; 3 and 4 dropped
    assert _positions(trained[4]) + _positions(trained[5]) == _drawn(6, 7)  # then the cursor goes on
    assert metrics[3]["rollout/stale_dropped_samples"] == 16
    for step, samples in trained.items():
        assert (step - 1) - min(v for s in samples for v in s.token_versions) <= 1, step


def test_drop_stale_groups_judges_a_sample_by_its_oldest_token_and_drops_whole_groups():
    samples = [
        fake_sample(0, 0, [3, 3]),
        fake_sample(0, 1, [1, 3]),
        fake_sample(1, 0, [2, 3]),
        fake_sample(1, 1, [3]),
    ]
    kept, dropped = drop_stale_groups(samples, actor_version=3, max_staleness=1)
    assert [s.group_id for s in kept] == [1, 1] and dropped == 2
    assert drop_stale_groups(samples, actor_version=3, max_staleness=2) == (samples, 0)


def test_async_mode_needs_its_own_devices_and_a_positive_bound():
    base = ["model.path=/nonexistent", "trainer.mode=async"]
    with pytest.raises(ConfigError, match="trainer.placement=disaggregated") as e:
        load_config(None, base)
    assert "trainer.mode=async" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="trainer.max_staleness=0 must be >= 1"):
        load_config(None, [*base, "trainer.placement=disaggregated", "trainer.max_staleness=0"])
    cfg = load_config(None, [*base, "trainer.placement=disaggregated", "trainer.max_staleness=2"])
    assert cfg.trainer.max_staleness == 2


def test_a_one_step_off_checkpoint_of_the_one_batch_form_still_resumes():
    """Checkpoints written before the queue held one batch as {'samples', 'metrics'}."""
    from megatron_dapo.driver.run_state import queue_from_state

    old = {"samples": [asdict(fake_sample(0, 1, [4, 4]))], "metrics": {"rollout/prompts_drawn": 1}}
    (batch,) = queue_from_state(old)
    assert batch.samples == [fake_sample(0, 1, [4, 4])] and batch.metrics == {"rollout/prompts_drawn": 1}
    queue = {"batches": [old, old]}  # the form before carried.safetensors
    assert queue_from_state(queue) == [batch, batch] and queue_from_state({}) == []


# ---------------------------------------------------------------- the carried file
K2 = {"trainer.mode": "async", "trainer.max_staleness": 2}


@pytest.fixture
def stopped_k2(tmp_path):
    """An uninterrupted 5-step async K=2 run, and run "r" stopped after step 2: its checkpoints
    of steps 1 and 2 each carry the two batches generated ahead (steps 2-3 and 3-4)."""
    reference, _, _, _ = _run(tmp_path, "ref", **K2)
    _run(tmp_path, "r", stop_after=2, **K2)
    return reference, tmp_path / "r" / "checkpoints"


def _resume(tmp_path, name="r", **over):
    trained, _, _, dataset = _run(tmp_path, name, **{**K2, "trainer.resume": "auto", **over})
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    return trained, dataset, summary


def test_the_carried_batches_are_a_checkpoint_file_and_resume_exactly(stopped_k2, tmp_path):
    reference, ckpts = stopped_k2
    ckpt = ckpts / "step_00000002"
    state = json.loads((ckpt / "state.json").read_text())
    assert "prefetched" not in state and state["carried"]["items"] == 2
    assert state["carried"]["starts"] == [
        {"data_cursor": {"index": 8}, "manager_state": None},  # before step 3's prompts
        {"data_cursor": {"index": 12}, "manager_state": None},
    ]
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert CARRIED_FILE in files and not (ckpts / ".carried.staging").exists()
    carried = read_carried(ckpt / CARRIED_FILE)
    assert [b.samples for b in carried] == [reference[3], reference[4]]  # what the steps train
    trained, dataset, summary = _resume(tmp_path)
    assert summary["resumed_from"] == 2 and sorted(trained) == [3, 4, 5]
    for step in trained:
        assert trained[step] == reference[step], step
    assert dataset.index == 20  # no prompt drawn twice


def test_a_torn_carried_file_rejects_its_checkpoint_naming_it(stopped_k2, tmp_path, caplog):
    reference, ckpts = stopped_k2
    victim = ckpts / "step_00000002" / CARRIED_FILE
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(victim.parent)
    assert f"{victim} is truncated" in str(e.value) and "\n" not in str(e.value)
    trained, _, summary = _resume(tmp_path)  # auto falls back to step 1, whose batches are whole
    assert summary["resumed_from"] == 1 and "skipping checkpoint step_00000002" in caplog.text
    assert trained == {s: reference[s] for s in (2, 3, 4, 5)}


def test_a_checkpoint_with_the_batches_in_its_trainer_state_json_still_resumes(stopped_k2, tmp_path):
    """The form before carried.safetensors: `prefetched` in the trainer state, the dataclasses
    as dicts (what `asdict` gave), no carried file."""
    reference, ckpts = stopped_k2
    ckpt = ckpts / "step_00000002"
    state = json.loads((ckpt / "state.json").read_text())
    batches = read_carried(ckpt / CARRIED_FILE)
    del state["carried"]
    state["prefetched"] = {
        "batches": [{"samples": [asdict(s) for s in b.samples], "metrics": b.metrics} for b in batches]
    }
    (ckpt / "state.json").write_text(json.dumps(state))
    (ckpt / CARRIED_FILE).unlink()
    write_manifest(ckpt)
    trained, dataset, summary = _resume(tmp_path)
    assert summary["resumed_from"] == 2
    assert trained == {s: reference[s] for s in (3, 4, 5)} and dataset.index == 20


def test_drop_carried_on_resume_draws_their_prompts_again_with_the_resumed_weights(stopped_k2, tmp_path):
    """The two carried batches (versions 0 and 1) are dropped; the cursor goes back to before
    step 3's prompts (index 8), so steps 3-5 draw 12 prompts, all generated with version 2, the
    weights the checkpoint holds; the same for any resume of that checkpoint."""
    runs = []
    for name in ("a", "b"):
        shutil.copytree(tmp_path / "r", tmp_path / name)
        trained, dataset, summary = _resume(tmp_path, name, **{"trainer.drop_carried_on_resume": "true"})
        assert summary["resumed_from"] == 2 and summary["dropped_carried_batches"] == 2
        assert {s: {v for x in trained[s] for v in x.token_versions} for s in trained} == {
            3: {2},
            4: {2},
            5: {2},
        }
        assert {s: _positions(trained[s]) for s in trained} == {s: _drawn(s) for s in (3, 4, 5)}
        assert dataset.index == 20
        runs.append(trained)
    assert runs[0] == runs[1]
