"""Benchmark OpenMP's wait policy for the CPU path: the demo's tiny model trained (forward,
backward, AdamW) in two processes at once on the machine's cores, as `make test`'s two workers and
a run's processes share a 2-core machine, with OMP_WAIT_POLICY unset (libgomp spins a while
before it sleeps) and PASSIVE (its threads sleep at once). The Makefile and the CLI set PASSIVE.

    python tools/bench_omp_wait.py [--steps 60] [--processes 2] [--repeats 2]

Each mode runs ``--repeats`` times, alternating; the last line is
``omp wait: unset X s, PASSIVE Y s, ratio X/Y`` (medians of the slowest process's time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

WORK = """
import sys, time, torch
from megatron_dapo.demo.model import TinyModelSpec, create_model
from megatron_dapo.demo.tokenizer import build_tokenizer
tok = build_tokenizer(128)
model = create_model(TinyModelSpec(), tok)
opt = torch.optim.AdamW(model.parameters(), 1e-3)
x = torch.randint(6, 100, (64, 40))
start = time.perf_counter()
for _ in range(int(sys.argv[1])):
    loss = model(input_ids=x, labels=x).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
print(time.perf_counter() - start)
"""


def run(policy: str | None, steps: int, processes: int) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    env["PYTHONPATH"] = str(REPO)
    procs = [
        subprocess.Popen([sys.executable, "-c", WORK, str(steps)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    return max(float(p.communicate()[0].strip().splitlines()[-1]) for p in procs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    times: dict[str, list[float]] = {"unset": [], "PASSIVE": []}
    for _ in range(args.repeats):
        for name, policy in (("unset", None), ("PASSIVE", "PASSIVE")):
            t0 = time.perf_counter()
            times[name].append(run(policy, args.steps, args.processes))
            print(f"{name}: {times[name][-1]:.1f} s (wall {time.perf_counter() - t0:.1f} s)", flush=True)
    unset, passive = statistics.median(times["unset"]), statistics.median(times["PASSIVE"])
    print(f"omp wait: unset {unset:.1f} s, PASSIVE {passive:.1f} s, ratio {unset / passive:.2f}")


if __name__ == "__main__":
    main()
