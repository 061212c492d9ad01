"""tools/check_imports.py: the layering docs/architecture.md draws, no import cycles, and our own
modules imported at the top of each file unless they import ray, sglang, megatron or TE."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from check_imports import check  # noqa: E402


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "megatron_dapo" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in {p.parent for p in (root / "megatron_dapo").rglob("*.py")}:
        (folder / "__init__.py").touch()
    return root


def _run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_imports.py"), "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_package_keeps_the_contract():
    problems, _, _ = check(ROOT)
    assert problems == []
    assert _run(ROOT).returncode == 0


def test_a_module_level_cycle_fails(tmp_path):
    root = _tree(
        tmp_path,
        {
            "driver/a.py": "from megatron_dapo.driver.b import g\n\ndef f():\n    return g\n",
            "driver/b.py": "from megatron_dapo.driver import a\n\ndef g():\n    return a\n",
        },
    )
    problems, _, _ = check(root)
    assert problems == [
        "import cycle among megatron_dapo.driver.a, megatron_dapo.driver.b (module-level imports)"
    ]
    run = _run(root)
    assert (
        run.returncode == 1
        and "import cycle among megatron_dapo.driver.a, megatron_dapo.driver.b" in run.stdout
    )


def test_a_cycle_through_function_local_imports_is_a_note(tmp_path):
    root = _tree(
        tmp_path,
        {
            # a.py imports ray: the one kind of module b.py may import in a function
            "rollout/a.py": "import ray\nfrom megatron_dapo.rollout.b import g\n",
            "rollout/b.py": "def g():\n    from megatron_dapo.rollout.a import g as h\n    return h\n",
            # an import only for type checkers runs at no time
            "rollout/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_dapo.rollout.d import x\n",
            "rollout/d.py": "from megatron_dapo.rollout.c import TYPE_CHECKING as x\n",
        },
    )
    problems, local, notes = check(root)
    assert problems == []
    assert notes == [
        "note: modules that import each other only lazily (in functions or for type checkers): megatron_dapo.rollout.a, megatron_dapo.rollout.b",
        "note: modules that import each other only lazily (in functions or for type checkers): "
        "megatron_dapo.rollout.c, megatron_dapo.rollout.d",
    ]
    assert local == {"megatron_dapo/rollout/b.py": 1}  # c.py's import never runs
    assert _run(root).returncode == 0


def test_layer_violations_fail(tmp_path):
    root = _tree(
        tmp_path,
        {
            "algo/loss.py": "import torch.distributed as dist\n\ndef f():\n    from megatron_dapo.driver import trainer\n",
            "plan/memory.py": "import torch\n",
            "weights/plan.py": "from megatron_dapo.actor.model import arch_spec\n",
            "arch.py": "",
            "actor/model.py": "from megatron_dapo.arch import x\nfrom megatron_dapo.weights import plan\n",
            "driver/trainer.py": "",
        },
    )
    problems, _, _ = check(root)
    assert problems == [
        "megatron_dapo/algo/loss.py:1: algo/ must not import torch.distributed (torch.distributed)",
        "megatron_dapo/algo/loss.py:4: function-local import of megatron_dapo.driver.trainer, which imports "
        "none of ray, sglang, megatron, transformer_engine: move it to the top of the file",
        "megatron_dapo/algo/loss.py:4: algo must not import driver (megatron_dapo.driver.trainer); "
        "algo may import: nothing of ours",
        "megatron_dapo/plan/memory.py:1: plan/ must not import torch (torch)",
        "megatron_dapo/weights/plan.py:1: weights must not import actor (megatron_dapo.actor.model); "
        "weights may import: arch, errors",
        # the old actor <-> weights knot, in miniature
        "import cycle among megatron_dapo.actor.model, megatron_dapo.weights.plan (module-level imports)",
    ]
    assert _run(root).returncode == 1


LIGHT = "megatron_dapo/{}:{}: function-local import of megatron_dapo.{}, which imports none of ray, sglang, megatron, transformer_engine: move it to the top of the file"


def test_a_function_local_import_must_be_of_a_module_that_imports_ray_sglang_megatron_or_te(tmp_path):
    root = _tree(
        tmp_path,
        {
            "rollout/types.py": "import torch\n",  # torch alone is not a reason to defer
            "actor/core.py": "from megatron.core import parallel_state\n",
            "actor/wrapper.py": "from megatron_dapo.actor.core import parallel_state\n",  # heavy through core
            "actor/te.py": "def f():\n    import transformer_engine\n",  # TE only when called: light
            "sglang/host.py": "try:\n    import ray\nexcept ImportError:\n    ray = None\n",
            "driver/launch.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from megatron_dapo.rollout.types import x\n"  # never runs: allowed
                "def a():\n"
                "    from megatron_dapo.rollout.types import x\n"  # light: refused
                "def b():\n"
                "    from megatron_dapo.actor import core\n"  # imports megatron at its top
                "def c():\n"
                "    from megatron_dapo.actor.wrapper import parallel_state\n"  # transitively
                "def d():\n"
                "    import megatron_dapo.sglang.host\n"
                "def e():\n"
                "    from megatron_dapo.actor.te import f\n"
                "    class K:\n"
                "        def m(self):\n"
                "            from megatron_dapo.rollout import types\n"
            ),
        },
    )
    problems, local, _ = check(root)
    assert problems == [
        LIGHT.format("driver/launch.py", 5, "rollout.types"),
        LIGHT.format("driver/launch.py", 13, "actor.te"),
        LIGHT.format("driver/launch.py", 16, "rollout.types"),
    ]
    assert local == {"megatron_dapo/driver/launch.py": 6}
    chains = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_imports.py"), "--root", str(root), "--heavy"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.splitlines()
    assert chains[:3] == [
        "megatron_dapo.actor.core -> megatron",
        "megatron_dapo.actor.wrapper -> megatron_dapo.actor.core -> megatron",
        "megatron_dapo.sglang.host -> ray",
    ]
    run = _run(root)
    assert run.returncode == 1 and LIGHT.format("driver/launch.py", 5, "rollout.types") in run.stdout


def test_a_heavy_package_init_makes_its_modules_heavy(tmp_path):
    root = _tree(
        tmp_path,
        {
            "sglang/__init__.py": "import sglang\n",
            "sglang/server.py": "",
            "driver/launch.py": "def f():\n    from megatron_dapo.sglang.server import x\n",
        },
    )
    assert check(root)[0] == []


def test_the_exceptions_name_only_what_is_still_there(tmp_path, monkeypatch):
    import check_imports

    root = _tree(
        tmp_path,
        {
            "config/validate.py": "def f():\n    from megatron_dapo.algo import loss\n",
            "algo/loss.py": "import torch\n",
            "driver/old.py": "def f():\n    from megatron_dapo.algo import loss\n",
            "driver/done.py": "from megatron_dapo.algo import loss\n",
        },
    )
    monkeypatch.setattr(
        check_imports,
        "LAZY_EXCEPTIONS",
        {
            ("megatron_dapo.config.validate", "megatron_dapo.algo.loss"): "keeps config loading torch-free",
            ("megatron_dapo.driver.done", "megatron_dapo.algo.loss"): "moved to the top since",
        },
    )
    assert check(root)[0] == [
        "megatron_dapo/driver/old.py:2: function-local import of megatron_dapo.algo.loss, which imports none "
        "of ray, sglang, megatron, transformer_engine: move it to the top of the file",
        "megatron_dapo.driver.done no longer imports megatron_dapo.algo.loss in a function: "
        "remove it from LAZY_EXCEPTIONS",
    ]
