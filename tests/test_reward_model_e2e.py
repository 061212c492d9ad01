"""Rewards from a served model, end to end: two DAPO steps of the demo (Ray, 2 Megatron ranks, the
HF rollout engine) scored by a reward model the run serves itself through the real SGLang CPU
server.

- A judge (a tiny chat LM, a user verdict parser), killed with SIGKILL while it scores step 1: the
  run restarts it, the responses being scored meanwhile wait for the restart (a server the run
  supervises), the step completes with every response scored, never 0, and the restart counted.
- A classifier (a tiny random Qwen2ForSequenceClassification, no score.bias): served from the
  corrected copy, the start-up check passes, every response of both steps is scored by it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import psutil
from e2e_harness import REPO, read_metrics, train_overrides
from helpers import make_tiny_hf_checkpoint
from reward_model_fixtures import add_chat_template, make_tiny_classifier
from sglang_fixtures import require_sglang

from megatron_dapo.data.loading import load_prompt_rows
from megatron_dapo.driver.launch import load_for_cli, run_train
from megatron_dapo.rewards.served.classifier import load_tokenizer, render_ids
from megatron_dapo.rewards.served.startup_check import reference_scores

PARSER = Path(__file__).parent / "fixtures" / "reward_model" / "parsers.py"


def _dumped(run: Path, step: int) -> list[dict]:
    return [json.loads(x) for x in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def _reward_server(model_dir: Path) -> psutil.Process | None:
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "sglang.launch_server" in cmd and str(model_dir) in cmd:
            return p
    return None


def _kill_when_it_scores(log: Path, model_dir: Path, killed: list) -> None:
    """SIGKILL the judge's server (its process group) right after it answered its first request."""
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and not killed:
        if log.is_file() and "/generate" in log.read_text(errors="replace"):
            proc = _reward_server(model_dir)
            if proc is not None:
                parent = " ".join(proc.parent().cmdline())  # who started it
                os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
                killed.append((proc.pid, parent))
                return
        time.sleep(0.2)


def test_a_judge_killed_mid_step_is_restarted_and_no_sample_is_scored_0(assets, tmp_path):
    require_sglang()
    judge = add_chat_template(make_tiny_hf_checkpoint(tmp_path / "judge", vocab=256))
    overrides = train_overrides(
        assets,
        tmp_path,
        "judge",
        2,
        **{
            "reward.model.kind": "judge",
            "reward.model.path": str(judge),
            "reward.model.parser": f"{PARSER}:parity",
            # the tiny judge takes 128 tokens: the response alone is its question
            "reward.model.prompt_template": "'{response}'",
            "reward.model.max_new_tokens": 4,
            # one request at a time, so the kill lands while the step's other responses wait
            "reward.model.max_in_flight": 1,
            "reward.model.max_retries": 1,
            "reward.model.timeout_s": 20,
            "reward.model.down_grace_s": 600,
            "rollout.dump_rollouts": "true",
            # groups left without two scored responses are drawn again until the batch is full
            "algorithm.filter_groups.enable": "true",
            "algorithm.filter_groups.max_num_gen_batches": 0,
            "trainer.test_freq": 0,
            "trainer.val_before_train": "false",
        },
    )
    killed: list = []
    watcher = threading.Thread(
        target=_kill_when_it_scores, args=(tmp_path / "judge" / "sglang" / "reward_0.log", judge, killed)
    )
    watcher.start()
    summary = run_train(load_for_cli(str(REPO / "configs/demo.yaml"), overrides))
    watcher.join(timeout=5)
    assert killed, "the judge's server was never seen answering"
    # placed by the Ray driver: the child of its node's host actor, as a rollout server is
    assert "SGLangNodeHost" in killed[0][1], killed
    run = Path(summary["run_dir"])
    records = {r["step"]: r for r in read_metrics(run)}
    assert set(records) >= {1, 2}
    # the Ray-hosted HF engines streamed each response to the driver as its row stopped
    assert records[1]["reward/early_fraction"] == records[2]["reward/early_fraction"] == 1.0
    # the responses in flight when it died waited out its restart: none unscored, the restart counted
    assert records[1]["reward/server_restarts"] == 1
    assert records[1].get("reward/unscored", 0) == 0, "responses failed while the judge restarted"
    for step in (1, 2):
        for row in _dumped(run, step):
            if row.get("unscored"):
                assert math.isnan(row["reward"]), row  # never a 0, never a -1
            else:
                assert row["score"] in (1.0, -1.0), row
    # the restarted server answered step 2: every response it was asked about got a score
    assert "reward/model_mean" in records[2] and records[2].get("reward/unscored", 0) == 0


def test_a_classifier_scores_every_response_of_two_steps(assets, tmp_path):
    require_sglang()
    rm = make_tiny_classifier(tmp_path / "rm")
    overrides = train_overrides(
        assets,
        tmp_path,
        "classifier",
        2,
        **{
            "reward.model.kind": "classifier",
            "reward.model.path": str(rm),
            "rollout.dump_rollouts": "true",
            # continuous scores: the filter keeps groups whose scores differ
            "algorithm.filter_groups.enable": "true",
            "algorithm.filter_groups.metric": "score",
            "trainer.test_freq": 0,
            "trainer.val_before_train": "false",
        },
    )
    cfg = load_for_cli(str(REPO / "configs/demo.yaml"), overrides)
    summary = run_train(cfg)
    run = Path(summary["run_dir"])
    assert (run / "reward_model_served" / "config.json").is_file()  # the corrected copy served
    # the prompts as the run read them (the demo's data.template: the bare question)
    prompts = {
        row["index"]: row for row in load_prompt_rows(str(assets.train_file), template=cfg.data.template)
    }
    tokenizer = load_tokenizer(str(rm), "rm")
    records = {r["step"]: r for r in read_metrics(run)}
    for step in (1, 2):
        assert records[step]["reward/unscored"] == 0
        rows = _dumped(run, step)
        assert rows and all(r["model_score"] == r["score"] for r in rows)
        assert len({round(r["score"], 6) for r in rows}) > 1  # the model scored the texts, not a constant
        # each score is transformers' on the prompt's messages and the response (float32, CPU)
        for r in rows[:4]:
            messages = prompts[r["prompt_index"]]["messages"]
            ids = render_ids(tokenizer, messages, r["response"], "rm")
            assert abs(r["model_score"] - reference_scores(rm, [ids])[0][0]) < 1e-4, r
