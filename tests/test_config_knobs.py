"""Every runtime config takes its knobs from the schema: one default per knob, no hand copies.

The runtime configs (the rollout manager's, the actor's, the optimizer's, the planner's) declare
config keys with ``knob()``; a dataclass elsewhere in the package that repeats schema leaves with
literal defaults is a hand copy that can drift, and is found here by reading the source.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from megatron_dapo.actor.actor import ActorConfig
from megatron_dapo.actor.optimizer import OptimizerSettings
from megatron_dapo.config import load_config
from megatron_dapo.config.knobs import config_keys, schema_default
from megatron_dapo.config.loader import all_keys
from megatron_dapo.config.schema import OptimConfig
from megatron_dapo.plan.inputs import PlanInputs, inputs_from_config
from megatron_dapo.rollout.manager import RolloutManagerConfig

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_dapo"
RUNTIME_CONFIGS = (RolloutManagerConfig, ActorConfig, OptimizerSettings, PlanInputs)
SECTIONS = {k.rsplit(".", 1)[0] for k in all_keys() if "." in k}
LEAVES = {k.rsplit(".", 1)[-1] for k in all_keys() if k not in SECTIONS}

# Dataclasses that share names with schema leaves and are not built from a config section, each
# with the reason; a new one fails the scan below until it is built with knob() or listed here.
NOT_CONFIG_COPIES = {
    # per-request sampling values; the manager fills them from its own config
    ("rollout/types.py", "SamplingParams"),
    # the CPU demo's own small recipe, written to a YAML config by the demo command
    ("demo/recipe.py", "DemoRecipe"),
    # the calculator demo's recipe, written to its YAML config the same way
    ("demo/calculator/recipe.py", "CalculatorRecipe"),
    # the demo's supervised warm start, not a DAPO run
    ("demo/sft.py", "SFTConfig"),
    # algo/ sits below config/ (it imports nothing of ours); built as RolloutCorrection(**section)
    # and its defaults are compared with the schema's below
    ("algo/rollout_correction.py", "RolloutCorrection"),
    # one server's launch settings, every field passed by its launcher (sglang/engines.py)
    ("sglang/server.py", "SGLangServerConfig"),
    # the loss's inputs, built from ActorConfig by the actor
    ("actor/train_step.py", "LossSettings"),
    # rewards/ sits below config/ (it imports neither); built by settings_from_config, and its
    # defaults are compared with the schema's in test_rewards_served_config.py
    ("rewards/served/settings.py", "ServedRewardSettings"),
}


def test_optimizer_warmup_default_is_the_schemas():
    # optim.lr_warmup_steps is 10 in the schema (the DAPO recipe); the optimizer had its own 0
    assert OptimizerSettings().lr_warmup_steps == OptimConfig().lr_warmup_steps == 10


@pytest.mark.parametrize("cls", RUNTIME_CONFIGS, ids=lambda c: c.__name__)
def test_runtime_defaults_are_the_schemas(cls):
    keys = config_keys(cls)
    assert keys, f"{cls.__name__} declares no knob"
    for f in dataclasses.fields(cls):
        if f.name in keys:
            expected = schema_default(keys[f.name])
            if expected == "???":
                assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            else:
                default = f.default_factory() if f.default is dataclasses.MISSING else f.default
                assert default == expected, f"{cls.__name__}.{f.name}: {default!r} != schema {expected!r}"
        else:
            # a field that is not a knob must not be a schema leaf under the same name
            assert f.name not in LEAVES, f"{cls.__name__}.{f.name} copies a schema key by hand; use knob()"


@pytest.mark.parametrize("cls", RUNTIME_CONFIGS, ids=lambda c: c.__name__)
def test_runtime_config_reads_every_knob_from_a_loaded_config(cls):
    overrides = {
        "rollout.n": 3,
        "optim.lr_warmup_steps": 2,
        "algorithm.clip_ratio_high": 0.3,
        "data.max_response_length": 4096,
        "trainer.seed": 7,
    }
    cfg = load_config(None, ["model.path=/nonexistent", *(f"{k}={v}" for k, v in overrides.items())])
    built = inputs_from_config(cfg) if cls is PlanInputs else cls.from_config(cfg)
    for name, key in config_keys(cls).items():
        expected = cfg
        for part in key.split("."):
            expected = expected[part]
        assert getattr(built, name) == expected, f"{cls.__name__}.{name} != {key}"
    assert any(key in overrides for key in config_keys(cls).values())


def _dataclasses_with_literal_leaf_defaults():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "config/schema.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            if not any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                continue
            copied = [
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and stmt.target.id in LEAVES
                and stmt.value is not None
                and not (isinstance(stmt.value, ast.Call) and ast.unparse(stmt.value.func) == "knob")
            ]
            if len(copied) >= 2:
                yield rel, node.name, copied


def test_no_dataclass_copies_schema_fields_by_hand():
    found = {(rel, name): copied for rel, name, copied in _dataclasses_with_literal_leaf_defaults()}
    unexpected = {k: v for k, v in found.items() if k not in NOT_CONFIG_COPIES}
    assert not unexpected, (
        f"dataclasses repeating schema keys with their own defaults (use knob()): {unexpected}"
    )


def test_scan_finds_a_hand_copy(tmp_path, monkeypatch):
    # the scan itself: a dataclass written like the old OptimizerSettings is found
    pkg = tmp_path / "megatron_dapo"
    pkg.mkdir()
    (pkg / "opt.py").write_text(
        "from dataclasses import dataclass\n\n@dataclass\nclass S:\n    lr: float = 1e-6\n"
        "    lr_warmup_steps: int = 0\n    other: int = 3\n"
    )
    (pkg / "ok.py").write_text(
        "from dataclasses import dataclass\n\n@dataclass\nclass K:\n    lr: float = knob('optim.lr')\n"
        "    lr_warmup_steps: int = knob('optim.lr_warmup_steps')\n"
    )
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    assert list(_dataclasses_with_literal_leaf_defaults()) == [("opt.py", "S", ["lr", "lr_warmup_steps"])]


def test_rollout_correction_defaults_are_the_schemas():
    from megatron_dapo.algo import RolloutCorrection

    for f in dataclasses.fields(RolloutCorrection):
        assert f.default == schema_default(f"algorithm.rollout_correction.{f.name}"), f.name
