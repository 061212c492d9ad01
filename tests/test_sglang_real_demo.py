"""`megatron-dapo demo --engine sglang`: the demo command with the real SGLang server on the CPU.

Two DAPO steps on a 5-step warm start (the asset builder's `sft_steps`/`eval_problems` options,
passed in by wrapping it), 8 held-out problems: the command exits 0, its run used SGLang servers
(their logs, the resolved config), and the trainer scored the servers' samples as they did at
both steps (a broken weight sync shows at step 2: the training moved the weights, checked on the
exported ones). `--task calculator`: two steps of multi-turn tool episodes on the server, on the
calculator demo's warm start (conftest's ``calculator_assets``). Accuracy is not checked here: the
full demo's bar is measured separately (docs/results.md). Without `make setup-sglang` it skips,
and fails in CI (tests/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from sglang_fixtures import hf_sequence_logprobs, require_sglang

SEQUENCE = [5, 6, 7, 8, 40, 41, 42, 100, 3, 77]


def test_demo_runs_on_real_sglang_servers(tmp_path, monkeypatch):
    require_sglang()
    import megatron_dapo.commands.demo as demo_command
    from megatron_dapo.cli import main

    build = demo_command.prepare_demo_assets
    built = []

    def tiny_warm_start(out_dir, seed=0, force=False, **kw):
        built.append(build(out_dir, seed, force, **{**kw, "sft_steps": 5, "eval_problems": 8}))
        return built[-1]

    monkeypatch.setattr(demo_command, "prepare_demo_assets", tiny_warm_start)
    runs = tmp_path / "runs"
    code = main(
        ["demo", "--engine", "sglang", "--assets", str(tmp_path / "assets"), "--bar-gain", "0", "--bar-final", "0",
         f"trainer.runs_dir={runs}", "trainer.total_steps=2", "trainer.train_batch_size=4",
         "rollout.gen_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "data.val_max_samples=8",
         "trainer.save_freq=0", "trainer.hf_export_at_end=true", "logging.plots_at_end=false",
         "logging.progress=false", "algorithm.filter_groups.enable=false",
         "algorithm.allow_partial_batch=false"]
    )  # fmt: skip
    assert code == 0
    run = runs / "demo_dapo_sglang"
    assert "engine: sglang" in (run / "config.yaml").read_text()
    assert (run / "sglang" / "engine_0.log").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["actor/rollout_logprob_abs_diff"] < 1e-4, r["step"]
        assert r["rollout/engines_down"] == 0 and r["rollout/groups_in_batch"] == 4
    assert "val/avg@4" in steps[-1] and steps[-1]["val/num_problems"] == 8
    assert Path(run / "summary.json").is_file()
    # the control: training moved the weights enough that step 2 sampled from unsynced (initial)
    # weights would show in its log-prob check (HF fp32 forwards of the start and exported weights)
    moved = hf_sequence_logprobs(run / "hf" / "step_2", SEQUENCE) - hf_sequence_logprobs(
        built[0].hf_dir, SEQUENCE
    )
    assert moved.abs().max() > 1e-3, moved


def test_calculator_demo_runs_tool_episodes_on_real_sglang_servers(calculator_assets, tmp_path, monkeypatch):
    """`megatron-dapo demo --task calculator --engine sglang`: two DAPO steps of tool episodes. The
    server stops each turn at <|end|> (the end-of-turn token) and gets each next turn as input ids
    holding the tool's answer; its log-probs of the sampled tokens are the trainer's."""
    require_sglang()
    import megatron_dapo.commands.demo as demo_command
    from megatron_dapo.cli import main

    monkeypatch.setattr(demo_command, "prepare_calculator_assets", lambda *a, **kw: calculator_assets)
    # the bar off: 2 steps on 8 problems may end lower than they began (SGLang is not seeded)
    runs = tmp_path / "runs"
    code = main(
        ["demo", "--task", "calculator", "--engine", "sglang", "--bar-gain", "0", "--bar-final", "0",
         f"trainer.runs_dir={runs}", "trainer.total_steps=2", "trainer.train_batch_size=4",
         "rollout.gen_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "data.val_max_samples=8",
         "trainer.test_freq=2", "trainer.save_freq=0", "logging.plots_at_end=false", "logging.progress=false",
         "algorithm.filter_groups.enable=false", "algorithm.allow_partial_batch=false"]
    )  # fmt: skip
    assert code == 0
    run = runs / "demo_calculator_dapo_sglang"
    assert "engine: sglang" in (run / "config.yaml").read_text()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/multiturn/tool_calls_mean"] > 0, r["step"]
        assert r["rollout/multiturn/prefix_breaks"] == 0, r["step"]
        assert r["rollout/multiturn/tool_errors"] == 0, r["step"]
        assert r["actor/rollout_logprob_abs_diff"] < 1e-4, r["step"]
    assert "val/avg@4" in steps[-1] and steps[-1]["val/num_problems"] == 8
