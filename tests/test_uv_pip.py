"""tools/uv_pip.py: uv, which reads none of pip's configuration, gets pip's indexes, wheel folders and
constraints, so `make setup` installs from the places the user's pip is pointed at.

The script is run as make runs it, against a stand-in `uv` that writes down the command line and
environment it was given; pip's configuration comes from a file of the test's own (PIP_CONFIG_FILE,
loaded over the machine's files) and PIP_* variables.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import uv_pip  # noqa: E402

FAKE_UV = """#!{python}
import json, os, sys
with open({out!r}, "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f)
"""


def _run(tmp_path: Path, pip_conf: str, env_extra: dict[str, str], *args: str):
    out = tmp_path / "uv_called.json"
    uv = tmp_path / "uv"
    uv.write_text(FAKE_UV.format(python=sys.executable, out=str(out)))
    uv.chmod(0o755)
    conf = tmp_path / "pip.conf"
    conf.write_text(pip_conf)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_", "SSL_CERT"))}
    env.update(PIP_CONFIG_FILE=str(conf), **env_extra)
    res = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "uv_pip.py"), str(uv), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    called = json.loads(out.read_text()) if out.exists() else None
    return res, called


def _pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def test_pip_config_reaches_uv(tmp_path):
    """Indexes, wheel folders, constraints and the certificate set in pip's files and PIP_* variables
    arrive as uv flags and variables, in pip's precedence: a PIP_* variable over [install] over
    [global]."""
    conf = (
        "[global]\n"
        "index-url = https://mirror.example/simple\n"
        "extra-index-url = file:///idx/a/simple file:///idx/b/simple\n"
        "find-links = /wheels/from-global\n"
        "constraint = /etc/c1.txt\n"
        "cert = /certs/pip-ca.pem\n"
        "trusted-host = mirror.example\n"
        "[install]\n"
        "index-url = https://install-section.example/simple\n"
    )
    res, called = _run(
        tmp_path,
        conf,
        {"PIP_FIND_LINKS": "/wheels/env-1 /wheels/env-2"},
        "install",
        "--python",
        "/venv/bin/python",
        "torch==2.13.0",
    )
    assert res.returncode == 0, res.stderr
    argv, env = called["argv"], called["env"]
    assert argv[:2] == ["pip", "install"]
    assert argv[-3:] == ["--python", "/venv/bin/python", "torch==2.13.0"]
    assert _pairs(argv, "--index-url") == ["https://install-section.example/simple"]
    assert _pairs(argv, "--extra-index-url") == ["file:///idx/a/simple", "file:///idx/b/simple"]
    assert _pairs(argv, "--find-links") == ["/wheels/env-1", "/wheels/env-2"]
    assert _pairs(argv, "--constraints") == ["/etc/c1.txt"]
    assert _pairs(argv, "--allow-insecure-host") == ["mirror.example"]
    # pip takes the best version across all its indexes, not the first index that has the package
    assert _pairs(argv, "--index-strategy") == ["unsafe-best-match"]
    assert env["SSL_CERT_FILE"] == "/certs/pip-ca.pem"


def test_a_uv_variable_the_user_set_wins_over_pip_timeouts(tmp_path):
    res, called = _run(tmp_path, "[global]\ntimeout = 15\n", {"UV_HTTP_TIMEOUT": "99"}, "install", "six")
    assert res.returncode == 0, res.stderr
    assert called["env"]["UV_HTTP_TIMEOUT"] == "99"


def test_a_pip_setting_uv_cannot_honour_stops_before_uv_runs(tmp_path):
    """`prefer-binary` has no uv flag: installing without it could pick other files than pip."""
    res, called = _run(tmp_path, "[global]\nprefer-binary = true\n", {}, "install", "six")
    assert res.returncode == 1 and called is None
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "prefer-binary" in lines[0] and "INSTALLER=pip" in lines[0]


@pytest.mark.parametrize(
    ("listed", "expected"),
    [
        # the same key in three places: the variable wins, then [install], then [global]
        (
            "global.find-links='/g'\ninstall.find-links='/i'\n:env:.find-links='/e'",
            {"find-links": "/e"},
        ),
        ("global.find-links='/g'\ninstall.find-links='/i'", {"find-links": "/i"}),
        # a section of another pip command does not apply to install
        ("global.no-index='false'\ndownload.no-index='true'", {"no-index": "false"}),
        # PIP_NO_INDEX comes through as :env:.no_index
        (":env:.no_index='1'", {"no-index": "1"}),
    ],
)
def test_pip_settings_follow_pips_precedence(listed, expected):
    assert uv_pip.pip_settings(listed) == expected


def test_boolean_and_binary_settings():
    args, _ = uv_pip.uv_args_env({"no-index": "yes", "pre": "0", "only-binary": ":all:", "no-binary": "a,b"})
    assert "--no-index" in args and "--prerelease" not in args
    assert _pairs(args, "--only-binary") == [":all:"]
    assert _pairs(args, "--no-binary") == ["a", "b"]


def test_make_installs_through_the_wrapper_and_pip_on_request(tmp_path):
    """Every install `make setup setup-sglang` would run goes through tools/uv_pip.py (so pip's
    configuration reaches uv), compiling bytecode; INSTALLER=pip runs pip."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}

    def dry(*extra: str) -> list[str]:
        res = subprocess.run(
            [
                "make",
                "-n",
                "-C",
                str(ROOT),
                "setup",
                "setup-sglang",
                "PY=python3",
                *extra,
                f"VENV={tmp_path}/v",
                f"SG_VENV={tmp_path}/sg",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        return [ln for ln in res.stdout.splitlines() if " install " in ln]

    uv_lines = dry()
    venv_installs = [ln for ln in uv_lines if "--python" in ln]
    assert len(venv_installs) == 5, uv_lines  # pip, torch, the project; the SGLang lock, sglang
    # uv compiles only what each call installs: every call compiles
    wrapped = re.compile(r"tools/uv_pip\.py \.uv/[\d.]+/bin/uv install --quiet --compile-bytecode ")
    assert all(wrapped.search(ln) for ln in venv_installs), venv_installs
    pip_lines = [ln for ln in dry("INSTALLER=pip") if "/bin/python" in ln]
    assert len(pip_lines) == 5 and all("/bin/python -m pip install --quiet" in ln for ln in pip_lines)
    assert not any("uv_pip.py" in ln or "--compile-bytecode" in ln for ln in pip_lines), pip_lines
