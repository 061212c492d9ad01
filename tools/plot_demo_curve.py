"""The README's picture: held-out accuracy (avg@4) of demo runs against the training step.

    python tools/plot_demo_curve.py runs/seed_s0/demo_dapo runs/seed_s1/demo_dapo ... --out docs/demo_curve.png

Each run directory is one line, labelled with its seed (``trainer.seed`` in its config.yaml); the
demo's bar (``--bar-final``, 80%) is drawn dashed. Small on purpose (about 40 KB): it is committed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEY = "val/avg@4"


def curve(run_dir: Path) -> tuple[list[int], list[float]]:
    """(steps, accuracy in %) of the run's held-out evaluations, step 0 first."""
    points = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line of a killed run
        if isinstance(row, dict) and isinstance(row.get(KEY), (int, float)):
            points[int(row["step"])] = 100 * row[KEY]
    if not points:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no {KEY}; is it a demo run directory?")
    steps = sorted(points)
    return steps, [points[s] for s in steps]


def seed_of(run_dir: Path) -> str:
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    return str((cfg.get("trainer") or {}).get("seed", "?"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="demo run directories (runs/NAME/demo_dapo)")
    ap.add_argument("--out", type=Path, default=Path("docs/demo_curve.png"))
    ap.add_argument("--bar", type=float, default=80.0, help="the demo's --bar-final, drawn dashed")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for run in args.runs:
        steps, acc = curve(run)
        ax.plot(steps, acc, marker="o", markersize=3, linewidth=1.2, label=f"seed {seed_of(run)}")
    ax.axhline(args.bar, color="grey", linestyle="--", linewidth=0.8)
    ax.text(0, args.bar + 1, f"bar: {args.bar:g}%", color="grey", fontsize=8)
    ax.set_xlabel("DAPO step")
    ax.set_ylabel("held-out accuracy, avg@4 (%)")
    ax.set_ylim(0, 100)
    ax.set_title("make demo: 200 held-out problems, 4 samples each (T=1.0, top_p=0.7)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    plt.close(fig)
    print(f"{args.out}: {args.out.stat().st_size // 1024} KB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
