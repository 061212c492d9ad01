"""Fit checks, the fixes the planner proposes (applied and re-planned), step tokens/time, the CLI."""

import math
from pathlib import Path

import pytest

from megatron_dapo.cli import main
from megatron_dapo.config import load_config
from megatron_dapo.plan import Assumptions, gpu_for, inputs_from_config, make_plan, resolve_model_shape
from megatron_dapo.plan.throughput import StepTokens, step_tokens, time_split

RECIPE = str(Path(__file__).resolve().parents[1] / "configs" / "dapo_qwen2.5_32b.yaml")


def _plan(*overrides, path=RECIPE, gpu="h100", mem=None):
    cfg = load_config(path, list(overrides))
    return make_plan(inputs_from_config(cfg), resolve_model_shape(cfg.model.path), gpu_for(gpu, mem))


def _failing(plan):
    return [c for c in plan.checks if not c.ok]


def test_the_32b_recipe_fits_on_128_h100():
    plan = _plan()
    assert plan.fits, _failing(plan)
    assert plan.roles.total_gpus == 128 and plan.inputs.dp == 8
    assert plan.total_params == 32_763_876_352


def test_a_layout_that_does_not_fit_gets_a_fix_that_fits():
    # 32B with no model parallelism: ~590 GiB of weights/grads/optimizer state per GPU alone.
    bad = (
        "parallel.tensor_model_parallel_size=1",
        "parallel.pipeline_model_parallel_size=1",
        "parallel.sequence_parallel=false",
    )
    plan = _plan(*bad)
    assert not plan.fits
    actor = next(c for c in plan.checks if c.role == "actor" and not c.ok)
    assert actor.fix and any(f.startswith("parallel.tensor_model_parallel_size=") for f in actor.fix)
    fixed = _plan(*bad, *actor.fix)
    assert fixed.actor_peak.total <= 80 * 1024**3 - 1024**3
    assert all(c.ok for c in fixed.checks if c.role == "actor")


def test_lower_memory_gpu_needs_recompute_or_more_pipeline():
    plan = _plan(mem=48)
    fixes = [c.fix for c in _failing(plan) if c.fix]
    assert fixes
    assert _plan(*fixes[0], mem=48).actor_peak.total <= 47 * 1024**3


def test_micro_batch_budget_below_one_sequence_is_flagged():
    plan = _plan("actor.micro_batch_max_tokens=16384")
    check = next(c for c in _failing(plan) if "micro-batch budget" in c.what)
    assert check.fix == ["actor.micro_batch_max_tokens=22528"]


def test_engine_count_must_cover_the_rollout_gpus():
    plan = _plan("rollout.num_engines=16")
    check = next(c for c in _failing(plan) if "num_engines" in c.what)
    assert check.fix == ["rollout.num_engines=32"]


def test_colocated_generation_phase_counts_the_resident_actor():
    # PP=1 doubles the resident state (~26 GiB); with SGLang at 0.7 of 80 GiB it no longer fits.
    plan = _plan("parallel.pipeline_model_parallel_size=1")
    check = next(c for c in _failing(plan) if c.role == "colocated")
    assert check.fix == ["rollout.sglang.mem_fraction_static=0.60"]
    assert _plan("parallel.pipeline_model_parallel_size=1", *check.fix).fits


def test_disaggregated_roles_split_the_gpus():
    plan = _plan(
        "trainer.placement=disaggregated",
        "trainer.rollout_gpus=64",
        "parallel.actor_world_size=64",
        "rollout.num_engines=16",
    )
    assert (plan.roles.actor_gpus, plan.roles.rollout_gpus, plan.roles.total_gpus) == (64, 64, 128)
    assert plan.inputs.dp == 4
    assert plan.rollout_phase_bytes is None


def test_step_tokens_with_dynamic_sampling_rounds():
    t = step_tokens(512, 16, 1536, True, 10, keep_rate=0.5, mean_prompt=200, mean_response=5000)
    assert (t.gen_rounds, t.generated_prompts) == (1, 1536)
    assert t.decode_tokens == 1536 * 16 * 5000 and t.train_tokens == 512 * 16 * 5200
    t = step_tokens(512, 16, 1536, True, 10, keep_rate=0.2, mean_prompt=200, mean_response=5000)
    assert t.gen_rounds == math.ceil(512 / (1536 * 0.2)) == 2
    assert step_tokens(512, 16, 1536, True, 1, 0.01, 200, 5000).gen_rounds == 1  # budget caps rounds
    assert step_tokens(512, 16, 1536, False, 10, 0.5, 200, 5000).generated_prompts == 512


# A step of 1e6 decode and 2e5 train tokens on 10 + 10 GPUs, with round numbers.
STEP = StepTokens(1, 10, 100, decode_tokens=1e6, train_sequences=100, train_tokens=2e5)
SPLIT_ARGS = dict(
    fwd_flops_per_token=1e9,
    ppo_epochs=1,
    recompute=True,
    rollout_gpus=10,
    actor_gpus=10,
    decode_tok_s_per_gpu=1000,
    peak_tflops=1000,
    mfu=0.5,
)


def test_time_split_by_hand():
    t = STEP
    s = time_split(t, **SPLIT_ARGS)
    assert s.rollout_s == 1e6 / (1000 * 10)
    # old log-probs (1 fwd) + fwd/bwd (3) + recompute (1) = 5 forwards.
    assert s.train_flops == 2e5 * 1e9 * 5
    assert s.train_s == pytest.approx(1e15 / (10 * 1e15 * 0.5))
    assert s.rollout_fraction == pytest.approx(100 / 100.2)
    # a reference model adds its own forward (its log-probs): 6 forwards
    assert time_split(t, **SPLIT_ARGS, reference=True).train_flops == 2e5 * 1e9 * 6


def test_assumptions_are_stated_and_flags_change_them(capsys):
    assert main(["plan", RECIPE, "--mean-response-frac", "0.5", "--mfu", "0.4"]) == 0
    out = capsys.readouterr().out
    assert "32,763,876,352" in out and "10240 tokens" in out and "0.4" in out
    for name in ("mean prompt length", "decode throughput", "training MFU", "keep rate"):
        assert name in out


def test_cli_exit_codes(capsys):
    assert (
        main(
            [
                "plan",
                RECIPE,
                "parallel.tensor_model_parallel_size=2",
                "parallel.pipeline_model_parallel_size=1",
            ]
        )
        == 1
    )
    assert "does not fit" in capsys.readouterr().out
    assert main(["plan", RECIPE, "--gpu", "b300"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
    assert main(["plan", RECIPE, "--keep-rate", "0"]) == 2
    assert main(["plan", RECIPE, "--gpu", "h200"]) == 0
    assert "H200" in capsys.readouterr().out


def test_assumption_defaults_scale_with_the_config():
    plan = _plan("data.max_response_length=8192", "algorithm.overlong_buffer.len=2048")
    assert dict((k, v) for k, v, _ in plan.assumptions)["mean response length"] == "2048 tokens"
    assert Assumptions().keep_rate == 0.5


def test_time_model_overlaps_rollout_and_training_in_the_pipelined_modes():
    """one_step_off/async on their own GPUs: a step takes max(rollout, train), by hand; the same
    config colocated (or sync) adds the two up."""
    t, kw = STEP, SPLIT_ARGS
    s = time_split(t, **kw, overlapped=True)
    assert s.step_s == max(100.0, 0.2) == 100.0
    assert s.rollout_fraction == pytest.approx(100 / 100.2)
    assert time_split(t, **kw).step_s == pytest.approx(100.2)
    base = ("trainer.placement=disaggregated", "trainer.rollout_gpus=32")
    plans = {m: _plan(*base, f"trainer.mode={m}") for m in ("sync", "one_step_off", "async")}
    r, tr = plans["sync"].times.rollout_s, plans["sync"].times.train_s
    assert plans["sync"].times.step_s == pytest.approx(r + tr)
    for m in ("one_step_off", "async"):
        assert plans[m].times.step_s == pytest.approx(max(r, tr)), m
