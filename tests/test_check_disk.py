"""`make setup` on a disk too small for the venvs stops first, with one line, and builds nothing.

CI once died with pip's `OSError: [Errno 28] No space left on device` in the middle of installing the
SGLang venv. The check is driven here by asking for more room than any disk has (VENV_MB), which is
the same comparison a full disk fails.
"""

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _copy_build_files(dst: Path) -> None:
    for rel in (
        "Makefile",
        "tools/check_disk.py",
        "pyproject.toml",
        "requirements/cpu.lock",
        "requirements/sglang-cpu.txt",
    ):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, dst / rel)


def _make(dst: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    # PY is the plain python3 on PATH, as on a fresh machine: the Makefile asks it whether torch has CUDA,
    # which with the test venv's interpreter would cost a torch import per make call.
    return subprocess.run(
        ["make", "-C", str(dst), *args, "PY=python3"], capture_output=True, text=True, env=env, timeout=120
    )


def test_setup_on_a_full_disk_stops_with_one_line_before_creating_the_venv(tmp_path):
    _copy_build_files(tmp_path)
    res = _make(tmp_path, "setup", "VENV_MB=100000000")
    assert res.returncode != 0
    line = [ln for ln in res.stderr.splitlines() if "MB free" in ln]
    assert len(line) == 1 and "the CPU venv .venv needs about 100000000 MB free" in line[0], res.stderr
    assert str(tmp_path) in line[0] and "Free some space" in line[0]
    assert not (tmp_path / ".venv").exists()


def test_sglang_venv_is_checked_too(tmp_path):
    _copy_build_files(tmp_path)
    res = _make(tmp_path, "setup-sglang", "SG_VENV_MB=100000000")
    assert res.returncode != 0
    assert "the SGLang test venv .venv-sglang needs about 100000000 MB free" in res.stderr, res.stderr
    assert not (tmp_path / ".venv-sglang").exists()


def test_make_test_checks_room_for_both_venvs_it_installs_side_by_side(tmp_path):
    """`make test` installs the two venvs at once: a disk with room for either but not both (here
    VENV_MB + SG_VENV_MB more than any disk) stops before either starts."""
    _copy_build_files(tmp_path)
    res = _make(tmp_path, "test", "VENV_MB=60000000", "SG_VENV_MB=40000000")
    assert res.returncode != 0
    line = [ln for ln in res.stderr.splitlines() if "MB free" in ln]
    assert (
        len(line) == 1
        and "installing .venv and .venv-sglang side by side needs about 100000000 MB" in line[0]
    )
    assert not (tmp_path / ".venv").exists() and not (tmp_path / ".venv-sglang").exists()
