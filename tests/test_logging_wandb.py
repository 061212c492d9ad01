"""Logging that survives a stop: the W&B run id is kept in the run directory, so a run stopped by
SIGTERM and resumed (or requeued) logs to the same W&B run, and a fresh start to a new one; the
entity, group and tags reach W&B; TensorBoard asked for but not installed is said once. W&B runs
offline here (its files under the run directory), with the step loop's stand-in ranks."""

from __future__ import annotations

import logging
import re
import sys

from test_trainer_stop_resume import StoppingManager
from trainer_fakes import FakeDataset, FakeRanks, make_trainer, trainer_config

from megatron_dapo.actor.checkpoint import write_manifest
from megatron_dapo.driver.run_dir import WANDB_ID, MetricsLogger, RunDir
from megatron_dapo.driver.stop import StopFlag

WANDB = {
    "logging.wandb": "true",
    "logging.wandb_mode": "offline",
    "logging.wandb_entity": "lab",
    "logging.wandb_group": "ablation-1",
    "logging.wandb_tags": "[dapo,32b]",
}


def _offline_ids(run: RunDir) -> list[str]:
    """The run ids of the offline W&B runs under the run directory, oldest first. A folder is
    ``offline-run-DATE_TIME-ID``, with ``-N`` after it when a run of the same id started in the
    same second (a quick resume); runs of one second are ordered by when each was last written
    (they run one after another), not by name."""
    folders = sorted((run.root / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime_ns)
    return [re.match(r"offline-run-\d{8}_\d{6}-([^-]+)", p.name).group(1) for p in folders]


class ResumingRanks(FakeRanks):
    def call(self, method, *args, **kwargs):
        if method == "load_checkpoint":
            self.calls.append((method, args))
            return [{"step": 3, "weight_version": 3, "data_cursor": {"index": 12}}]
        return super().call(method, *args, **kwargs)


def _stopped_run(cfg, ranks):
    """A run that finished step 3 and is stopped by SIGTERM during step 4's rollout."""
    stop = StopFlag()
    trainer = make_trainer(cfg, ranks, StoppingManager(stop), FakeDataset(), stop)
    trainer.state.step = trainer.state.weight_version = 3
    summary = trainer.fit()
    assert summary["stopped_by"] == "SIGTERM"
    return trainer


def test_a_run_stopped_by_sigterm_and_resumed_logs_to_the_same_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = _stopped_run(trainer_config(tmp_path, **{"trainer.resume": "never", **WANDB}), FakeRanks())
    run = first.run
    checkpoint = run.checkpoints / "step_00000003"
    write_manifest(checkpoint)  # as the real ranks finish a save
    kept = (run.root / WANDB_ID).read_text().strip()
    assert _offline_ids(run) == [kept]
    # the requeued job: trainer.resume=auto finds the checkpoint and continues the same W&B run
    ranks = ResumingRanks()
    _stopped_run(trainer_config(tmp_path, **{"trainer.resume": "auto", **WANDB}), ranks)
    assert [a for m, a in ranks.calls if m == "load_checkpoint"] == [
        (str(checkpoint), str(checkpoint), False)
    ]
    assert _offline_ids(run) == [kept, kept]
    # starting over is another training run: another W&B run
    _stopped_run(trainer_config(tmp_path, **{"trainer.resume": "never", **WANDB}), FakeRanks())
    ids = _offline_ids(run)
    assert len(ids) == 3 and ids[2] != kept and (run.root / WANDB_ID).read_text().strip() == ids[2]


def test_entity_group_and_tags_reach_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = RunDir.create(tmp_path, "r")
    logger = MetricsLogger(
        run,
        wandb_cfg={"enable": True, "mode": "offline", "project": "p", "name": "r", "entity": "lab",
                   "group": "ablation-1", "tags": ["dapo", "32b"]},
    )  # fmt: skip
    try:
        assert logger._wandb.group == "ablation-1"
        assert tuple(logger._wandb.tags) == ("dapo", "32b")
        assert logger._wandb.id == (run.root / WANDB_ID).read_text().strip()
    finally:
        logger.close()


def test_tensorboard_asked_for_but_absent_is_said_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as when absent
    run = RunDir.create(tmp_path, "r")
    with caplog.at_level(logging.WARNING):
        logger = MetricsLogger(run, tensorboard=True)
        logger.log(1, {"x": 1.0})
        logger.log(2, {"x": 2.0})
    said = [r.getMessage() for r in caplog.records if "tensorboard" in r.getMessage()]
    assert len(said) == 1 and "pip install tensorboard, or set logging.tensorboard=false" in said[0]
    assert run.metrics.read_text().count("\n") == 2
