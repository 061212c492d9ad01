"""`megatron-dapo plot RUN_DIR`: PNG curves from a run's metrics.jsonl."""

from __future__ import annotations

import argparse
import sys

from megatron_dapo.driver.plots import plot_run
from megatron_dapo.driver.run_dir import read_metrics_report


def register(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory containing metrics.jsonl (e.g. runs/demo)")
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    metrics = Path(args.run_dir) / "metrics.jsonl"
    try:
        written = plot_run(args.run_dir, args.out)
    except FileNotFoundError as e:
        print(f"plot: {e}", file=sys.stderr)
        return 2
    records, skipped = read_metrics_report(metrics)
    if skipped:
        shown = "; ".join(skipped[:3]) + ("; ..." if len(skipped) > 3 else "")
        print(
            f"plot: skipped {len(skipped)} of {len(records) + len(skipped)} lines of {metrics} ({shown})",
            file=sys.stderr,
        )
    for path in written:
        print(path)
    return 0
