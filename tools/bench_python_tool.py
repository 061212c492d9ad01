"""Benchmark the python tool behind its kernel sandbox against the interpreter it replaced.

Both sides run the same snippets one call after another, interleaved round by round so that the
machine's load falls on both alike:
- ``sandbox``: :func:`megatron_dapo.agent.tools.builtin.run_python` as training runs it (bwrap:
  own namespaces, read-only view, sized scratch, rlimits, a pids cgroup for the host's root);
- ``baseline``: the interpreter this project ran before the sandbox, rebuilt here as it was: a
  fresh ``python -I`` under ``unshare -rn`` (a network namespace) with the same rlimits and a
  Python audit hook, in a scratch directory made and removed per call.

Prints calls per second of each and the ratio sandbox / baseline (the acceptance is >= 0.8).

    python tools/bench_python_tool.py [--calls 40] [--snippet plain|numpy|sympy]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_dapo.agent.tools.builtin import PythonLimits, run_python  # noqa: E402
from megatron_dapo.agent.tools.sandbox import Sandbox, probe  # noqa: E402

SNIPPETS = {
    "plain": "total = sum(i * i for i in range(10000))\nprint(total)",
    "numpy": "import numpy as np\nprint(np.linalg.det(np.eye(4) * 2))",
    "sympy": "import sympy\nx = sympy.symbols('x')\nprint(sympy.solve(x**2 - 4, x))",
}

# The launch the sandbox replaced: rlimits and an audit hook in the fresh interpreter (abridged to
# what costs time: the hook is installed and active while the code runs).
_BASELINE_BOOT = r"""
import json, os, resource, sys
_p = json.loads(sys.argv[1])
for _r, _v in ((resource.RLIMIT_AS, _p["as"]), (resource.RLIMIT_CPU, _p["cpu"]), (resource.RLIMIT_FSIZE, _p["fsize"]),
               (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 256)):
    resource.setrlimit(_r, (_v, _v))
_SCRATCH = os.path.realpath(_p["dir"])
def _hook(event, args):
    if event.startswith("socket.") or event in ("os.system", "subprocess.Popen", "os.kill", "os.fork"):
        raise PermissionError(event)
    if event == "open" and args[2] & (os.O_WRONLY | os.O_RDWR) and isinstance(args[0], str):
        if not os.path.realpath(args[0]).startswith(_SCRATCH):
            raise PermissionError(args[0])
sys.addaudithook(_hook)
exec(compile(open("main.py").read(), "main.py", "exec"), {"__name__": "__main__"})
"""


def baseline_call(code: str, limits: PythonLimits, prefix: list[str]) -> str:
    scratch = tempfile.mkdtemp(prefix="mdapo-bench-")
    try:
        Path(scratch, "main.py").write_text(code)
        params = {
            "as": limits.memory_mb << 20,
            "cpu": int(limits.timeout_s) + 1,
            "fsize": limits.max_file_mb << 20,
            "dir": scratch,
        }
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1"}
        cmd = [*prefix, sys.executable, "-I", "-B", "-c", _BASELINE_BOOT, json.dumps(params)]
        out = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=60)
        return out.stdout + out.stderr
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40, help="calls per side (default 40)")
    parser.add_argument("--snippet", choices=sorted(SNIPPETS), default="plain")
    args = parser.parse_args()

    limits = PythonLimits(timeout_s=10)
    sandbox = Sandbox(limits.sandbox_limits(), packages=limits.packages)
    found = probe(sandbox)
    if not found.ok:
        print(f"the sandbox cannot be made here: {found.detail}", file=sys.stderr)
        return 2
    prefix = ["unshare", "-rn"] if shutil.which("unshare") else []
    code = SNIPPETS[args.snippet]
    want = run_python(code, limits, sandbox).output
    assert want == baseline_call(code, limits, prefix), "the two sides print different answers"

    times: dict[str, list[float]] = {"sandbox": [], "baseline": []}
    for i in range(args.calls):
        order = ("sandbox", "baseline") if i % 2 == 0 else ("baseline", "sandbox")
        for side in order:
            start = time.perf_counter()
            if side == "sandbox":
                run_python(code, limits, sandbox)
            else:
                baseline_call(code, limits, prefix)
            times[side].append(time.perf_counter() - start)
    rate = {side: 1.0 / statistics.median(t) for side, t in times.items()}
    for side, t in times.items():
        print(
            f"{side:9s} median {statistics.median(t) * 1e3:7.1f} ms  p90 "
            f"{sorted(t)[int(0.9 * len(t))] * 1e3:7.1f} ms  {rate[side]:6.1f} calls/s"
        )
    print(f"boundary: {found.boundary}, process count by {found.process_limit}; cpus {os.cpu_count()}")
    print(
        f"python tool ({args.snippet}, {args.calls} calls each): sandbox {rate['sandbox']:.1f} calls/s, "
        f"baseline {rate['baseline']:.1f} calls/s, ratio {rate['sandbox'] / rate['baseline']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
