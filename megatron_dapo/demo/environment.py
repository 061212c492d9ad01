"""What the demo's numbers depend on besides the code: package versions, the thread count and
the CPU (torch and MKL pick their kernels by its instruction set, and kernels sum in different
orders: the same commit and lock gave seed 0's warm start different weights on two CPUs).

``make setup`` installs the CPU path from ``requirements/cpu.lock``; the README's demo figures
were measured with it. A run prints these facts first and stores them as ``environment.json``
in its run directory, so two runs that disagree can be told apart by their environments.
"""

from __future__ import annotations

import json
import platform
import re
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

# The packages whose versions change the demo's numbers (kernels, tokenizer, sampling, the actor).
KEY_PACKAGES = ("torch", "transformers", "megatron-core", "ray", "tokenizers", "numpy")
LOCK_FILE = Path(__file__).resolve().parents[2] / "requirements" / "cpu.lock"
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class Environment:
    python: str
    packages: dict[str, str]
    torch_threads: int
    cpu_count: int
    lock_mismatches: list[str] = field(default_factory=list)  # "name installed (lock X)"
    cpu: str = ""  # the CPU's model and the kernels torch picked for it: "AMD EPYC, torch AVX512"

    def summary(self) -> str:
        pkgs = " ".join(f"{k} {v}" for k, v in self.packages.items())
        cpu = f"; {self.cpu}" if self.cpu else ""
        return (
            f"python {self.python} {pkgs}; torch threads {self.torch_threads} of {self.cpu_count} CPUs{cpu}"
        )

    def write(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / "environment.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path


def _installed(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def read_lock(path: str | Path = LOCK_FILE) -> dict[str, str]:
    """``{normalised name: version}`` from a pip constraints file (``name==version`` lines)."""
    pins = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[_norm(name)] = version.strip()
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _strip_local(version: str) -> str:
    return version.split("+", 1)[0]  # torch 2.13.0+cpu satisfies the lock's 2.13.0


def cpu_model(cpuinfo: str) -> str:
    """The CPU's model name from the text of /proc/cpuinfo ("" when it names none)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name":
            return " ".join(value.split())
    return ""


def _cpu(torch) -> str:
    try:
        model = cpu_model(CPUINFO.read_text())
    except OSError:  # not Linux
        model = ""
    model = model or platform.processor() or "unknown CPU"
    return f"{model}, torch {torch.backends.cpu.get_cpu_capability()}"


def collect(lock: str | Path | None = LOCK_FILE) -> Environment:
    import os

    import torch

    packages = {name: _installed(name) for name in KEY_PACKAGES}
    mismatches = []
    if lock is not None and Path(lock).is_file():
        pins = read_lock(lock)
        for name, version in packages.items():
            want = pins.get(_norm(name))
            if want is not None and _strip_local(version) != want:
                mismatches.append(f"{name} {version} (lock {want})")
    return Environment(
        python=platform.python_version(),
        packages=packages,
        torch_threads=torch.get_num_threads(),
        cpu_count=os.cpu_count() or 0,
        lock_mismatches=mismatches,
        cpu=_cpu(torch),
    )
