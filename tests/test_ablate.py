"""`megatron-dapo ablate`: the ladder's rungs, and its table from hand-made metrics files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megatron_dapo.commands.ablate import (
    LADDER,
    LOSS_VARIANTS,
    RUNGS,
    read_curve,
    rung_overrides,
    summarise,
    table,
)
from megatron_dapo.commands.demo import GRPO_OVERRIDES
from megatron_dapo.config import load_config

REPO = Path(__file__).resolve().parents[1]


def _get(cfg, dotted: str):
    return OmegaConf.select(cfg, dotted)


def test_last_rung_is_the_demo_config_and_the_first_is_its_grpo():
    demo = OmegaConf.load(REPO / "configs/demo.yaml")
    full = rung_overrides(len(LADDER) - 1)
    # the paper's table is cumulative, so overlong filtering stays on; the demo leaves it off
    # (its default), which changes nothing there: no demo response reaches max_response_length
    assert full.pop("algorithm.overlong_filter") == "true"
    for key, value in full.items():
        assert str(_get(demo, key)).lower() == value, key
    grpo = rung_overrides(0)
    for item in GRPO_OVERRIDES:
        key, value = item.split("=", 1)
        assert grpo[key] == value, key
    # each rung changes exactly the knobs it names
    for i in range(1, len(LADDER)):
        changed = {k for k, v in rung_overrides(i).items() if rung_overrides(i - 1)[k] != v}
        assert changed == set(LADDER[i][1]), LADDER[i][0]


def test_loss_variants_are_full_dapo_with_another_loss_and_valid_configs():
    dapo = rung_overrides(len(LADDER) - 1)
    variants = []
    for i in range(len(LADDER), len(RUNGS)):
        over = rung_overrides(i)
        changed = {k for k, v in over.items() if dapo.get(k) != v}
        assert changed == set(RUNGS[i][1]), RUNGS[i][0]  # the same budget and task as DAPO
        cfg = load_config(REPO / "configs/demo.yaml", [f"{k}={v}" for k, v in over.items()])
        variants.append((cfg.algorithm.policy_loss, cfg.algorithm.adv_estimator, cfg.actor.use_kl_loss))
    assert variants == [
        ("gspo", "grpo", False),
        ("cispo", "grpo", False),
        ("sapo", "grpo", False),
        ("gpg", "grpo", False),
        ("vanilla", "grpo", True),
        ("vanilla", "rloo", False),
        ("vanilla", "reinforce_plus_plus_baseline", False),
    ]
    assert len(LOSS_VARIANTS) == 7
    assert (
        load_config(
            REPO / "configs/demo.yaml", [f"{k}={v}" for k, v in rung_overrides(len(LADDER) + 1).items()]
        ).algorithm.clip_ratio_low
        == 1.0
    )


def test_loss_variants_aggregate_as_verl_does():
    # verl's compute_policy_loss_sapo aggregates with "seq-mean-token-mean" whatever
    # loss_agg_mode says, and its GSPO recipe sets the same; the ladder's own token-mean would
    # make those rungs a different loss from the one their names point at
    by_loss = {}
    for i in range(len(LADDER), len(RUNGS)):
        cfg = load_config(REPO / "configs/demo.yaml", [f"{k}={v}" for k, v in rung_overrides(i).items()])
        by_loss.setdefault(cfg.algorithm.policy_loss, cfg.algorithm.loss_agg_mode)
    assert by_loss["sapo"] == "seq-mean-token-mean"
    assert by_loss["gspo"] == "seq-mean-token-mean"


def _metrics(path: Path, evals: dict[int, float], step_s: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in range(0, max(evals) + 1):
        r = {"step": step}
        if step:
            r["timing/step"] = step_s
        if step in evals:
            r["val/avg@4"] = evals[step]
        rows.append(json.dumps(r))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_table_at_equal_steps_and_equal_time(tmp_path):
    grpo, dapo = LADDER[0][0], LADDER[-1][0]
    curves = [
        # GRPO: 1 s per step; DAPO: 2 s per step (dynamic sampling generates more)
        read_curve(_metrics(tmp_path / "a.jsonl", {0: 0.4, 2: 0.5, 4: 0.6}, 1.0), grpo, 0, "val/avg@4"),
        read_curve(_metrics(tmp_path / "b.jsonl", {0: 0.4, 2: 0.6, 4: 0.7}, 1.0), grpo, 1, "val/avg@4"),
        read_curve(_metrics(tmp_path / "c.jsonl", {0: 0.4, 2: 0.7, 4: 0.9}, 2.0), dapo, 0, "val/avg@4"),
        read_curve(_metrics(tmp_path / "d.jsonl", {0: 0.4, 2: 0.8, 4: 0.9}, 2.0), dapo, 1, "val/avg@4"),
    ]
    rows = summarise(curves)
    assert [r["rung"] for r in rows] == [grpo, dapo]
    g, d = rows
    assert g["end"] == pytest.approx(0.65) and g["gain"] == pytest.approx(0.25)
    assert d["end"] == pytest.approx(0.9) and d["end_std"] == pytest.approx(0.0)
    # equal time = GRPO's 4 s: DAPO has then done 2 steps (0.7, 0.8)
    assert g["equal_time_s"] == 4.0 and d["at_equal_time"] == pytest.approx(0.75)
    assert g["at_equal_time"] == pytest.approx(0.65)
    text = table(rows)
    assert "| GRPO | 2 | 40.0% | 65.0% ± 7.1% | +25.0 | 65.0% ± 7.1% | 4 s |" in text


def test_a_run_without_evaluations_is_named(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1, "timing/step": 1.0}) + "\n")
    with pytest.raises(ValueError, match="m.jsonl has no val/avg@4"):
        read_curve(path, "GRPO", 0, "val/avg@4")


def _dynamics_metrics(path: Path, entropy: list[float], truncation: list[float], tokens: int) -> Path:
    """Steps 1..len(entropy), each generating ``tokens``; evaluations at step 0 and the last step."""
    last = len(entropy)
    rows = [{"step": 0, "val/avg@4": 0.2}]
    for step, (h, t) in enumerate(zip(entropy, truncation), start=1):
        r = {
            "step": step,
            "timing/step": 1.0,
            "actor/entropy": h,
            "rollout/truncation_rate": t,
            "rollout/response_length/mean": 30.0 + step,
            "rollout/zero_spread_fraction": 0.5,
            "rollout/tokens_generated": tokens,
        }
        if step in (2, last):
            r["val/avg@4"] = 0.2 + 0.1 * step
        rows.append(r)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_dynamics_and_accuracy_at_equal_generated_tokens(tmp_path):
    from megatron_dapo.commands.ablate import dynamics_table

    grpo, dapo = LADDER[0][0], LADDER[-1][0]
    curves = [
        # GRPO generates 100 tokens a step, DAPO 200 (its extra generation rounds)
        read_curve(
            _dynamics_metrics(tmp_path / "a.jsonl", [1.0, 0.8, 0.6, 0.4], [0.3, 0.2, 0.2, 0.1], 100),
            grpo,
            0,
            "val/avg@4",
        ),
        read_curve(
            _dynamics_metrics(tmp_path / "b.jsonl", [1.0, 0.9, 0.8, 0.7], [0.3, 0.1, 0.0, 0.0], 200),
            dapo,
            0,
            "val/avg@4",
        ),
    ]
    assert curves[1].tokens == [0.0, 400.0, 800.0]
    g, d = summarise(curves)
    # the last 3 steps' mean: (0.8 + 0.6 + 0.4) / 3 and (0.9 + 0.8 + 0.7) / 3
    assert g["final_entropy"] == pytest.approx(0.6) and d["final_entropy"] == pytest.approx(0.8)
    assert d["final_truncation"] == pytest.approx(1 / 30) and g["final_length"] == pytest.approx(33.0)
    # equal tokens = GRPO's 400: DAPO had evaluated at step 2 (0.4), GRPO at its step 4 (0.6)
    assert g["equal_tokens"] == 400.0
    assert g["at_equal_tokens"] == pytest.approx(0.6) and d["at_equal_tokens"] == pytest.approx(0.4)
    text = dynamics_table([g, d])
    assert "| GRPO | 60.0% (60.0%) | 60.0% ± 0.0% | 0.600 ± 0.000 (0.600) | 33.0 ± 0.0 (33.0) |" in text
    assert "0.800 ± 0.000 (0.800)" in text and "| 800k |" not in text and "| 1k |" in text
    # runs that logged none of them (older metrics files) give no second table
    assert (
        dynamics_table(
            summarise(
                [read_curve(_metrics(tmp_path / "c.jsonl", {0: 0.4, 2: 0.5}, 1.0), grpo, 0, "val/avg@4")]
            )
        )
        == ""
    )


def test_task_reaches_every_demo_run_and_picks_its_own_output(tmp_path, monkeypatch):
    import argparse
    import subprocess

    from megatron_dapo.commands import ablate

    seen = []

    def fake_run(cmd, stdout, stderr):
        # stands in for `megatron-dapo demo`: a finished run with two evaluations
        seen.append(cmd)
        run_dir = Path(next(a for a in cmd if a.startswith("trainer.runs_dir=")).split("=", 1)[1])
        name = next(a for a in cmd if a.startswith("trainer.run_name=")).split("=", 1)[1]
        _dynamics_metrics(_mkdir(run_dir / name) / "metrics.jsonl", [0.1, 0.1], [0.2, 0.1], 50)
        (run_dir / name / "summary.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ablate.subprocess, "run", fake_run)
    parser = argparse.ArgumentParser()
    ablate.register(parser)
    args = parser.parse_args(["--task", "longhand", "--seeds", "0", "--rungs", "0,5"])
    assert args.func(args) == 0
    assert len(seen) == 2
    for cmd in seen:
        assert cmd[cmd.index("--task") + 1] == "longhand"
        assert cmd[cmd.index("--assets") + 1] == str(Path("runs/ablate_longhand/assets_seed0"))
    report = (tmp_path / "runs/ablate_longhand/ablation.md").read_text()
    assert "| + dynamic sampling (DAPO) |" in report and "zero-advantage groups" in report
    assert (tmp_path / "runs/ablate_longhand/ablation.png").is_file()
    assert not (tmp_path / "runs/ablate").exists()  # the arithmetic ladder's runs are not reused


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
