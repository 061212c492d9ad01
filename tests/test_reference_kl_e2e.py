"""The reference-policy KL through the whole stack (Ray, 2 Megatron ranks at TP=2, the HF engine,
the weight sync), as a loss term and as a reward penalty with the adaptive controller at once,
and through a SIGKILL and resume.

An uninterrupted 2-step run, and a run killed by SIGKILL after step 1's checkpoint and resumed:
the resumed run must end with the same weights bit for bit and the same metrics. That holds only
if the resume restores the controller's coefficient (it moved at step 1) and builds the reference
from the initial weights, not from the checkpoint it resumes (the actor's, one step further).
"""

from __future__ import annotations

import json
import os
import signal

import pytest
from e2e_harness import DAPO_ON, read_metrics, start_and_wait_for_step, train_overrides, train_to_end
from safetensors.torch import load_file

STEPS = 2
KL_ON = {
    **DAPO_ON,
    "trainer.val_before_train": "false",
    "trainer.test_freq": 0,
    "logging.plots_at_end": "false",
    "actor.use_kl_loss": "true",
    "actor.kl_loss_coef": 0.1,
    "actor.kl_loss_type": "low_var_kl",
    "algorithm.use_kl_in_reward": "true",
    "algorithm.kl_penalty": "kl",
    # adaptive, a horizon of one step's 16 responses: the coefficient moves by up to 20% a step
    "algorithm.kl_ctrl.type": "adaptive",
    "algorithm.kl_ctrl.kl_coef": 0.05,
    "algorithm.kl_ctrl.target_kl": 1e-6,
    "algorithm.kl_ctrl.horizon": 16,
    "trainer.resume": "auto",
}


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory):
    runs = tmp_path_factory.mktemp("kl_runs")
    train_to_end(train_overrides(assets, runs, "kl", STEPS, **KL_ON))
    return runs / "kl"


def test_kl_metrics_and_the_controller(uninterrupted):
    first, second = read_metrics(uninterrupted)
    assert [first["step"], second["step"]] == [1, 2]
    # step 1: the actor is the reference, so the KL is 0 in the loss and in the reward
    assert abs(first["actor/ref_kl"]) < 1e-6 and abs(first["actor/kl_loss"]) < 1e-6
    assert abs(first["actor/reward_kl_penalty"]) < 1e-6
    assert first["actor/reward_kl_penalty_coeff"] == 0.05
    # KL 0 is below the target: the coefficient shrank by the clipped 20% (16 responses / 16)
    assert second["actor/reward_kl_penalty_coeff"] == pytest.approx(0.05 * 0.8, rel=1e-12)
    # step 2: the actor moved away from the reference
    assert second["actor/ref_kl"] > 0 and second["actor/kl_loss"] > 0
    assert second["actor/reward_kl_penalty"] != 0.0


def test_sigkill_and_resume_keep_the_reference_and_the_controller(assets, uninterrupted, tmp_path):
    args = train_overrides(assets, tmp_path, "kl", STEPS, **KL_ON)
    run = tmp_path / "kl"
    proc = start_and_wait_for_step(args, run / "metrics.jsonl", 1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000001"

    train_to_end(args)
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == 1
    want, got = read_metrics(uninterrupted), read_metrics(run)
    assert [r["step"] for r in got] == [1, 2]
    for key in (
        "actor/reward_kl_penalty_coeff",
        "actor/reward_kl_penalty",
        "actor/ref_kl",
        "actor/kl_loss",
        "actor/pg_loss",
        "actor/grad_norm",
    ):
        assert [r[key] for r in got] == [r[key] for r in want], key
    a = load_file(str(uninterrupted / "hf" / f"step_{STEPS}" / "model.safetensors"))
    b = load_file(str(run / "hf" / f"step_{STEPS}" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), f"{name} differs after resume"
