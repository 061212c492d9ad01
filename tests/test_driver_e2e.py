"""The trainer end to end on CPU: Ray local, 2 Megatron ranks (TP=2), the HF engine in its own
Ray actor, weight sync, the DAPO loss. Then SIGTERM and a killed rank mid-run and `resume: auto`: the
resumed run's final weights equal an uninterrupted run's bit for bit.

The uninterrupted run has the reference-policy KL on, as a loss term and as a reward penalty with
the adaptive controller at once (KL below), and its KL metrics are checked against a float64
reference built without the trainer (tests/e2e_harness.py): step 1's update by hand from its dumped rollouts (at step 1 the
actor is the reference, so the KL terms have value and gradient 0 and every ratio is 1: the
gradient is the policy loss's, ``-sum_i A_i grad log pi_i / N``) on HF transformers' model of the
initial weights, then step 2's dumped responses scored by that model before (the reference) and
after (pi_old) the update: ``actor/kl_loss`` and ``actor/ref_kl`` are the token mean of k3,
``actor/reward_kl_penalty`` the mean over responses of each one's mean k1, and the controller's
coefficient follows Ziegler et al.'s rule by hand, the one after step 2 read from step 3's metrics.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from e2e_harness import (
    DAPO_ON,
    ENV,
    GSPO,
    REPO,
    SAPO,
    Float64Policy,
    check_one_update_loss,
    outcome_advantages,
    read_metrics,
    read_rollouts,
    release,
    start_and_wait_for_step,
    token_ids,
    train_cmd,
    train_overrides,
    train_to_end,
)
from safetensors.torch import load_file

from megatron_dapo.driver.launch import load_for_cli, run_train
from megatron_dapo.driver.test_hold import HANG_ENV


def _assert_engine_matches_trainer(records: list[dict]) -> None:
    """At EVERY step the trainer (Megatron TP=2) scores the engine's samples as the engine did:
    a broken or skipped weight sync only shows from step 2 on, when the weights have changed."""
    steps = [r for r in records if r["step"] >= 1]
    assert len(steps) >= 2
    for r in steps:
        assert r["actor/rollout_logprob_abs_diff"] < 1e-4, (r["step"], r["actor/rollout_logprob_abs_diff"])
        assert abs(r["actor/rollout_k3_kl"]) < 1e-6, (r["step"], r["actor/rollout_k3_kl"])


def test_two_steps_end_to_end(assets, tmp_path):
    """Two DAPO steps with the GSPO policy loss: the vanilla loss runs in the reference run below,
    and this run's checks do not depend on the loss; step 1's pg_loss is GSPO's by hand from the
    dumped rollouts (e2e_harness.check_one_update_loss)."""
    over = {**DAPO_ON, **GSPO, "rollout.dump_rollouts": "true"}
    cfg = load_for_cli(str(REPO / "configs/demo.yaml"), train_overrides(assets, tmp_path, "e2e", 2, **over))
    summary = run_train(cfg)
    run = Path(summary["run_dir"])
    records = read_metrics(run)
    assert [r["step"] for r in records] == [0, 1, 2]  # step 0 = validation before training
    assert "val/avg@2" in records[0] and "val/avg@2" in records[2]
    first = records[1]
    for key in (
        "rollout/reward/mean",
        "rollout/acc/mean",
        "rollout/response_length/mean",
        "actor/pg_loss",
        "actor/entropy",
        "actor/grad_norm",
        "actor/pg_clipfrac",
        "timing/gen",
        "timing/update_actor",
        "timing/sync_weights",
        "sync/buckets",
    ):
        assert key in first, key
    # one mini-batch per step: pi_old is the current policy, so no clipping and no KL at step 1
    assert first["actor/ppo_kl"] == 0.0 and first["actor/pg_clipfrac"] == 0.0
    # packed micro-batches (actor.pack_sequences, the default): only CP/SP/FP8 alignment pads
    assert first["actor/padding_fraction"] == 0.0
    _assert_engine_matches_trainer(records)
    assert records[2]["rollout/gen_rounds"] >= 1 and "rollout/keep_rate" in records[2]
    for r in records[1:]:  # sync mode: every token comes from the actor's current weights
        assert r["rollout/staleness_token_max"] == 0.0 and r["rollout/staleness_sample_max"] == 0.0, r["step"]
        assert r["rollout/staleness_token_mean"] == 0.0 and r["rollout/unversioned_samples"] == 0.0, r["step"]
    assert -2.0 <= first["rollout/reward/mean"] <= 1.0 and first["actor/grad_norm"] > 0
    assert (run / "checkpoints" / "latest").is_file()
    assert (Path(summary["hf_export"]) / "config.json").is_file()
    assert (run / "plots" / "reward.png").is_file()
    check_one_update_loss(first, read_rollouts(run, 1), "gspo")


STEPS = 3
COMMON = {"trainer.val_before_train": "false", "trainer.test_freq": 0, "logging.plots_at_end": "false"}
# The reference-policy KL as a loss and as a reward penalty with the adaptive controller (a horizon
# of one step's 16 responses, so its coefficient moves by up to 20% a step), with dynamic sampling
# so every group carries a gradient. A resume that restarted the coefficient, or built the
# reference from the checkpoint it resumes instead of the initial weights, changes the resumed
# steps' losses and fails the bitwise comparison of the SIGTERM/killed-rank test. Adam's eps far above
# the gradients keeps its first step linear in them (no fp32 noise of a near-zero gradient entry
# turned into a step of ~lr, which the float64 reference could not follow); the step is large
# enough that the KL at step 2 stands well above the fp32 path's noise.
LR, EPS, WEIGHT_DECAY, CLIP_GRAD = 1e-2, 1e-2, 0.1, 1.0
COEF, TARGET_KL, HORIZON = 0.05, 1e-6, 16
KL = {
    **DAPO_ON,
    "actor.use_kl_loss": "true",
    "actor.kl_loss_coef": 0.1,
    "actor.kl_loss_type": "low_var_kl",
    "algorithm.use_kl_in_reward": "true",
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "adaptive",
    "algorithm.kl_ctrl.kl_coef": COEF,
    "algorithm.kl_ctrl.target_kl": TARGET_KL,
    "algorithm.kl_ctrl.horizon": HORIZON,
    "rollout.dump_rollouts": "true",
    "optim.lr": LR,
    "optim.adam_eps": EPS,
    "optim.weight_decay": WEIGHT_DECAY,
    "optim.clip_grad": CLIP_GRAD,
    "optim.lr_warmup_steps": 0,
}


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """An uninterrupted 3-step run with the reference KL: what every interrupted-and-resumed run
    must reproduce."""
    runs = tmp_path_factory.mktemp("ref_runs")
    train_to_end(train_overrides(assets, runs, "ref", STEPS, **COMMON, **KL))
    return runs / "ref"


def test_rollout_correction_reaches_the_loss_and_a_skipped_sync_fails_the_check(
    assets, reference, tmp_path, monkeypatch
):
    """Two checks on one 2-step run (a Ray run is the costly part of this file).

    Step 1: algorithm.rollout_correction through config, Ray and the Megatron step: TIS with cap
    0.5 truncates every token (rho ~ 1 in sync mode), so step 1 (same rollout as the reference)
    has exactly half the reference's loss and gradient (a power of two scales without rounding).
    The loss itself can be 0 (equal-length responses, advantages summing to 0 per group); the
    gradient is not.

    Step 2: the weight sync is skipped, so the engine samples from the step-0 weights while the
    trainer moved on: the engine-vs-trainer check of test_two_steps_end_to_end can fail."""
    from megatron_dapo.driver.trainer import DAPOTrainer

    fit = DAPOTrainer.fit

    def fit_without_sync(self):
        self.engines.sync = lambda version: {}
        return fit(self)

    monkeypatch.setattr(DAPOTrainer, "fit", fit_without_sync)
    over = {
        **COMMON,
        **KL,  # at step 1 the actor is the reference: the KL terms are exactly 0, as their gradients
        "trainer.save_freq": 0,
        "trainer.hf_export_at_end": "false",
        "algorithm.rollout_correction.mode": "tis",
        "algorithm.rollout_correction.threshold": 0.5,
    }
    cfg = load_for_cli(
        str(REPO / "configs/demo.yaml"), train_overrides(assets, tmp_path, "tis_nosync", 2, **over)
    )
    records = read_metrics(Path(run_train(cfg)["run_dir"]))
    got, ref = records[0], read_metrics(reference)[0]
    assert got["step"] == 1 and ref["step"] == 1
    assert got["rollout/reward/mean"] == ref["rollout/reward/mean"]
    assert got["actor/pg_loss"] == 0.5 * ref["actor/pg_loss"]
    assert ref["actor/grad_norm"] > 0
    assert got["actor/grad_norm"] == pytest.approx(0.5 * ref["actor/grad_norm"], rel=1e-6)
    assert got["actor/rollout_corr_fraction"] == pytest.approx(1.0)
    for key in ("mean", "max", "min"):
        assert got[f"actor/rollout_corr_weight_{key}"] == pytest.approx(1.0, abs=1e-4), key
    assert "actor/rollout_corr_fraction" not in ref

    assert got["actor/rollout_logprob_abs_diff"] < 1e-4  # step 1: nothing to sync yet
    with pytest.raises(AssertionError):
        _assert_engine_matches_trainer(records)


def _kl_by_hand(hf_dir, run) -> dict:
    """Step 1's gradient norm and step 2's KL metrics in float64 (module docstring)."""
    policy = Float64Policy(hf_dir)
    rows = read_rollouts(run, 1)
    adv = outcome_advantages(rows, "grpo")
    first = token_ids(hf_dir, rows)
    tokens = sum(len(response) for _, response in first)
    (sum(-a * lp.sum() for a, lp in zip(adv, policy.logprobs(first))) / tokens).backward()
    first_grad_norm = policy.grad_norm()
    second = token_ids(hf_dir, read_rollouts(run, 2))
    with torch.no_grad():
        ref = policy.logprobs(second)  # the reference: the initial weights
        policy.first_adamw_step(lr=LR, eps=EPS, weight_decay=WEIGHT_DECAY, clip_grad=CLIP_GRAD)
        old = policy.logprobs(second)  # pi_old at step 2: the actor after step 1
    d = [o - r for o, r in zip(old, ref)]  # log pi - log pi_ref per token
    k3 = torch.cat([torch.exp(-x) + x - 1 for x in d])
    return dict(
        first_grad_norm=first_grad_norm,
        k3=float(k3.mean()),
        k1_per_response=sum(float(x.mean()) for x in d) / len(d),
        k1_per_token=float(torch.cat(d).mean()),
        k3_swapped=float(torch.cat([torch.exp(x) - x - 1 for x in d]).mean()),
    )


def _adaptive(coef: float, kl: float, responses: int) -> float:
    """The adaptive controller's next coefficient (Ziegler et al. 2019, section 2.2)."""
    error = min(max(kl / TARGET_KL - 1, -0.2), 0.2)
    return coef * (1 + error * responses / HORIZON)


def test_kl_metrics_and_the_controller(assets, reference):
    first, second, third = read_metrics(reference)
    assert [first["step"], second["step"], third["step"]] == [1, 2, 3]
    # step 1: the actor is the reference, so the KL is 0 in the loss and in the reward
    assert abs(first["actor/ref_kl"]) < 1e-6 and abs(first["actor/kl_loss"]) < 1e-6
    assert abs(first["actor/reward_kl_penalty"]) < 1e-6
    assert first["actor/reward_kl_penalty_coeff"] == COEF
    # KL 0 is below the target: the coefficient shrank by the clipped 20% (16 responses / 16)
    responses = [len(read_rollouts(reference, step)) for step in (1, 2)]
    assert responses == [16, 16]
    assert second["actor/reward_kl_penalty_coeff"] == pytest.approx(0.04, rel=1e-12)
    assert _adaptive(COEF, 0.0, responses[0]) == pytest.approx(0.04, rel=1e-12)

    want = _kl_by_hand(assets.hf_dir, reference)
    # the reference's step 1 is the run's (its gradient norm to ~1e-9), and step 2's KL metrics
    # land within ~4e-6 of it; 5e-5 keeps a margin while what a slip would report, from the same
    # float64 log-probs, falls outside
    rel = 5e-5
    assert first["actor/grad_norm"] == pytest.approx(want["first_grad_norm"], rel=1e-6)
    near_misses = {"k3 with pi and pi_ref swapped": (want["k3_swapped"], want["k3"])}
    near_misses["k1 as a token mean"] = (want["k1_per_token"], want["k1_per_response"])
    for name, (miss, right) in near_misses.items():
        assert abs(miss - right) > 10 * rel * right, f"{name} ({miss}) is not told apart from {right}"
    assert second["actor/kl_loss"] == pytest.approx(want["k3"], rel=rel)  # token-mean, one update
    assert second["actor/ref_kl"] == pytest.approx(want["k3"], rel=rel)
    assert second["actor/reward_kl_penalty"] == pytest.approx(want["k1_per_response"], rel=rel)
    # the coefficient after step 2 (the KL above the target: up by the clipped 20%), the one step
    # 3 used
    after = _adaptive(0.04, want["k1_per_response"], responses[1])
    assert third["actor/reward_kl_penalty_coeff"] == pytest.approx(after, rel=1e-12)


def _assert_same_as_reference(reference: Path, run: Path) -> None:
    a = load_file(str(reference / "hf" / f"step_{STEPS}" / "model.safetensors"))
    b = load_file(str(run / "hf" / f"step_{STEPS}" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), f"{name} differs after resume"
    ref_records, res_records = read_metrics(reference), read_metrics(run)
    assert [r["step"] for r in res_records] == list(range(1, STEPS + 1)), "a step was repeated or skipped"
    for key in ("rollout/reward/mean", "actor/pg_loss", "actor/grad_norm", "train/prompts_consumed"):
        assert [r[key] for r in res_records] == [r[key] for r in ref_records], key


def _latest_checkpoint_step(run: Path) -> int | None:
    latest = run / "checkpoints" / "latest"
    return int(latest.read_text().strip().removeprefix("step_")) if latest.is_file() else None


# SIGTERM only: SIGINT takes the same handler (StopFlag.install), whose SIGINT case and the Ray
# processes' blocking of both signals are tested in test_trainer_stop_resume.py; a Ray run each
# was the cost of this file.
def test_sigterm_then_a_killed_rank_and_resumes_reproduce_the_uninterrupted_run(assets, reference, tmp_path):
    """Slurm's preemption, then a training rank killed, in one run (three Ray runs instead of
    five):

    1. SIGTERM to the whole process group (Ray's processes included) while the driver is held
       after step 1: with save_freq far away, the run must checkpoint its last finished step and
       exit 0 in bounded time, without a traceback.
    2. trainer.resume=auto continues from step 1; held after step 2 (not saved), one training rank
       is SIGKILLed by pid (as the OOM killer would): the run ends, exit 1, with one line naming
       the rank, its pid and the checkpoint a resume would use, never a hang. The newest complete
       checkpoint is still step 1's, and the step-2 record the failed run wrote is dropped by the
       next resume. (A SIGKILL of the whole run leaving checkpoint 1 intact is
       test_sglang_real_sigkill's.)
    3. trainer.resume=auto again: steps 2 and 3 once more. The weights and every step's metrics
       equal the uninterrupted run's bit for bit, the KL controller's coefficient and the
       reference model included (KL above)."""
    args = train_overrides(
        assets,
        tmp_path,
        "stopped",
        STEPS,
        **COMMON,
        **KL,
        **{"trainer.save_freq": 100, "trainer.resume": "auto"},
    )
    run = tmp_path / "stopped"
    proc = start_and_wait_for_step(args, run / "metrics.jsonl", 1)
    os.killpg(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)  # the default trainer.stop_timeout_s is 90
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert max(r["step"] for r in read_metrics(run)) == 1, "the driver was held after step 1 until the signal"
    assert _latest_checkpoint_step(run) == 1
    assert json.loads((run / "summary.json").read_text())["stopped_by"] == "SIGTERM"

    proc = start_and_wait_for_step(args, run / "metrics.jsonl", 2)
    victim = _kill_a_rank(proc)
    release(run)
    line = _the_one_failure_line(proc, timeout=300)
    assert f"pid {victim}" in line and "died" in line, line
    assert "trainer.resume=auto continues from" in line and "step_00000001" in line, line
    assert (run / "error.log").is_file()
    assert _latest_checkpoint_step(run) == 1, "step 2 was not to be saved (save_freq=100)"
    assert [r["step"] for r in read_metrics(run)] == [1, 2]

    train_to_end(args)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == 1, "the last run must continue from the newest complete checkpoint"
    _assert_same_as_reference(reference, run)
    got, ref = read_metrics(run), read_metrics(reference)
    for key in ("actor/kl_loss", "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"):
        assert [r[key] for r in got] == [r[key] for r in ref], key
    coeffs = [r["actor/reward_kl_penalty_coeff"] for r in ref]
    assert len(set(coeffs)) == STEPS, f"the controller must move every step for the check to bite: {coeffs}"


def test_eval_command_on_an_hf_checkpoint(assets, tmp_path):
    from megatron_dapo.cli import main

    out, dump = tmp_path / "eval.json", tmp_path / "responses.jsonl"
    rc = main(
        [
            "eval",
            "--hf-dir",
            str(assets.hf_dir),
            "--data",
            str(assets.val_file),
            "--template",
            "none",
            "--k",
            "4",
            "--pass-k",
            "1",
            "2",
            "--max-tokens",
            "32",
            "--limit",
            "5",
            "--out",
            str(out),
            "--dump",
            str(dump),
        ]
    )
    assert rc == 0
    m = json.loads(out.read_text())
    assert m["num_problems"] == 5 and m["samples_per_problem"] == 4
    assert 0.0 <= m["pass@1"] <= m["pass@2"] <= 1.0
    assert m["avg@4"] == pytest.approx(m["pass@1"])
    lines = [json.loads(x) for x in dump.read_text().splitlines()]
    assert len(lines) == 20
    # avg@4 is exactly the fraction of dumped responses the reward accepted
    assert m["avg@4"] == pytest.approx(sum(x["acc"] for x in lines) / 20)
    assert main(["eval", "--hf-dir", str(assets.hf_dir), "--data", str(tmp_path / "missing.parquet")]) == 2


def _kill_a_rank(proc: subprocess.Popen) -> int:
    """SIGKILL one of the run's two training ranks by pid; returns the pid."""
    import psutil

    # the rank processes descend from the driver (driver -> raylet -> worker)
    ranks = [
        p for p in psutil.Process(proc.pid).children(recursive=True) if "ActorWorker" in " ".join(_cmdline(p))
    ]
    assert len(ranks) == 2, [_cmdline(p) for p in ranks]
    victim = ranks[-1].pid
    os.kill(victim, signal.SIGKILL)
    return victim


def _the_one_failure_line(proc: subprocess.Popen, timeout: float) -> str:
    """Wait for a run that must fail: exit 1, no traceback, exactly one `failed:` line (returned)."""
    try:
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    lines = [x for x in stderr.splitlines() if x.startswith("failed:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_hung_rank_ends_the_run_with_one_line_naming_the_call(assets, tmp_path):
    """A training rank that hangs (alive, blocked) in step 2's update: the driver's wait on
    train_step is bounded by trainer.call_timeout.train_step_s, so the run ends, exit 1, with one
    line naming the call, the knob and the checkpoint a resume would use; step 1's checkpoint is
    intact. Without the bound the driver would wait on the ranks for ever. The run trains with the
    SAPO policy loss, whose step-1 pg_loss is checked by hand from the dumped rollouts
    (e2e_harness.check_one_update_loss): step 1 finishes before the hang."""
    # the test waits out the bound; step 1's calls it also bounds take well under a second here
    # (timing/update_actor 0.05 s on an idle machine), torchrun's twin test bounds them at 5 s
    over = {
        **COMMON,
        **DAPO_ON,
        **SAPO,
        "rollout.dump_rollouts": "true",
        "trainer.call_timeout.train_step_s": 8,
    }
    args = train_overrides(assets, tmp_path, "rank_hung", 3, **over)
    run = tmp_path / "rank_hung"
    proc = subprocess.Popen(
        train_cmd(args),
        env={**ENV, HANG_ENV: "1:2"},
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    line = _the_one_failure_line(proc, timeout=400)
    assert "train_step" in line and "trainer.call_timeout.train_step_s=8" in line, line
    assert "trainer.resume=auto continues from" in line and "step_00000001" in line, line
    assert _latest_checkpoint_step(run) == 1
    (first,) = read_metrics(run)
    check_one_update_loss(first, read_rollouts(run, 1), "sapo")


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except Exception:  # noqa: BLE001 - a process that just ended
        return []
