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
