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
no episode columns); test_one_step_off.py checks the schedule's staleness on the single-turn demo."""

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
    # TIS with a cap the stale tokens rarely reach: the correction weight is a resumed metric too
    "algorithm.rollout_correction.mode": "tis",
    "algorithm.rollout_correction.threshold": 4.0,
}


@pytest.fixture(scope="module")
def reference(calculator_assets, tmp_path_factory):
    runs = tmp_path_factory.mktemp("agent_async")
    train_to_end(train_overrides(calculator_assets, runs, "ref", STEPS, **AHEAD), CONFIG)
    return runs / "ref"


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
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/rollout_corr_weight_max",
        "train/prompts_consumed",
    ):
        assert [r[key] for r in got] == [r[key] for r in ref], key
    assert all(r["rollout/multiturn/prefix_breaks"] == 0 for r in got)
