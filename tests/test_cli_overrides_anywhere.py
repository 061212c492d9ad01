"""Small things a first-time user met: `key=value` overrides after a flag were refused by argparse
(`plan CFG --num-gpus 32 rollout.num_engines=8`); a clip range with its upper side below its
lower side was accepted without a word."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.cli import main
from megatron_dapo.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "configs" / "dapo_qwen2.5_32b.yaml")


def test_overrides_after_a_flag_are_overrides(capsys):
    sized = ["rollout.num_engines=8", "rollout.sglang.mem_fraction_static=0.65"]
    assert main(["plan", RECIPE, "--num-gpus", "32", *sized, "--print-overrides"]) == 0
    # what is left to override for 32 GPUs is the actor's world size alone: both were taken
    assert capsys.readouterr().out.strip() == "parallel.actor_world_size=32"
    assert (
        main(["config", RECIPE, "--no-files", "rollout.n=8", "--gpu", "h200", "trainer.total_steps=3"]) == 0
    )
    out = capsys.readouterr().out
    assert "  'n': 8\n" in out and "total_steps: 3" in out


def test_a_stray_word_after_a_flag_is_still_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", RECIPE, "--num-gpus", "32", "oops"])
    assert e.value.code == 2
    assert "unrecognized arguments: oops" in capsys.readouterr().err


def test_plan_num_gpus_prints_the_whole_set_of_overrides(capsys):
    assert main(["plan", RECIPE, "--num-gpus", "32"]) == 0
    out = capsys.readouterr().out
    assert (
        "overrides for 32 GPUs (it fits): parallel.actor_world_size=32 "
        "rollout.sglang.mem_fraction_static=0.65 rollout.num_engines=8"
    ) in " ".join(out.split())


def test_upper_clip_below_lower_clip_is_refused():
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, ["algorithm.clip_ratio_high=0.1"])
    assert str(e.value) == (
        "algorithm.clip_ratio_high=0.1 is below algorithm.clip_ratio_low=0.2: the upper clip must be at least "
        "the lower one (DAPO: low 0.2, high 0.28); swap them"
    )
    load_config(RECIPE, ["algorithm.clip_ratio_high=0.2"])  # symmetric (GRPO) is fine
    # CISPO's 1.0 lower bound means "none", above any upper one
    load_config(RECIPE, ["algorithm.policy_loss=cispo", "algorithm.clip_ratio_low=1.0"])
