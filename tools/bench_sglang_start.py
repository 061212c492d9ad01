"""Benchmark a CPU SGLang server's start: its scheduler and detokenizer forked (the CPU stand-ins'
``sitecustomize``, tests/sglang_cpu) against spawned, as SGLang does by default.

Starts the CPU server on the demo's model --repeats times each way, alternating, and measures with
psutil (the OS's accounting) the wall time from launch to a healthy ``/health_generate`` and the
CPU seconds all the server's processes used by then. The spawned baseline runs with a copy of the
stand-ins' directory without ``sitecustomize.py``. Each server answers one greedy request, and the
two ways must give the same tokens. Prints one row per start, the medians and the ratios
fork/spawn; the test suite starts ~15 such servers, so the CPU saved per start, times 15, over 2
cores, is about what a `make test` run saves.

    python tools/bench_sglang_start.py [--repeats 3] [--model runs/demo_assets/hf]

Without --model it builds the tests' small demo assets (5 warm-start steps) in a temporary
directory. Not a test: run it on a quiet machine; the figures move with load.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.bench_sglang_idle import cpu_server_config, demo_model, tree_cpu_s  # noqa: E402


def spawn_standins(tmp: Path) -> Path:
    """The stand-ins' directory without the fork switch."""
    from megatron_dapo.sglang.engines import CPU_STANDINS

    out = tmp / "standins_spawn"
    shutil.copytree(CPU_STANDINS, out, ignore=shutil.ignore_patterns("sitecustomize.py", "__pycache__"))
    return out


def measure(model: Path, log: Path, standins: Path | None) -> dict:
    import httpx
    import psutil

    from megatron_dapo.sglang.engines import cpu_server_env
    from megatron_dapo.sglang.server import SGLangServer

    env = cpu_server_env()
    if standins is not None:
        env["PYTHONPATH"] = str(standins)
    cfg = cpu_server_config(model, log, env=env)
    start = time.monotonic()
    server = SGLangServer(cfg).start()
    try:
        server.wait_healthy()
        wall = time.monotonic() - start
        cpu = tree_cpu_s(psutil.Process(server.proc.pid))
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
        reply = httpx.post(f"{cfg.url}/generate", json=body, timeout=120).raise_for_status().json()
    finally:
        server.stop()
    return {"wall_s": wall, "cpu_s": cpu, "tokens": reply["output_ids"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", type=Path, default=None, help="an HF checkpoint (default: build one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_sglang_start_") as tmp:
        tmp = Path(tmp)
        model = demo_model(tmp, args.model)
        spawn_dir = spawn_standins(tmp)
        rows: dict[str, list[dict]] = {"fork": [], "spawn": []}
        for i in range(args.repeats):
            for way, standins in (("spawn", spawn_dir), ("fork", None)):
                row = measure(model, tmp / f"sglang_{way}_{i}.log", standins)
                rows[way].append(row)
                print(
                    f"{way:>6} #{i}: healthy after {row['wall_s']:6.1f} s, {row['cpu_s']:6.1f} s of CPU",
                    flush=True,
                )
    tokens = {way: [r["tokens"] for r in rs] for way, rs in rows.items()}
    if len({tuple(t) for ts in tokens.values() for t in ts}) != 1:
        sys.exit(f"the greedy tokens differ between starts: {tokens}")
    med = {
        way: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s")} for way, rs in rows.items()
    }
    print(f"\n{'start':>6} {'wall to healthy (median)':>25} {'CPU (median)':>13}")
    for way in ("spawn", "fork"):
        print(f"{way:>6} {med[way]['wall_s']:>23.1f} s {med[way]['cpu_s']:>11.1f} s")
    print("greedy tokens: equal across all starts")
    print(
        f"sglang start: fork/spawn wall {med['fork']['wall_s'] / med['spawn']['wall_s']:.2f}, "
        f"CPU {med['fork']['cpu_s'] / med['spawn']['cpu_s']:.2f}"
    )


if __name__ == "__main__":
    main()
