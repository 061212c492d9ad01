"""`megatron-dapo ablate`: the DAPO paper's ladder (its Table 1) on a demo task (`--task`).

Each rung adds one technique to the one before, from GRPO to full DAPO:
GRPO -> +overlong filtering -> +clip-higher -> +soft overlong punishment -> +token-level loss
-> +dynamic sampling. Then the variants of full DAPO: the GSPO, CISPO, SAPO or GPG policy loss
instead of the clipped token ratio (`algorithm.policy_loss`), a KL loss to the reference policy
(`actor.use_kl_loss`), and the RLOO or REINFORCE++-baseline advantages (`algorithm.adv_estimator`). Every rung runs on each seed as `megatron-dapo demo` (same task, warm
start and held-out protocol; the warm start is built once per seed and shared). The table gives
the mean and spread of held-out accuracy at equal steps (the last step) and at equal wall time
(the shortest rung's training time; the last evaluation reached by then). A second table gives,
per rung, what the paper plots beside accuracy (policy entropy, mean response length, truncation
rate, share of zero-advantage groups) and the accuracy at equal generated tokens. A PNG shows the
curves. Outputs: OUT/ablation.md, OUT/ablation.json, OUT/ablation.png, one run directory per
rung and seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Each rung's overrides of configs/demo.yaml (which is full DAPO), cumulative down the ladder.
LADDER: list[tuple[str, dict[str, str]]] = [
    (
        "GRPO",
        {
            "algorithm.overlong_filter": "false",
            "algorithm.clip_ratio_high": "0.2",
            "algorithm.overlong_buffer.enable": "false",
            "algorithm.loss_agg_mode": "seq-mean-token-mean",
            "algorithm.filter_groups.enable": "false",
            "algorithm.allow_partial_batch": "false",
        },
    ),
    ("+ overlong filtering", {"algorithm.overlong_filter": "true"}),
    ("+ clip-higher", {"algorithm.clip_ratio_high": "0.28"}),
    ("+ soft overlong punishment", {"algorithm.overlong_buffer.enable": "true"}),
    ("+ token-level loss", {"algorithm.loss_agg_mode": "token-mean"}),
    (
        "+ dynamic sampling (DAPO)",
        {"algorithm.filter_groups.enable": "true", "algorithm.allow_partial_batch": "true"},
    ),
]


# Full DAPO (the last rung) with another policy loss (algo/loss_terms.py), each at its
# published clip setting; everything else (task, steps, sampling) is the ladder's.
LOSS_VARIANTS: list[tuple[str, dict[str, str]]] = [
    (
        "DAPO with GSPO loss",
        # the GSPO paper's sequence-ratio clip range, aggregated per sequence as in verl's recipe
        {
            "algorithm.policy_loss": "gspo",
            "algorithm.clip_ratio_low": "0.0003",
            "algorithm.clip_ratio_high": "0.0004",
            "algorithm.loss_agg_mode": "seq-mean-token-mean",
        },
    ),
    # MiniMax-M1: no lower bound on the clipped weight
    ("DAPO with CISPO loss", {"algorithm.policy_loss": "cispo", "algorithm.clip_ratio_low": "1.0"}),
    # verl's SAPO (compute_policy_loss_sapo) aggregates per sequence, seq-mean-token-mean, whatever
    # loss_agg_mode says; here loss_agg_mode applies, so the rung sets it
    (
        "DAPO with SAPO loss",
        {"algorithm.policy_loss": "sapo", "algorithm.loss_agg_mode": "seq-mean-token-mean"},
    ),
    ("DAPO with GPG loss", {"algorithm.policy_loss": "gpg"}),
    # the KL to the reference policy as GRPO published it (k3 at 0.001), on top of DAPO
    (
        "DAPO with a KL loss (low_var_kl 0.001)",
        {"actor.use_kl_loss": "true", "actor.kl_loss_coef": "0.001", "actor.kl_loss_type": "low_var_kl"},
    ),
    # the other advantage estimators (algo/advantages.py), with DAPO's loss
    ("DAPO with RLOO advantages", {"algorithm.adv_estimator": "rloo"}),
    (
        "DAPO with REINFORCE++-baseline advantages",
        {"algorithm.adv_estimator": "reinforce_plus_plus_baseline"},
    ),
]
RUNGS = LADDER + LOSS_VARIANTS


def rung_overrides(index: int) -> dict[str, str]:
    """The overrides of rung ``index``: on the ladder every rung's up to it, later ones winning;
    a loss variant's on top of the whole ladder."""
    out: dict[str, str] = {}
    for _, overrides in LADDER[: index + 1]:
        out.update(overrides)
    if index >= len(LADDER):
        out.update(RUNGS[index][1])
    return out


# The per-step quantities the DAPO paper plots beside accuracy, as the trainer logs them: the
# policy's entropy on the batch it trains on, and of every response generated that step (the
# groups dynamic sampling dropped included) the mean length, the share cut at the budget, and the
# share of groups whose responses all scored alike, whose samples carry zero advantage.
DYNAMICS: dict[str, str] = {
    "entropy": "actor/entropy",
    "length": "rollout/response_length/mean",
    "truncation": "rollout/truncation_rate",
    "zero_adv": "rollout/zero_spread_fraction",
}
# Steps averaged for a run's "final" dynamics: one step's rollout metrics move by several points.
FINAL_STEPS = 3


@dataclass
class Curve:
    rung: str
    seed: int
    steps: list[int]  # evaluation steps, 0 first
    accuracy: list[float]  # held-out avg@k at those steps
    seconds: list[float]  # training wall time (sum of timing/step) at those steps
    tokens: list[float] = field(default_factory=list)  # tokens generated for training by those steps
    # per training step (1, 2, ...): the DYNAMICS series, NaN where a step did not log one
    train_steps: list[int] = field(default_factory=list)
    dynamics: dict[str, list[float]] = field(default_factory=dict)

    def final(self, name: str) -> float:
        """The mean of ``name`` over the run's last FINAL_STEPS training steps that logged it."""
        values = [v for v in self.dynamics.get(name, []) if v == v][-FINAL_STEPS:]
        return statistics.fmean(values) if values else float("nan")


def read_curve(metrics_path: Path, rung: str, seed: int, key: str) -> Curve:
    steps, acc, secs, toks, elapsed, generated = [], [], [], [], 0.0, 0.0
    train_steps: list[int] = []
    dynamics: dict[str, list[float]] = {name: [] for name in DYNAMICS}
    for line in metrics_path.read_text().splitlines():
        r = json.loads(line)
        elapsed += float(r.get("timing/step", 0.0))
        generated += float(r.get("rollout/tokens_generated", 0.0))
        if "timing/step" in r:
            train_steps.append(int(r["step"]))
            for name, metric in DYNAMICS.items():
                dynamics[name].append(float(r.get(metric, float("nan"))))
        if key in r:
            steps.append(int(r["step"]))
            acc.append(float(r[key]))
            secs.append(elapsed)
            toks.append(generated)
    if not steps:
        raise ValueError(f"{metrics_path} has no {key}: did the run evaluate (trainer.test_freq)?")
    return Curve(rung, seed, steps, acc, secs, toks, train_steps, dynamics)


def accuracy_at_time(curve: Curve, seconds: float) -> float:
    """The last held-out accuracy measured within ``seconds`` of training."""
    return [a for a, s in zip(curve.accuracy, curve.seconds) if s <= seconds + 1e-9][-1]


def accuracy_at_tokens(curve: Curve, tokens: float) -> float:
    """The last held-out accuracy measured within ``tokens`` generated tokens."""
    return [a for a, t in zip(curve.accuracy, curve.tokens) if t <= tokens + 1e-9][-1]


def _spread(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(curves: list[Curve]) -> list[dict]:
    """One row per rung (ladder order): mean/std of start, end (equal steps) and equal-time accuracy."""
    budget = min(max(c.seconds) for c in curves)  # the fastest rung-seed's whole training time
    rows = []
    for rung, _ in RUNGS:
        mine = [c for c in curves if c.rung == rung]
        if not mine:
            continue
        start, start_sd = _spread([c.accuracy[0] for c in mine])
        end, end_sd = _spread([c.accuracy[-1] for c in mine])
        timed, timed_sd = _spread([accuracy_at_time(c, budget) for c in mine])
        rows.append(
            {
                "rung": rung,
                "seeds": sorted(c.seed for c in mine),
                "steps": mine[0].steps[-1],
                "start": start,
                "end": end,
                "end_std": end_sd,
                "gain": end - start,
                "start_std": start_sd,
                "equal_time_s": budget,
                "at_equal_time": timed,
                "at_equal_time_std": timed_sd,
                "train_seconds": statistics.fmean(max(c.seconds) for c in mine),
                **_tokens_and_dynamics(curves, mine),
            }
        )
    return rows


def _tokens_and_dynamics(curves: list[Curve], mine: list[Curve]) -> dict:
    """The equal-generated-tokens accuracy (at the fewest tokens any run generated in all) and the
    final DYNAMICS of one rung, mean and standard deviation over its seeds, and per seed."""
    out: dict = {}
    if all(c.tokens and c.tokens[-1] > 0 for c in curves):
        budget = min(c.tokens[-1] for c in curves)
        out["equal_tokens"] = budget
        out["at_equal_tokens"], out["at_equal_tokens_std"] = _spread(
            [accuracy_at_tokens(c, budget) for c in mine]
        )
        out["tokens"] = statistics.fmean(c.tokens[-1] for c in mine)
    for name in DYNAMICS:
        finals = [c.final(name) for c in sorted(mine, key=lambda c: c.seed)]
        if all(v == v for v in finals):
            out[f"final_{name}"], out[f"final_{name}_std"] = _spread(finals)
            out[f"final_{name}_by_seed"] = finals
    out["end_by_seed"] = [c.accuracy[-1] for c in sorted(mine, key=lambda c: c.seed)]
    return out


def table(rows: list[dict]) -> str:
    if not rows:
        return "(no runs)\n"
    budget = rows[0]["equal_time_s"]
    lines = [
        f"| rung | seeds | start | end (step {rows[0]['steps']}) | gain | at {budget:.0f} s of training | training time |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rung']} | {len(r['seeds'])} | {r['start']:.1%} | {r['end']:.1%} ± {r['end_std']:.1%} "
            f"| {r['gain'] * 100:+.1f} | {r['at_equal_time']:.1%} ± {r['at_equal_time_std']:.1%} "
            f"| {r['train_seconds']:.0f} s |"
        )
    return "\n".join(lines) + "\n"


def dynamics_table(rows: list[dict]) -> str:
    """At the last step: the paper's other curves (entropy, length, truncation, zero-advantage
    share; each the mean of the last FINAL_STEPS steps) and accuracy at equal generated tokens.
    Empty when the runs logged none of them."""
    if not rows or "final_entropy" not in rows[0]:
        return ""
    tokens = rows[0].get("equal_tokens")
    head = f"at {tokens / 1e3:.0f}k generated tokens" if tokens else "at equal tokens"
    lines = [
        f"Last {FINAL_STEPS} steps' mean (per seed in brackets); accuracy also at equal generated tokens "
        "(the fewest any run generated):",
        "",
        f"| rung | end accuracy (per seed) | {head} | entropy | mean length | truncated | zero-advantage groups "
        "| tokens generated |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(r: dict, name: str, fmt: str) -> str:
        if f"final_{name}" not in r:
            return "-"
        seeds = " ".join(format(v, fmt) for v in r[f"final_{name}_by_seed"])
        return f"{r[f'final_{name}']:{fmt}} ± {r[f'final_{name}_std']:{fmt}} ({seeds})"

    for r in rows:
        ends = " ".join(f"{v:.1%}" for v in r["end_by_seed"])
        at_tokens = (
            f"{r['at_equal_tokens']:.1%} ± {r['at_equal_tokens_std']:.1%}" if "at_equal_tokens" in r else "-"
        )
        generated = f"{r['tokens'] / 1e3:.0f}k" if "tokens" in r else "-"
        lines.append(
            f"| {r['rung']} | {r['end']:.1%} ({ends}) | {at_tokens} | {cell(r, 'entropy', '.3f')} "
            f"| {cell(r, 'length', '.1f')} | {cell(r, 'truncation', '.1%')} | {cell(r, 'zero_adv', '.0%')} "
            f"| {generated} |"
        )
    return "\n".join(lines) + "\n"


def plot(curves: list[Curve], path: Path, title: str = "the demo task") -> Path:
    """Held-out accuracy against steps, training time and generated tokens, then the DYNAMICS
    against steps: one line per run, one colour per rung."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20, 8.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = [
        ("entropy", "policy entropy (nats/token)", 1.0),
        ("length", "mean response length (tokens)", 1.0),
        ("truncation", "responses cut at the budget (%)", 100.0),
        ("zero_adv", "groups with zero advantage (%)", 100.0),
    ]
    for i, (rung, _) in enumerate(RUNGS):
        color = colors[i % len(colors)]
        for j, c in enumerate(x for x in curves if x.rung == rung):
            label = rung if j == 0 else None
            acc = [a * 100 for a in c.accuracy]
            axes[0, 0].plot(c.steps, acc, color=color, label=label, alpha=0.8)
            axes[0, 1].plot(c.seconds, acc, color=color, alpha=0.8)
            if c.tokens:
                axes[0, 2].plot([t / 1e3 for t in c.tokens], acc, color=color, alpha=0.8)
            for ax, (name, _, scale) in zip(axes[1], panels):
                if c.dynamics.get(name):
                    ax.plot(c.train_steps, [v * scale for v in c.dynamics[name]], color=color, alpha=0.8)
    for ax, xlabel in zip(axes[0, :3], ("step", "training wall time (s)", "generated tokens (thousands)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out avg@4 (%)")
    for ax, (_, ylabel, _) in zip(axes[1], panels):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    axes[0, 3].axis("off")
    axes[0, 3].legend(handles, labels, loc="center", fontsize=9)
    fig.suptitle(f"DAPO ladder on {title} (one line per seed)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def register(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument(
        "--rungs",
        default="",
        help=f"comma-separated rung numbers: 0-{len(LADDER) - 1} the ladder, {len(LADDER)}-{len(RUNGS) - 1} "
        "the loss variants (default: all)",
    )
    p.add_argument(
        "--task",
        choices=["arithmetic", "longhand"],
        default="arithmetic",
        help="the demo task the ladder runs on (`megatron-dapo demo --task`); longhand: responses that "
        "overrun the budget, where the length pieces act",
    )
    p.add_argument("--out", default=None, help="output directory (default runs/ablate, runs/ablate_longhand)")
    p.add_argument(
        "overrides", nargs="*", help="key=value overrides applied to every run (e.g. trainer.total_steps=40)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out or ("runs/ablate" if args.task == "arithmetic" else f"runs/ablate_{args.task}"))
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    rungs = [int(r) for r in args.rungs.split(",") if r.strip()] or list(range(len(RUNGS)))
    bad = [r for r in rungs if not 0 <= r < len(RUNGS)]
    if bad:
        print(f"--rungs: {bad} not in 0-{len(RUNGS) - 1}", file=sys.stderr)
        return 2
    curves = []
    for seed in seeds:
        for r in rungs:
            name, run_name = RUNGS[r][0], f"rung{r}_seed{seed}"
            metrics = out / "runs" / run_name / "metrics.jsonl"
            if not (out / "runs" / run_name / "summary.json").is_file():  # finished runs are reused
                t0 = time.perf_counter()
                overrides = [f"{k}={v}" for k, v in rung_overrides(r).items()]
                cmd = [
                    sys.executable, "-m", "megatron_dapo.cli", "demo", "--task", args.task, "--seed", str(seed),
                    "--assets", str(out / f"assets_seed{seed}"), "--bar-gain", "0", "--bar-final", "0",
                    f"trainer.runs_dir={out / 'runs'}", f"trainer.run_name={run_name}",
                    "trainer.resume=never", "logging.plots_at_end=false", *overrides, *args.overrides,
                ]  # fmt: skip
                log = out / "logs" / f"{run_name}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                print(f"[ablate] {name}, seed {seed}: running (log {log})", flush=True)
                with log.open("w") as f:
                    rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
                if rc != 0:
                    print(f"[ablate] {name}, seed {seed} failed (exit {rc}); see {log}", file=sys.stderr)
                    return 1
                print(f"[ablate] {name}, seed {seed}: done in {time.perf_counter() - t0:.0f}s", flush=True)
            curve = read_curve(metrics, name, seed, "val/avg@4")
            print(
                f"[ablate] {name}, seed {seed}: " + " ".join(f"{a:.1%}" for a in curve.accuracy), flush=True
            )
            curves.append(curve)
    rows = summarise(curves)
    (out / "ablation.json").write_text(
        json.dumps({"rows": rows, "curves": [asdict(c) for c in curves]}, indent=2) + "\n"
    )
    report = table(rows) + ("\n" + dynamics_table(rows) if dynamics_table(rows) else "")
    (out / "ablation.md").write_text(report)
    png = plot(curves, out / "ablation.png", title=f"the {args.task} demo task")
    print(report)
    print(f"written: {out / 'ablation.md'}, {out / 'ablation.json'}, {png}")
    return 0
