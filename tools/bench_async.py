"""Benchmark trainer.mode=one_step_off and async (max_staleness K) against sync on the demo task.

The actor (one Megatron rank, TP=1) and the HF rollout engine are pinned to separate CPU cores
(``sched_setaffinity`` on the Ray worker processes as they appear), so generation and training
can really overlap on a 2-core machine. Each mode trains ``--steps`` steps from the same warm
start with the same seed; the held-out accuracy is the validation at the last step.

Measured per mode over the steady-state window (steps 2 .. N-1: step 1 of one_step_off is
synchronous, and its last step has nothing to prefetch):
- seconds per step: wall clock between the metrics lines of step 1 and step N-1, / (N-2);
- engine / actor idle fraction: 1 - CPU seconds the pinned process used in the window / wall
  seconds of the window (each has one core; the OS's accounting, not the trainer's metrics);
- the trainer's own view: mean timing/actor_wait_data_s and timing/engine_wait_weights_s.

    python tools/bench_async.py [--steps 8] [--seeds 0,1] [--assets runs/demo_assets]
        [--modes sync,one_step_off,async:2] [--actor-core 0 --engine-core 1]
        [key=value overrides for every mode]

`async:K` is trainer.mode=async with trainer.max_staleness=K. Prints one row per run, the
held-out range over the seeds, and each mode's ratio of mean steps per second to sync. Not a test: run it on a
quiet machine; the figures move with load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TICK_S = 0.05


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(root: int) -> list[int]:
    tree, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(tree.get(pid, []))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _cpu_seconds(pid: int) -> float:
    """utime + stime of the process (all its threads), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pin(pid: int, core: int) -> None:
    """Every thread of the process (affinity is per thread; new ones inherit their creator's)."""
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            if os.sched_getaffinity(int(tid)) != {core}:
                os.sched_setaffinity(int(tid), {core})
        except OSError:  # the thread ended meanwhile
            pass


class Watcher(threading.Thread):
    """Pins the run's actor rank and engine to their cores and timestamps each metrics line
    with the CPU seconds both had used by then."""

    def __init__(self, proc: subprocess.Popen, metrics: Path, actor_core: int, engine_core: int):
        super().__init__(daemon=True)
        self.proc, self.metrics = proc, metrics
        self.cores = {"ray::ActorWorker": actor_core, "ray::EngineHost": engine_core}
        self.pids: dict[str, int] = {}
        self.marks: dict[int, tuple[float, float, float]] = {}  # step -> (wall, actor cpu, engine cpu)

    def run(self) -> None:
        seen = 0
        while self.proc.poll() is None:
            if len(self.pids) < len(self.cores):
                for pid in _descendants(self.proc.pid):
                    title = _cmdline(pid)
                    for role in self.cores:
                        if role not in self.pids and title.startswith(role):
                            self.pids[role] = pid
            for role, pid in self.pids.items():
                _pin(pid, self.cores[role])
            if self.metrics.is_file():
                lines = self.metrics.read_text().splitlines()
                for line in lines[seen:]:
                    if not line.endswith("}"):
                        break  # a line still being written
                    step = json.loads(line)["step"]
                    now = time.perf_counter()
                    a = _cpu_seconds(self.pids.get("ray::ActorWorker", -1))
                    e = _cpu_seconds(self.pids.get("ray::EngineHost", -1))
                    self.marks[step] = (now, a, e)
                    seen += 1
            time.sleep(TICK_S)


def run_mode(spec: str, seed: int, args, runs: Path) -> dict:
    """`spec`: a trainer.mode, or async:K."""
    mode, _, k = spec.partition(":")
    a = Path(args.assets)
    over = {
        "model.path": a / "hf",
        "data.train_files": f"[{a / 'train.parquet'}]",
        "data.val_files": f"[{a / 'val.parquet'}]",
        "parallel.tensor_model_parallel_size": 1,
        "parallel.actor_world_size": 1,
        "trainer.runs_dir": runs,
        "trainer.run_name": f"{mode}{k}_{seed}",
        "trainer.seed": seed,
        "trainer.total_steps": args.steps,
        "trainer.test_freq": args.steps,
        "trainer.val_before_train": "false",
        "trainer.save_freq": 0,
        "trainer.hf_export_at_end": "false",
        "trainer.resume": "never",
        "trainer.mode": mode,
        "trainer.max_staleness": int(k or 1),
        "trainer.placement": "disaggregated",
        "logging.progress": "false",
        "logging.plots_at_end": "false",
    }
    cmd = [sys.executable, "-m", "megatron_dapo.cli", "train", str(REPO / "configs/demo.yaml")]
    cmd += [f"{k}={v}" for k, v in over.items()] + list(args.override)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run = runs / f"{mode}{k}_{seed}"
    watcher = Watcher(proc, run / "metrics.jsonl", args.actor_core, args.engine_core)
    watcher.start()
    _, err = proc.communicate()
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"bench_async: the {spec} run failed (exit {proc.returncode}):\n{err[-3000:]}")
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    first, last = 1, args.steps - 1
    (t0, a0, e0), (t1, a1, e1) = watcher.marks[first], watcher.marks[last]
    wall = t1 - t0
    window = [records[s] for s in range(first + 1, last + 1)]
    val_key = next(k for k in records[args.steps] if k.startswith("val/avg@"))
    return {
        "mode": spec,
        "seed": seed,
        "s_per_step": wall / (last - first),
        "engine_idle": 1 - (e1 - e0) / wall,
        "actor_idle": 1 - (a1 - a0) / wall,
        "actor_wait_data_s": sum(r["timing/actor_wait_data_s"] for r in window) / len(window),
        "engine_wait_weights_s": sum(r["timing/engine_wait_weights_s"] for r in window) / len(window),
        "staleness": sum(r["rollout/staleness_token_mean"] for r in window) / len(window),
        "val_key": val_key,
        "val": records[args.steps][val_key],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="steps per mode (>= 4)")
    p.add_argument("--assets", default=str(REPO / "runs/demo_assets"), help="prepare_demo_assets output")
    p.add_argument("--actor-core", type=int, default=0)
    p.add_argument("--engine-core", type=int, default=1)
    p.add_argument(
        "--modes", default="sync,one_step_off,async:2", help="trainer.mode values; async:K sets max_staleness"
    )
    p.add_argument("--seeds", default="0", help="trainer.seed of each repeat (the accuracy spread)")
    p.add_argument("override", nargs="*", help="extra config overrides for both runs (key=value)")
    args = p.parse_args()
    if args.steps < 4:
        raise SystemExit("bench_async: --steps must be >= 4 (the window is steps 2 .. N-1)")
    if not (Path(args.assets) / "hf" / "config.json").is_file():
        from megatron_dapo.demo.assets import prepare_demo_assets

        print(f"preparing the demo assets in {args.assets} (the demo's warm start)", flush=True)
        prepare_demo_assets(args.assets)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        for seed in map(int, args.seeds.split(",")):  # modes alternate: load drifts hit both
            for mode in args.modes.split(","):
                print(f"running {mode} seed {seed}: {args.steps} steps", flush=True)
                results.append(run_mode(mode, seed, args, Path(tmp)))
    print(
        f"\n{'mode':<14}{'seed':>5}{'s/step':>8}{'engine idle':>13}{'actor idle':>12}{'actor wait':>12}"
        f"{'engine wait':>13}{'staleness':>11}  held-out"
    )
    for r in results:
        print(
            f"{r['mode']:<14}{r['seed']:>5}{r['s_per_step']:>8.2f}{r['engine_idle']:>13.2f}{r['actor_idle']:>12.2f}"
            f"{r['actor_wait_data_s']:>11.2f}s{r['engine_wait_weights_s']:>12.2f}s{r['staleness']:>11.2f}"
            f"  {r['val_key']} {r['val']:.3f}"
        )
    by_mode: dict[str, list[dict]] = {}
    for r in results:
        by_mode.setdefault(r["mode"], []).append(r)
    for mode, rows in by_mode.items():
        vals = [r["val"] for r in rows]
        print(
            f"{mode}: mean s/step {_mean(r['s_per_step'] for r in rows):.2f}, held-out {min(vals):.3f}..{max(vals):.3f}"
        )
    if "sync" in by_mode:
        base = _mean(r["s_per_step"] for r in by_mode["sync"])
        for mode, rows in by_mode.items():
            if mode != "sync":
                ratio = base / _mean(r["s_per_step"] for r in rows)
                print(f"{mode}/sync steps per second: {ratio:.2f}x (steps 2..{args.steps - 1}, same run)")


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


if __name__ == "__main__":
    main()
