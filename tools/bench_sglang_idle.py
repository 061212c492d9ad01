"""Benchmark rollout.sglang.sleep_on_idle: the CPU an idle SGLang server takes, and whether its
sleep delays the first request after an idle spell.

Starts the CPU test server (`make setup-sglang`) on the demo's model twice, one after the other:
without `--sleep-on-idle`, then with it. For each, measured with psutil (the OS's accounting):
- the CPU seconds of all the server's processes over an idle window of --idle-s seconds;
- the latency of a one-token /generate sent after 1.5 s of idle (median of --requests);
- the latency of the same request back to back (median), the baseline for the one above;
- the latency of a /flush_cache sent after 1.5 s of idle (median; the weight sync sends one).
Prints one row per setting and the ratios with/without. On a GPU node the same spin holds one
host core per server through every actor update and weight sync.

    python tools/bench_sglang_idle.py [--idle-s 10] [--requests 8] [--model runs/demo_assets/hf]

Without --model it builds the tests' small demo assets (5 warm-start steps) in a temporary
directory. Not a test: run it on a quiet machine; the figures move with load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def tree_cpu_s(root) -> float:
    """CPU seconds (user + system) of ``root`` and its live descendants."""
    import psutil

    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def cpu_server_config(model: Path, log_file: Path, **kw):
    """The CPU test server's settings (the product's CPU flags, environment and memory fraction)
    on ``model``, a free port, a 4096-token KV pool; ``kw`` overrides."""
    from megatron_dapo.ports import free_port
    from megatron_dapo.sglang.engines import CPU_MEM_FRACTION, CPU_SERVER_ARGS, cpu_server_env
    from megatron_dapo.sglang.server import SGLangServerConfig

    settings = dict(
        model_path=str(model),
        port=free_port(),
        mem_fraction_static=CPU_MEM_FRACTION,
        dtype="float32",
        extra_args=list(CPU_SERVER_ARGS),
        env=cpu_server_env(),
        max_total_tokens=4096,
        log_file=str(log_file),
    )
    return SGLangServerConfig(**{**settings, **kw})


def demo_model(tmp: Path, model: Path | None) -> Path:
    """``model``, or the tests' small demo assets (5 warm-start steps) built under ``tmp``."""
    if model is not None:
        return model
    from megatron_dapo.demo.assets import prepare_demo_assets

    return Path(prepare_demo_assets(tmp / "assets", sft_steps=5, eval_problems=4).hf_dir)


def measure(model: Path, log_dir: Path, sleep_on_idle: bool, idle_s: float, requests: int) -> dict:
    import httpx
    import psutil

    from megatron_dapo.sglang.server import SGLangServer

    cfg = cpu_server_config(
        model, log_dir / f"sglang_sleep_{int(sleep_on_idle)}.log", sleep_on_idle=sleep_on_idle
    )
    server = SGLangServer(cfg).start()
    try:
        server.wait_healthy()
        root = psutil.Process(server.proc.pid)
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}}
        with httpx.Client(base_url=cfg.url, timeout=120) as client:

            def generate() -> float:
                start = time.monotonic()
                client.post("/generate", json=body).raise_for_status()
                return time.monotonic() - start

            generate()  # the first request after start-up pays its own warm-up
            before = tree_cpu_s(root)
            time.sleep(idle_s)  # the measured window
            idle_cpu = tree_cpu_s(root) - before
            after_idle = []
            for _ in range(requests):
                time.sleep(1.5)
                after_idle.append(generate())
            back_to_back = [generate() for _ in range(requests)]
            flushes = []
            for _ in range(requests):
                time.sleep(1.5)
                start = time.monotonic()
                client.post("/flush_cache").raise_for_status()
                flushes.append(time.monotonic() - start)
    finally:
        server.stop()
    return {
        "idle_cpu_per_s": idle_cpu / idle_s,
        "after_idle_ms": 1000 * statistics.median(after_idle),
        "back_to_back_ms": 1000 * statistics.median(back_to_back),
        "flush_ms": 1000 * statistics.median(flushes),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--model", type=Path, default=None, help="an HF checkpoint (default: build one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_sglang_idle_") as tmp:
        tmp = Path(tmp)
        model = demo_model(tmp, args.model)
        rows = {}
        for flag in (False, True):
            print(f"starting a CPU server, sleep_on_idle={flag} ...", flush=True)
            rows[flag] = measure(model, tmp, flag, args.idle_s, args.requests)
    print(
        f"\n{'sleep_on_idle':>14} {'idle CPU (cores)':>17} {'after 1.5 s idle':>17} {'back to back':>13} {'flush':>10}"
    )
    for flag, r in rows.items():
        print(
            f"{str(flag):>14} {r['idle_cpu_per_s']:>17.3f} {r['after_idle_ms']:>14.1f} ms "
            f"{r['back_to_back_ms']:>10.1f} ms {r['flush_ms']:>7.1f} ms"
        )
    off, on = rows[False], rows[True]
    print(
        f"\nwith/without: idle CPU {on['idle_cpu_per_s'] / max(off['idle_cpu_per_s'], 1e-9):.3f}x, "
        f"latency after idle {on['after_idle_ms'] / off['after_idle_ms']:.2f}x, "
        f"flush {on['flush_ms'] / off['flush_ms']:.2f}x"
    )


if __name__ == "__main__":
    main()
