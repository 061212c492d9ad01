"""tools/test_budget.py: the suite's time by area from a --durations report, each test in the area
of what its own code starts (followed through its fixtures and the file's helpers), and the same
lines written by its pytest plugin as tests end."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import test_budget  # noqa: E402

CONFTEST = """
import pytest

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from sglang_fixtures import require_sglang
    require_sglang()
    yield "url"
"""

MODULE = '''
"""Prose that names run_train( and require_sglang() counts for nothing."""
import pytest
from megatron_dapo.actor.spawn import run_ranks

def _two_ranks():
    return run_ranks(_body, 2)  # a comment naming ray.init( does not count either

def _body():
    pass

@pytest.fixture
def ranks():
    return _two_ranks()

def test_pure():
    """run_train( in a docstring."""
    assert 1 + 1 == 2

def test_with_ranks(ranks):
    assert ranks

def test_through_a_helper():
    assert _two_ranks()

def test_on_the_server(served, ranks):
    assert served

def test_demo():
    from megatron_dapo.cli import main
    assert main(["demo", "--seed", "0"]) == 0

@pytest.mark.parametrize("n", [1, "2 or more"])
def test_ray(n):
    import ray
    ray.init()

SCRIPT = """
from megatron_dapo.driver.launch import init_ray
init_ray(cfg, 'cpu', 2)
"""

def test_a_script_in_a_subprocess():
    import subprocess, sys
    subprocess.run([sys.executable, "-c", SCRIPT], check=True)

class TestGroup:
    def test_method(self):
        run_ranks(_body, 2)
'''

REPORT = """
============================= slowest durations ==============================
30.00s setup    tests/test_fake.py::test_on_the_server
5.00s call     tests/test_fake.py::test_on_the_server
4.00s call     tests/test_fake.py::test_with_ranks
1.00s teardown tests/test_fake.py::test_with_ranks
3.00s call     tests/test_fake.py::test_through_a_helper
0.50s call     tests/test_fake.py::test_pure
20.00s call     tests/test_fake.py::test_demo
2.00s call     tests/test_fake.py::test_ray[1]
2.50s call     tests/test_fake.py::test_ray[2 or more]
1.50s call     tests/test_fake.py::TestGroup::test_method
6.00s call     tests/test_fake.py::test_a_script_in_a_subprocess
0.01s setup    tests/test_fake.py::test_pure
7 passed in 75.10s (0:01:15)
"""


@pytest.fixture
def root(tmp_path) -> Path:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "tests" / "test_fake.py").write_text(textwrap.dedent(MODULE))
    return tmp_path


def test_each_test_is_charged_its_phases_in_the_area_its_code_starts(root):
    per_test = test_budget.parse_durations(REPORT)
    assert per_test["tests/test_fake.py::test_on_the_server"] == 35.0
    assert per_test["tests/test_fake.py::test_pure"] == pytest.approx(0.51)
    assert test_budget.wall_seconds(REPORT) == 75.1

    classifier = test_budget.Classifier(root)
    areas = {t.split("::", 1)[1]: classifier.area(t) for t in per_test}
    assert areas == {
        "test_on_the_server": "real SGLang",  # a conftest fixture starts the server
        "test_with_ranks": "Megatron ranks",  # through a fixture of the file, then a helper
        "test_through_a_helper": "Megatron ranks",
        "test_pure": "unit",  # the marks in its docstring and the module's do not count
        "test_demo": "end to end",
        "test_ray[1]": "Ray driver",
        "test_ray[2 or more]": "Ray driver",  # a parameter id with spaces
        "TestGroup::test_method": "Megatron ranks",
        "test_a_script_in_a_subprocess": "Ray driver",  # through the module's constant
    }

    b = test_budget.budget(per_test, classifier)
    assert b.seconds == pytest.approx(
        {"real SGLang": 35.0, "end to end": 20.0, "Ray driver": 10.5, "Megatron ranks": 9.5, "unit": 0.51}
    )
    assert b.tests == {"real SGLang": 1, "end to end": 1, "Ray driver": 3, "Megatron ranks": 3, "unit": 1}
    assert b.total == pytest.approx(75.51)


def _budget(report, *args: str) -> str:
    """What ``tools/test_budget.py REPORT ARGS`` prints (it must exit 0)."""
    cmd = [sys.executable, str(REPO / "tools" / "test_budget.py"), str(report), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def test_the_command_prints_the_areas_and_writes_json(root, tmp_path):
    report = tmp_path / "durations.txt"
    report.write_text(REPORT)
    out = _budget(report, "--root", str(root), "--json", str(tmp_path / "b.json"))
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line and line.split()[0] in ("real", "end", "unit", "total")
    }
    assert rows["real"][2:] == ["35", "46.4%", "1"]
    assert rows["total"][1:] == ["76", "100.0%", "9"]
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["areas"]["Megatron ranks"] == {"seconds": 9.5, "tests": 3}
    assert data["wall_s"] == 75.1
    assert data["tests"]["tests/test_fake.py::test_demo"] == {"seconds": 20.0, "area": "end to end"}


def test_the_workers_are_replayed_in_the_suite_s_file_order(tmp_path):
    """make test's two loadfile workers: conftest's long file first, then by name; a worker takes the
    next file when two of its tests are left. By hand: gw0 runs test_c (20 + 1 + 1 s) and ends at 22;
    gw1 runs test_a (10, 1, 1, 1: with two tests left, at 11 s, it is sent test_b) then test_b's
    5 s, ending at 18 and idle the last 4 s."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text('FILE_ORDER = ("test_c.py",)\n')
    report = tmp_path / "durations.txt"
    times = {"a": [10, 1, 1, 1], "b": [5], "c": [20, 1, 1]}
    report.write_text(
        "".join(
            f"{t:.2f}s call     tests/test_{f}.py::test_{i}\n"
            for f, ts in times.items()
            for i, t in enumerate(ts)
        )
    )
    out = _budget(report, "--root", str(tmp_path), "--workers", "2")
    assert "  gw0: 1 files, ends at 22 s (last: test_c.py)" in out.splitlines(), out
    assert "  gw1: 2 files, ends at 18 s; then idle 4 s (last: test_b.py)" in out.splitlines(), out


def test_a_report_without_durations_is_refused_in_one_line(tmp_path):
    report = tmp_path / "plain.txt"
    report.write_text("3 passed in 1.00s\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "test_budget.py"), str(report)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"{report}: no --durations lines (run pytest with --durations=0)"


def test_the_plugin_logs_each_phase_as_the_test_ends(root, tmp_path):
    (root / "tests" / "test_small.py").write_text(
        "def test_a():\n    pass\n\ndef test_b():\n    assert False\n"
    )
    log = tmp_path / "budget.log"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tools.test_budget",
            "--budget-log",
            str(log),
            "tests/test_small.py",
        ],
        cwd=root,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # test_b fails; both are logged
    per_test = test_budget.parse_durations(log.read_text())
    assert sorted(per_test) == ["tests/test_small.py::test_a", "tests/test_small.py::test_b"]
    assert len(log.read_text().splitlines()) == 6  # setup, call, teardown of each
