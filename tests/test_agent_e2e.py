"""Multi-turn tool episodes through the whole stack, generated ahead and interrupted: the calculator
demo's episodes at async K=2 (the engines two batches ahead, on their own devices), through Ray, 2
Megatron ranks, the HF engine and the calculator's tool processes. Without rollout.partial: with
it the weight version of a prefetched token depends on when the sync's pause lands (README), so no
two runs are equal to the bit; an episode paused mid-turn and continued is tested exactly in
test_agent_partial.py.

SIGKILLed after step 2, whose checkpoint carries the batches generated ahead (steps 3 and 4, from
the initial weights and step 1's: episodes with their loss masks and turns in carried.safetensors),
and resumed: the run equals the uninterrupted one, weights bit for bit, and every step's metrics
(tool calls per episode and the TIS weights included). Without the carried batches in the
checkpoint the resumed steps would generate anew with step 2's weights and differ. This is also
the single-turn SIGKILL-at-async-K=2 test (a single-turn batch is carried by the same code, with
no episode columns), and the async K=2 schedule's staleness test (the same code for both too)."""

from __future__ import annotations

import json
import os
import signal

import pytest
from e2e_harness import DAPO_ON, REPO, read_metrics, start_and_wait_for_step, train_overrides, train_to_end
from safetensors.torch import load_file

from megatron_dapo.driver.run_state import CARRIED_FILE, read_carried
from megatron_dapo.rollout.types import EpisodeInfo, RolloutBatch

TOOLS = str(REPO / "configs" / "tools" / "calculator.yaml")
CONFIG = REPO / "configs" / "demo_calculator.yaml"
STEPS = 4
AHEAD = {
    **DAPO_ON,
    "rollout.multi_turn.tool_config_path": TOOLS,
    "trainer.mode": "async",
    "trainer.max_staleness": 2,
    "trainer.placement": "disaggregated",
    "trainer.val_before_train": "false",
    "trainer.test_freq": 0,
    "logging.plots_at_end": "false",
    "rollout.dump_rollouts": "true",
    # TIS with a cap the stale tokens rarely reach: the correction weight exp(pi_old - rollout)
    # shows in the step metrics, and is a resumed metric too
    "algorithm.rollout_correction.mode": "tis",
    "algorithm.rollout_correction.threshold": 4.0,
}


@pytest.fixture(scope="module")
def reference(calculator_assets, tmp_path_factory):
    runs = tmp_path_factory.mktemp("agent_async")
    train_to_end(train_overrides(calculator_assets, runs, "ref", STEPS, **AHEAD), CONFIG)
    return runs / "ref"


def test_no_token_is_more_than_two_versions_behind(reference):
    """The async K=2 schedule: step k trains on what the weights of version max(k-3, 0) generated
    (the initial ones for steps 1-3), every token of an episode included."""
    records = read_metrics(reference)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        rows = [json.loads(line) for line in (reference / "rollouts" / f"step_{r['step']}.jsonl").open()]
        assert rows and {row["weight_version"] for row in rows} == {max(r["step"] - 3, 0)}, r["step"]
        lag = float(min(r["step"] - 1, 2))  # the actor trains step k with version k-1
        for key in ("token_mean", "token_max", "sample_mean", "sample_max"):
            assert r[f"rollout/staleness_{key}"] == lag, (r["step"], key)
        assert r["timing/actor_wait_data_s"] >= 0 and r["timing/engine_wait_weights_s"] >= 0
    # step 1 is on-policy: the actor's pi_old reproduces the rollout's log-probs of the sampled
    # tokens and the correction weight exp(pi_old - rollout) is 1 on every one of them
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


def test_episodes_ahead_killed_and_resumed_equal_the_uninterrupted_run(
    calculator_assets, reference, tmp_path
):
    args = train_overrides(
        calculator_assets, tmp_path, "killed", STEPS, **AHEAD, **{"trainer.resume": "auto"}
    )
    run = tmp_path / "killed"
    proc = start_and_wait_for_step(args, run / "metrics.jsonl", 2, CONFIG)  # held after step 2
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    ckpt = run / "checkpoints" / "step_00000002"
    assert (run / "checkpoints" / "latest").read_text().strip() == ckpt.name
    carried = [b for b in read_carried(ckpt / CARRIED_FILE) if isinstance(b, RolloutBatch)]
    assert [{v for s in b.samples for v in s.token_versions} for b in carried] == [{0}, {1}]
    episodes = [s for b in carried for s in b.samples]
    assert all(s.episode is not None and s.loss_mask is not None for s in episodes)
    calls = [EpisodeInfo.from_dict(s.episode) for s in episodes if 0 in s.loss_mask]
    assert calls and all(e.turns[1].role == "tool" for e in calls)  # tool answers ride along

    train_to_end(args, CONFIG)
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == 2
    # Each episode goes on its own, so which later turns share the engine's decode steps depends
    # on when their tools answered; the HF engine's responses do not depend on their batch mates
    # (its frame), so the resumed run is the uninterrupted one bit for bit.
    a = load_file(str(reference / "hf" / f"step_{STEPS}" / "model.safetensors"))
    b = load_file(str(run / "hf" / f"step_{STEPS}" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), f"{name} differs after resume"
    ref, got = read_metrics(reference), read_metrics(run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for key in (
        "rollout/reward/mean",
        "rollout/multiturn/tool_calls_mean",
        "rollout/multiturn/env_tokens_mean",
        "rollout/staleness_token_mean",
        "rollout/response_length/mean",
        "train/prompts_consumed",
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/rollout_corr_weight_max",
    ):
        assert [r[key] for r in got] == [r[key] for r in ref], key
    # the token check (requests against the episode's ids, the episode against the template's
    # rendering of its conversation) ran on every episode and found nothing
    assert all(r["rollout/multiturn/prefix_breaks"] == 0 for r in got)
    assert all(r["rollout/multiturn/rerender_mismatches"] == 0 for r in got)
