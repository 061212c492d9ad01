"""The step loop's stop and resume decisions, with stand-in ranks, data and rollouts (no Ray,
no Megatron): a stop during rollout checkpoints the last finished step with the data cursor of
that step; checkpoints that are all bad stop the run before any rank loads anything, naming
each; `trainer.resume=never` keeps the old metrics.jsonl beside the new one."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from trainer_fakes import (
    EmptyDataState,
    FakeDataset,
    FakeManager,
    FakeRanks,
    Log,
    OneGroupManager,
    make_trainer,
    trainer_config,
)

from megatron_dapo.actor.checkpoint import MANIFEST, NoUsableCheckpointError
from megatron_dapo.driver.run_dir import RunDir
from megatron_dapo.driver.stop import StopFlag
from megatron_dapo.driver.trainer import DAPOTrainer
from megatron_dapo.rollout.manager import RolloutAbandoned


class StoppingManager(FakeManager):
    """Draws prompts, then finds the run stopping mid-rollout (as a SIGTERM would arrive)."""

    def __init__(self, stop: StopFlag):
        super().__init__()
        self.stop = stop
        self.keep_rate = 0.5

    def state_dict(self):
        return {"keep_rate": self.keep_rate}

    def load_state_dict(self, state):
        self.keep_rate = state["keep_rate"]

    def collect(self, dataset, version):
        dataset.next_batch(8)
        self.keep_rate = 0.1  # the abandoned round's observation must not be kept
        self.stop.set("SIGTERM")
        assert self.should_stop(), "the trainer must hand the manager its stop flag"
        raise RolloutAbandoned("stopping")


def test_stop_during_rollout_checkpoints_the_last_finished_step(tmp_path):
    cfg = trainer_config(tmp_path, **{"trainer.resume": "never"})
    stop = StopFlag()
    ranks, dataset = FakeRanks(), FakeDataset()
    trainer = make_trainer(cfg, ranks, StoppingManager(stop), dataset, stop)
    # as after a finished step 3 whose checkpoint is not due (save_freq 20)
    trainer.state.step = trainer.state.weight_version = 3
    dataset.index = 12
    summary = trainer.fit()
    saves = [a for m, a in ranks.calls if m == "save_checkpoint"]
    assert len(saves) == 1
    _root, step, state, _ = saves[0]
    assert step == 3
    assert state["data_cursor"] == {"index": 12}, "the abandoned step's prompts must be drawn again on resume"
    assert state["manager_state"] == {"keep_rate": 0.5}
    assert not [m for m, _ in ranks.calls if m == "train_step"]
    assert summary["stopped_by"] == "SIGTERM" and summary["step"] == 3


def test_stop_before_any_step_saves_nothing(tmp_path):
    cfg = trainer_config(tmp_path, **{"trainer.resume": "never"})
    stop = StopFlag()
    ranks = FakeRanks()
    make_trainer(cfg, ranks, StoppingManager(stop), FakeDataset(), stop).fit()
    assert not [m for m, _ in ranks.calls if m == "save_checkpoint"]


def _bad_checkpoints(root: Path) -> None:
    (root / "step_00000001").mkdir(parents=True)  # a save that died before its manifest
    bad = root / "step_00000002"
    bad.mkdir()
    (bad / "common.pt").write_bytes(b"x" * 10)
    (bad / MANIFEST).write_text(json.dumps({"files": {"common.pt": {"size": 99, "crc32": 0}}}))
    (root / "latest").write_text("step_00000002\n")


def test_only_bad_checkpoints_stop_the_run_before_any_rank_loads(tmp_path):
    cfg = trainer_config(tmp_path)
    run = RunDir.create(tmp_path, "r")
    _bad_checkpoints(run.checkpoints)
    history = '{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n'
    run.metrics.write_text(history)
    ranks = FakeRanks()
    trainer = make_trainer(cfg, ranks, StoppingManager(StopFlag()), FakeDataset(), StopFlag())
    with pytest.raises(NoUsableCheckpointError) as err:
        trainer.fit()
    message = str(err.value)
    assert "\n" not in message
    assert "step_00000001" in message and "incomplete" in message
    assert "step_00000002" in message and "truncated" in message
    assert "trainer.resume=never" in message
    assert ranks.calls == [], "no rank may load anything when the driver found nothing to resume"
    assert run.metrics.read_text() == history, "the run's history must survive"


def test_resume_never_keeps_the_old_metrics_aside(tmp_path):
    cfg = trainer_config(tmp_path, **{"trainer.resume": "never"})
    run = RunDir.create(tmp_path, "r")
    _bad_checkpoints(run.checkpoints)
    run.metrics.write_text('{"step": 1}\n')
    stop = StopFlag()
    make_trainer(cfg, FakeRanks(), StoppingManager(stop), FakeDataset(), stop).fit()
    assert (run.root / "metrics.1.jsonl").read_text() == '{"step": 1}\n'
    assert not run.metrics.exists() or run.metrics.read_text() == ""


def test_driver_chooses_a_good_checkpoint_and_ranks_load_exactly_it(tmp_path):
    from megatron_dapo.actor.checkpoint import write_manifest

    cfg = trainer_config(tmp_path)
    run = RunDir.create(tmp_path, "r")
    _bad_checkpoints(run.checkpoints)
    good = run.checkpoints / "step_00000001"
    (good / "common.pt").write_bytes(b"ok")
    write_manifest(good)

    class Ranks(FakeRanks):
        def call(self, method, *args, **kwargs):
            if method == "load_checkpoint":
                self.calls.append((method, args))
                return [{"step": 1, "weight_version": 1, "data_cursor": {"index": 4}}]
            return super().call(method, *args, **kwargs)

    ranks, dataset, stop = Ranks(), FakeDataset(), StopFlag()
    trainer = make_trainer(cfg, ranks, StoppingManager(stop), dataset, stop)
    trainer.fit()
    loads = [a for m, a in ranks.calls if m == "load_checkpoint"]
    assert loads == [(str(good), str(good), False)]
    assert trainer.state.step == 1


_WATCHDOG = """
import sys, time
from megatron_dapo.driver.stop import StopFlag
window = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
stop = StopFlag(float(sys.argv[1]), lambda: "resume from step_7", duplicate_window_s=window).install()
print("ready", flush=True)
if sys.stdin.readline().strip() == "done":  # a step that finishes when told to
    print("still here", flush=True)
    sys.exit(0)
while True:  # a step that never finishes
    time.sleep(0.05)
"""


def _watchdog_process(*args):
    return subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_stop_that_cannot_finish_exits_within_the_timeout(tmp_path):
    proc = _watchdog_process("2")
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate("\n", timeout=60)
    assert proc.returncode == 1
    assert "trainer.stop_timeout_s=2" in err and "resume from step_7" in err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_exits_at_once(tmp_path, sig):
    """SIGINT (Ctrl-C) is a stop like SIGTERM: a line, no KeyboardInterrupt; the second one exits."""
    proc = _watchdog_process("600", "0.5")
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(sig)
    first = proc.stderr.readline()
    assert f"{sig.name} received" in first
    # the first signal's time is taken before its line is printed: past the window for sure
    time.sleep(0.6)
    proc.send_signal(sig)
    _, err = proc.communicate("\n", timeout=60)
    assert proc.returncode == 128 + sig
    assert f"second {sig.name}" in err and "KeyboardInterrupt" not in err


def test_the_same_signal_delivered_twice_at_once_is_one_stop(tmp_path):
    """Slurm signals every process of the job and torchrun's agent forwards the signal to its
    workers again: one preemption, two SIGTERMs within milliseconds. The checkpoint must still
    be written, so the repeat does not count as the user insisting."""
    proc = _watchdog_process("600")
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert "SIGTERM received" in proc.stderr.readline()
    proc.send_signal(signal.SIGTERM)
    # the repeat is pending before "done" arrives, so its handler runs before the read returns
    out, err = proc.communicate("done\n", timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == "still here"
    assert "second" not in err


def test_signal_blocked_while_starting_children_does_not_reach_them():
    """What keeps Ray's daemons and workers alive through the group's SIGTERM."""
    from megatron_dapo.driver.stop import blocked_signals

    echo = "import sys\nfor line in sys.stdin:\n    print('alive', flush=True)"
    with blocked_signals():
        child = subprocess.Popen(
            [sys.executable, "-c", echo], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            child.send_signal(sig)
            child.stdin.write("ping\n")
            child.stdin.flush()
            # a pending signal is delivered before the read returns: a child it reached is gone
            assert child.stdout.readline().strip() == "alive", sig.name
    finally:
        child.kill()
        child.wait(timeout=30)


class _Killed(BaseException):
    """Stands for a SIGKILL: nothing after it runs, no handler sees it."""


class _CheckpointingRanks(FakeRanks):
    """Saves what the driver hands over (with a manifest, so resume=auto accepts it) and loads it back."""

    def call(self, method, *args, **kwargs):
        from megatron_dapo.actor.checkpoint import write_manifest

        if method == "load_checkpoint":
            return [json.loads((Path(args[0]) / "state.json").read_text())]
        if method == "train_step":
            return [{"loss": 0.5, "grad_norm": 2.0}]
        out = super().call(method, *args, **kwargs)
        if method == "save_checkpoint":
            write_manifest(Path(out[0]))
        return out


def _run_steps(tmp_path, name, *, kill_in_validation_at=None, resume="never"):
    cfg = trainer_config(
        tmp_path,
        **{
            "trainer.run_name": name,
            "trainer.total_steps": 3,
            "trainer.save_freq": 1,
            "trainer.test_freq": 2,
            "trainer.resume": resume,
            "trainer.train_batch_size": 1,
            "rollout.gen_batch_size": 1,
            "actor.ppo_mini_batch_size": 1,
        },
    )

    def validate(step):
        if step == kill_in_validation_at:
            raise _Killed
        return {"val/avg@4": step / 10}

    run = RunDir.create(tmp_path, name)
    trainer = DAPOTrainer(
        cfg,
        run=run,
        ranks=_CheckpointingRanks(),
        manager=OneGroupManager(Log()),
        dataset=EmptyDataState(),
        transport_sync=lambda v: {},
        validate=validate,
    )
    with contextlib.suppress(_Killed):
        trainer.fit()
    return [json.loads(line) for line in run.metrics.read_text().splitlines()]


def _untimed(record):
    return {k: v for k, v in record.items() if not k.startswith("timing/")}


def test_a_kill_between_the_checkpoint_and_the_metrics_line_loses_no_line(tmp_path):
    """Step 2 is checkpointed, then the run dies in step 2's validation, before its metrics line.
    The resume continues at step 3, and must still write step 2's line (from the checkpoint, with
    the validation step 2 was due), so the file equals an uninterrupted run's."""
    reference = _run_steps(tmp_path, "reference")
    killed = _run_steps(tmp_path, "killed", kill_in_validation_at=2)
    assert [r["step"] for r in killed] == [1], "the kill must land before step 2's line"
    resumed = _run_steps(tmp_path, "killed", resume="auto")
    assert [r["step"] for r in resumed] == [1, 2, 3], "a step's metrics line was lost or repeated"
    assert [_untimed(r) for r in resumed] == [_untimed(r) for r in reference]
    assert resumed[1]["val/avg@4"] == 0.2


class _KLRanks(_CheckpointingRanks):
    """Ranks whose pi_old and reference log-probs put the batch's KL far above the adaptive
    controller's target, so its coefficient grows by the clipped factor every step."""

    def call(self, method, *args, **kwargs):
        if method == "score_old_and_ref":
            batch = args[0]
            shape = (len(batch), batch.max_response_len)
            return [(torch.full(shape, -0.1), torch.full(shape, -0.9))]
        return super().call(method, *args, **kwargs)


class _StopAtStep3(OneGroupManager):
    def __init__(self, log, stop, stop_at):
        super().__init__(log)
        self.stop, self.stop_at, self.calls = stop, stop_at, 0

    def collect(self, dataset, version):
        self.calls += 1
        if self.calls == self.stop_at:
            self.stop.set("SIGTERM")
            raise RolloutAbandoned("stopping")
        return super().collect(dataset, version)


def test_stop_during_rollout_saves_the_kl_controller_of_the_last_step(tmp_path):
    """A SIGTERM during step 3's rollout checkpoints step 2 (save_freq is far away); the adaptive
    controller's coefficient of that checkpoint is the one after step 2's update, and the resumed
    step 3 uses it. Before, only DAPOTrainer.save copied the controller into the state, so this
    path saved {} and the resume started again from kl_coef."""
    over = {
        "trainer.save_freq": 100,
        "actor.ppo_mini_batch_size": 1,
        "algorithm.use_kl_in_reward": "true",
        "algorithm.kl_ctrl.type": "adaptive",
        "algorithm.kl_ctrl.kl_coef": 0.05,
        "algorithm.kl_ctrl.target_kl": 1e-4,
        "algorithm.kl_ctrl.horizon": 10,
    }
    cfg = trainer_config(tmp_path, **{"trainer.resume": "never", **over})
    stop = StopFlag()
    first = make_trainer(cfg, _KLRanks(), _StopAtStep3(Log(), stop, 3), FakeDataset(), stop)
    assert first.fit()["step"] == 2
    # KL 0.8 per token >> target: e = +0.2 each step, over the batch's 2 responses
    after_two = 0.05 * (1 + 0.2 * 2 / 10) ** 2
    saved = json.loads((first.run.checkpoints / "step_00000002" / "state.json").read_text())
    assert saved["kl_ctrl"] == {"type": "adaptive", "value": pytest.approx(after_two, rel=1e-12)}

    cfg = trainer_config(tmp_path, **{"trainer.resume": "auto", **over})
    stop = StopFlag()
    second = make_trainer(cfg, _KLRanks(), _StopAtStep3(Log(), stop, 2), FakeDataset(), stop)
    assert second.fit()["step"] == 3
    lines = [json.loads(x) for x in second.run.metrics.read_text().splitlines()]
    step3 = next(r for r in lines if r.get("train/step") == 3)
    assert step3["actor/reward_kl_penalty_coeff"] == pytest.approx(after_two, rel=1e-12)
