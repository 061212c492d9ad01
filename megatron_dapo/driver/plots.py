"""PNG curves of a run, the ones the DAPO release shows plus the trainer's health signals.

Each figure is drawn only from the metrics keys present, so a partial or old run still plots.
"""

from __future__ import annotations

from pathlib import Path

from megatron_dapo.driver.run_dir import read_metrics

# figure file -> (title, [(metrics key, label), ...])
FIGURES: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "reward.png": ("Reward and accuracy", [("rollout/reward/mean", "reward"), ("rollout/acc/mean", "acc")]),
    "response_length.png": (
        "Response length",
        [("rollout/response_length/mean", "mean"), ("rollout/response_length/max", "max")],
    ),
    "clip_ratio.png": ("Truncated responses", [("rollout/response_length/clip_ratio", "clip ratio")]),
    "entropy.png": (
        "Entropy and mean token probability",
        [("actor/entropy", "entropy"), ("rollout/mean_token_prob", "mean token prob")],
    ),
    "clipfrac.png": (
        "PPO clip fractions",
        [
            ("actor/pg_clipfrac", "clipfrac"),
            ("actor/pg_clipfrac_high", "high"),
            ("actor/pg_clipfrac_low", "low"),
            ("actor/pg_clipfrac_lower", "dual-clip"),
        ],
    ),
    "keep_rate.png": (
        "Dynamic sampling",
        [("rollout/keep_rate", "keep rate"), ("rollout/gen_rounds", "generation rounds")],
    ),
    "mismatch.png": (
        "Train / inference mismatch",
        [
            ("actor/rollout_logprob_abs_diff", "mean |diff|"),
            ("actor/rollout_k3_kl", "k3 KL"),
            ("actor/ppo_kl", "ppo_kl"),
        ],
    ),
    "grad_norm.png": ("Gradient norm", [("actor/grad_norm", "grad norm")]),
}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the PNGs for `run_dir/metrics.jsonl`; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    if not records:
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl has no step records to plot")
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    figures = dict(FIGURES)
    val_keys = sorted({k for r in records for k in r if k.startswith("val/") and "@" in k})
    if val_keys:
        figures["val.png"] = ("Validation accuracy", [(k, k.removeprefix("val/")) for k in val_keys])
    for name, (title, series) in figures.items():
        lines = []
        for key, label in series:
            pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if pts:
                lines.append((label, pts))
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for label, pts in lines:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
