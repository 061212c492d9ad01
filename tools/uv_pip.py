"""Run `uv pip ...` with this machine's pip configuration: `make setup` installs with uv, pip's users get pip's packages.

uv reads none of pip's configuration (pip.conf files, PIP_* variables), so on a machine whose pip is
pointed at a private index, local wheel folders or a constraints file, a bare `uv pip install` would
fetch other packages than `pip install` (or fail where pip works). This reads pip's settings through
`pip config list` (the files and the environment, as pip merges them) and passes each one that
decides which files get installed as the matching uv flag or variable. A setting it cannot carry
stops it with one line instead of installing something pip would not.

    python3 tools/uv_pip.py .uv/bin/uv install --python .venv/bin/python -c requirements/cpu.lock -e .

Standard library only: it runs before any venv exists.
"""

import ast
import os
import re
import subprocess
import sys

# pip settings that carry to uv as flags, each value (whitespace-separated lists, as pip splits them)
# becoming one flag.
LIST_FLAGS = {
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraints",
    "trusted-host": "--allow-insecure-host",
    "only-binary": "--only-binary",
    "no-binary": "--no-binary",
}
SINGLE_FLAGS = {"index-url": "--index-url", "keyring-provider": "--keyring-provider"}
BOOL_FLAGS = {"no-index": ["--no-index"], "pre": ["--prerelease", "allow"]}
# pip settings that uv takes from the environment instead.
ENV_VARS = {
    "cert": "SSL_CERT_FILE",
    "client-cert": "SSL_CLIENT_CERT",
    "proxy": "HTTPS_PROXY",
    "timeout": "UV_HTTP_TIMEOUT",
    "default-timeout": "UV_HTTP_TIMEOUT",
    "retries": "UV_HTTP_RETRIES",
}
# pip settings that change how pip talks or where it keeps its own files, never which packages a
# venv gets: nothing to carry.
HARMLESS = {
    "config-file",  # PIP_CONFIG_FILE: where settings come from; they come through themselves
    "disable-pip-version-check",
    "no-input",
    "no-color",
    "progress-bar",
    "quiet",
    "verbose",
    "log",
    "cache-dir",
    "no-cache-dir",
    "root-user-action",
    "require-virtualenv",
    "break-system-packages",
    "no-python-version-warning",
    "use-feature",
    "exists-action",
    "upgrade-strategy",
}
# pip picks the best version across all its indexes and find-links folders; uv's default takes the
# first index that has the package at all, which would install another version where a local index
# holds an older release than the registry.
UV_FIXED = ["--index-strategy", "unsafe-best-match"]
_TRUE = {"1", "true", "yes", "on"}
# the uv pip commands that read indexes
RESOLVING = {"install", "sync", "compile"}


def pip_settings(pip_config_list: str) -> dict[str, str]:
    """The settings `pip install` uses, from `pip config list` output (lines `section.key='value'`).

    pip lets the [install] section override [global], and PIP_* variables (section ":env:") override
    both; files are already merged by pip (site over user over global)."""
    rank = {"global": 0, "install": 1, ":env:": 2}
    best: dict[str, tuple[int, str]] = {}
    for line in pip_config_list.splitlines():
        m = re.fullmatch(r"(:env:|[\w-]+)\.([\w-]+)=(.*)", line.strip())
        if not m or m.group(1) not in rank:
            continue
        section, key, raw = m.groups()
        key = key.replace("_", "-")
        if key not in best or rank[section] >= best[key][0]:
            best[key] = (rank[section], ast.literal_eval(raw))
    return {k: v for k, (_, v) in best.items()}


def uv_args_env(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The uv flags and environment that reproduce pip's settings; ValueError names one it cannot carry."""
    args, env = list(UV_FIXED), {}
    for key, value in sorted(settings.items()):
        if key in LIST_FLAGS:
            for item in re.split(r"[\s,]+" if key.endswith("binary") else r"\s+", value.strip()):
                if item:
                    args += [LIST_FLAGS[key], item]
        elif key in SINGLE_FLAGS:
            args += [SINGLE_FLAGS[key], value.strip()]
        elif key in BOOL_FLAGS:
            if value.strip().lower() in _TRUE:
                args += BOOL_FLAGS[key]
        elif key in ENV_VARS:
            env[ENV_VARS[key]] = value.strip()
        elif key not in HARMLESS:
            raise ValueError(
                f"pip is configured with {key}={value!r}, which uv has no equivalent for here: "
                "unset it (pip config list shows where it is set) or install with pip (make ... INSTALLER=pip)"
            )
    return args, env


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: uv_pip.py UV_BINARY SUBCOMMAND [ARGS...]", file=sys.stderr)
        return 2
    uv, sub, rest = argv[0], argv[1], argv[2:]
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    if listed.returncode != 0:
        why = (listed.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"tools/uv_pip.py: {sys.executable} -m pip config list failed ({why})", file=sys.stderr)
        return 1
    try:
        args, env = uv_args_env(pip_settings(listed.stdout))
    except ValueError as e:
        print(f"tools/uv_pip.py: {e}", file=sys.stderr)
        return 1
    if sub not in RESOLVING:
        args = []
    # pip's certificate and proxy win over the environment's, as they do for pip; a UV_* variable the
    # user set wins over pip's timeouts
    env = {**os.environ, **{k: v for k, v in env.items() if not (k.startswith("UV_") and k in os.environ)}}
    os.execvpe(uv, [uv, "pip", sub, *args, *rest], env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
