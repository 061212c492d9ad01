"""The CPU lock pins every dependency `make setup` installs, the demo reports its environment,
and the demo's bar check names what was missed."""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

import torch

from megatron_dapo.commands.demo import bar_miss, phase_breakdown
from megatron_dapo.demo import environment

REPO = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0]).lower()


def test_lock_pins_every_declared_cpu_dependency_exactly():
    # what pip resolved from pyproject.toml: the core requirements and the dev extra (no gpu extra)
    declared = [r for r in metadata.requires("megatron-dapo") if "extra ==" not in r or '"dev"' in r]
    pins = environment.read_lock(REPO / "requirements" / "cpu.lock")
    missing = [_name(r) for r in declared if _name(r) not in pins]
    assert not missing, f"requirements/cpu.lock lacks {missing}: run `make lock`"
    assert pins["torch"] == "2.13.0"
    lines = [ln for ln in (REPO / "requirements/cpu.lock").read_text().splitlines() if ln and ln[0] != "#"]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[^=\s]+", ln) for ln in lines), "only exact pins"


def test_makefile_installs_from_the_lock():
    make = (REPO / "Makefile").read_text()
    assert "LOCK := requirements/cpu.lock" in make
    assert make.count("$(LOCK_FLAGS)") >= 2  # torch and the project both


def test_environment_flags_versions_that_differ_from_the_lock(tmp_path):
    lock = tmp_path / "cpu.lock"
    lock.write_text("# header\ntorch==0.0.1\nray==99.0\n")
    env = environment.collect(lock)
    assert {"torch", "transformers", "megatron-core", "ray"} <= set(env.packages)
    assert env.torch_threads >= 1
    assert any(m.startswith("torch ") and "(lock 0.0.1)" in m for m in env.lock_mismatches)
    written = json.loads(env.write(tmp_path / "run").read_text())
    assert written["packages"]["torch"] == env.packages["torch"]
    assert "torch threads" in env.summary()
    # the kernels torch picked, which change the demo's figures from one CPU to another
    assert written["cpu"].endswith(f", torch {torch.backends.cpu.get_cpu_capability()}")
    assert written["cpu"] in env.summary()


def test_the_cpu_model_is_read_from_cpuinfo():
    text = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC  9B14\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC  9B14\n"
    )
    assert environment.cpu_model(text) == "AMD EPYC 9B14"
    assert environment.cpu_model("processor\t: 0\nCPU part\t: 0xd0c\n") == ""  # Arm names none


def test_bar_check_names_each_miss():
    assert bar_miss(0.45, 0.86, 30, 80) is None
    assert "rose +25.0 points, needs +30" in bar_miss(0.45, 0.70, 30, 80)
    assert "ended at 70.0%, needs 80%" in bar_miss(0.45, 0.70, 30, 80)
    assert bar_miss(0.60, 0.79, 0, 80) == "ended at 79.0%, needs 80% (--bar-final)"
    # 0 and 0: off, as --help says, even for a run that ends lower than it began
    assert bar_miss(0.60, 0.55, 0, 0) is None
    assert bar_miss(0.45, 0.70, 0, 0) is None  # the bar switched off


def test_phase_breakdown_leaves_out_the_wait_times_that_overlap_the_phases(tmp_path):
    # the actor's wait for data is its gen phase, the engines' wait spans the update: summing them
    # as phases counted 42% + 42% for one 74 s and read "other 0s" in the demo's last line
    step = {"timing/gen": 20.0, "timing/update_actor": 10.0, "timing/step": 31.0}
    waits = {"timing/actor_wait_data_s": 20.0, "timing/engine_wait_weights_s": 12.0}
    lines = [json.dumps({"step": s, **step, **waits}) for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    line = phase_breakdown(10.0, False, tmp_path, 100.0)
    assert "wait" not in line
    # by hand: gen 2 x 20, update 2 x 10, warm start 10, other 100 - 10 - 40 - 20 = 30
    assert "gen 40s (40%)" in line and "update_actor 20s (20%)" in line
    assert "warm start + assets 10s (10%)" in line
    assert line.endswith("other (Ray/worker start, val before, shutdown) 30s (30%)")
