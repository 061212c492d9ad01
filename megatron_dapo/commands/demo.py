"""`megatron-dapo demo`: the embedded default. A tiny Qwen2-architecture model learns 2-digit +-
1-digit arithmetic with DAPO on CPU, through the real stack (Ray, 2 Megatron ranks, the HF
engine, weight sync, dynamic sampling, overlong shaping). `--algo grpo` runs the same budget
with GRPO settings for comparison. `--task calculator`: the model learns to use a tool, multi-turn
episodes with a calculator on products it cannot compute; `--no-tools` runs the same budget
without the tool for comparison. `--task longhand`: the arithmetic problems with a warm start that
counts out half of its solutions, longer than the response budget on the long problems, so that
DAPO's length pieces act (configs/demo_longhand.yaml)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import megatron_dapo
from megatron_dapo.config import ConfigError
from megatron_dapo.demo import environment
from megatron_dapo.demo.assets import prepare_demo_assets
from megatron_dapo.demo.calculator.assets import prepare_calculator_assets
from megatron_dapo.demo.judge import judge_overrides, prepare_demo_judge
from megatron_dapo.demo.longhand.assets import prepare_longhand_assets
from megatron_dapo.driver.launch import load_for_cli, run_train
from megatron_dapo.driver.pipeline import WAIT_METRICS
from megatron_dapo.driver.run_dir import read_metrics
from megatron_dapo.errors import set_log_dir

GRPO_OVERRIDES = [
    "algorithm.clip_ratio_high=0.2",
    "algorithm.loss_agg_mode=seq-mean-token-mean",
    "algorithm.filter_groups.enable=false",
    "algorithm.allow_partial_batch=false",
    "algorithm.overlong_buffer.enable=false",
]


def register(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--algo", choices=["dapo", "grpo"], default="dapo")
    p.add_argument(
        "--task",
        choices=["arithmetic", "calculator", "longhand"],
        default="arithmetic",
        help="arithmetic: 2-digit +- 1-digit, single turn; calculator: 3-digit x 2-digit products with a "
        "calculator tool, multi-turn episodes (configs/demo_calculator.yaml); longhand: the arithmetic "
        "problems with a warm start whose counted-out solutions overrun the response budget "
        "(configs/demo_longhand.yaml)",
    )
    p.add_argument(
        "--no-tools",
        action="store_true",
        help="calculator task without the tool (rollout.multi_turn.enable=false), the same budget: the comparison",
    )
    p.add_argument(
        "--engine",
        choices=["hf", "sglang"],
        default="hf",
        help="rollout engine: the in-process HF engine, or real SGLang servers on the CPU "
        "(`make setup-sglang`; sampling there is not seeded, so runs vary)",
    )
    p.add_argument(
        "--judge",
        action="store_true",
        help="arithmetic task rewarded by a tiny generative judge served by SGLang (`make setup-sglang`; "
        "trained first, cached in runs/demo_judge) instead of the rule: reward.model.kind=judge end to end",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the task, the warm start and the run")
    p.add_argument(
        "--assets",
        default=None,
        help="where the tiny model and data are cached (default runs/demo_assets, runs/demo_calculator_assets, "
        "runs/demo_longhand_assets)",
    )
    p.add_argument(
        "--bar-gain",
        type=float,
        default=30.0,
        help="points the held-out accuracy must rise by, else exit 3 (what CI checks; 0 with --bar-final 0: off)",
    )
    p.add_argument(
        "--bar-final",
        type=float,
        default=80.0,
        help="held-out accuracy (%%) the run must end at, else exit 3",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="key=value overrides of configs/demo.yaml (demo_calculator.yaml: --task calculator, "
        "demo_longhand.yaml: --task longhand)",
    )
    p.set_defaults(func=run)


def demo_config_path(name: str = "demo.yaml") -> Path:
    path = Path(megatron_dapo.__file__).resolve().parents[1] / "configs" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the demo from a checkout of megatron-dapo")
    return path


def _prepare(args: argparse.Namespace, console) -> tuple[object, Path, list[str], str]:
    """The task's assets, config file, overrides and run name."""
    if args.task != "calculator" and args.no_tools:
        raise ConfigError(f"--no-tools is for --task calculator (the {args.task} demo has no tools)")
    if args.task == "arithmetic":
        assets = prepare_demo_assets(args.assets or "runs/demo_assets", seed=args.seed, console=console)
        if not args.judge:
            return assets, demo_config_path(), [], f"demo_{args.algo}"
        judge = prepare_demo_judge(f"runs/demo_judge_seed{args.seed}", seed=args.seed, console=console)
        return assets, demo_config_path(), judge_overrides(judge), f"demo_{args.algo}_judge"
    if args.judge:
        raise ConfigError(f"--judge is for --task arithmetic (the {args.task} demo's reward is its rule)")
    if args.task == "longhand":
        assets = prepare_longhand_assets(
            args.assets or "runs/demo_longhand_assets", seed=args.seed, console=console
        )
        return assets, demo_config_path("demo_longhand.yaml"), [], f"demo_longhand_{args.algo}"
    tools = demo_config_path("tools/calculator.yaml")
    assets = prepare_calculator_assets(
        args.assets or "runs/demo_calculator_assets", tools, seed=args.seed, console=console
    )
    overrides = [f"rollout.multi_turn.tool_config_path={tools}"]
    if args.no_tools:
        # Without the tool every episode scores -1: no group has two outcomes, and dynamic sampling
        # would stop the run at step 1 for want of one. Without it the steps run, with zero advantages.
        overrides += [
            "rollout.multi_turn.enable=false",
            "algorithm.filter_groups.enable=false",
            "algorithm.allow_partial_batch=false",
        ]
    name = f"demo_calculator_{args.algo}" + ("_notools" if args.no_tools else "")
    return assets, demo_config_path("demo_calculator.yaml"), overrides, name


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    t0 = time.perf_counter()
    task = (
        "" if args.task == "arithmetic" else f", {args.task}" + (" without the tool" if args.no_tools else "")
    )
    console.rule(f"[bold]megatron-dapo demo ({args.algo.upper()}{task})")
    env = environment.collect()
    console.print(f"[bold]environment[/]: {env.summary()}")
    if env.lock_mismatches:
        console.print(
            f"[yellow]not the locked versions[/] ({', '.join(env.lock_mismatches)}): the README's figures were "
            "measured with requirements/cpu.lock (`make setup` installs it)"
        )
    try:
        assets, config_path, task_overrides, run_name = _prepare(args, console)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    t_assets = time.perf_counter() - t0
    overrides = [
        f"model.path={assets.hf_dir}",
        f"data.train_files=[{assets.train_file}]",
        f"data.val_files=[{assets.val_file}]",
        f"trainer.seed={args.seed}",
        f"trainer.run_name={run_name}" + ("_sglang" if args.engine == "sglang" else ""),
        *task_overrides,
    ]
    if args.engine == "sglang":
        overrides.append("rollout.engine=sglang")
    if args.algo == "grpo":
        overrides += GRPO_OVERRIDES

    try:
        cfg = load_for_cli(str(config_path), overrides + list(args.overrides))
        env.write(Path(cfg.trainer.runs_dir) / cfg.trainer.run_name)
        set_log_dir(Path(cfg.trainer.runs_dir) / cfg.trainer.run_name)
        summary = run_train(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)  # one line: no console wrapping
        return 2
    key = f"val/avg@{cfg.rollout.val.n}"
    before, after, last = held_out_accuracy(summary, key)
    minutes = (time.perf_counter() - t0) / 60
    protocol = f"avg@{cfg.rollout.val.n}, T={cfg.rollout.val.temperature}, top_p={cfg.rollout.val.top_p}"
    console.rule("[bold]result")
    if before is not None and after is not None:
        console.print(
            f"held-out accuracy ({protocol}, {int(last.get('val/num_problems', 0))} problems): "
            f"[bold]{before:.1%} -> {after:.1%}[/] ({(after - before) * 100:+.1f} points) "
            f"in {summary['step']} {args.algo.upper()} steps"
        )
    console.print(f"time: {minutes:.1f} min (including set-up of the model and data)")
    console.print(f"run directory: {summary['run_dir']}  (metrics.jsonl, config.yaml, checkpoints/)")
    if summary.get("plots"):
        console.print(f"plots: {Path(summary['plots'][0]).parent}/ ({len(summary['plots'])} PNGs)")
    if summary.get("hf_export"):
        console.print(f"HF export: {summary['hf_export']}")
    console.print(
        phase_breakdown(t_assets, assets.reused, Path(summary["run_dir"]), time.perf_counter() - t0)
    )
    if after is None:
        console.print("[red]demo failed:[/] no held-out accuracy after training (see metrics.jsonl)")
        return 1
    reason = bar_miss(before, after, args.bar_gain, args.bar_final)
    if reason:
        console.print(f"[red]demo missed the bar:[/] {reason}")
        return 3
    return 0


def held_out_accuracy(summary: dict, key: str) -> tuple[float | None, float | None, dict]:
    """(before, after, the last evaluated step's record) of the run: from this invocation's summary,
    else from the run's metrics.jsonl. A resumed run has no step-0 validation of its own, and one
    resumed after it had finished trains no step: both are in the history it continues."""
    before = (summary.get("val_before") or {}).get(key)
    last = summary.get("last") or {}
    after = last.get(key)
    if before is not None and after is not None:
        return before, after, last
    history = [r for r in read_metrics(Path(summary["run_dir"]) / "metrics.jsonl") if key in r]
    if before is None:
        before = next((r[key] for r in history if r["step"] == 0), None)
    if after is None:
        done = [r for r in history if r["step"] == summary.get("step")]
        if done:
            last = done[-1]
            after = last[key]
    return before, after, last


def bar_miss(before: float | None, after: float, gain_points: float, final_percent: float) -> str | None:
    """Why the run misses the bar (rise by ``gain_points`` AND end at ``final_percent``), or None.
    A bar of 0 is off (``--bar-gain 0``: no rise asked for, a fall included)."""
    misses = []
    if before is not None and gain_points > 0 and (after - before) * 100 < gain_points - 1e-9:
        misses.append(f"rose {(after - before) * 100:+.1f} points, needs +{gain_points:g} (--bar-gain)")
    if after * 100 < final_percent - 1e-9:
        misses.append(f"ended at {after:.1%}, needs {final_percent:g}% (--bar-final)")
    return "; ".join(misses) or None


def phase_breakdown(t_assets: float, reused: bool, run_dir: Path, total: float) -> str:
    """Where the demo's wall time went: warm start, then the trainer's per-step phases summed."""
    sums: dict[str, float] = {}
    for record in read_metrics(run_dir / "metrics.jsonl"):
        for k, v in record.items():
            if (
                k.startswith("timing/")
                and k != "timing/step"
                and k not in WAIT_METRICS
                and isinstance(v, (int, float))
            ):
                sums[k[7:]] = sums.get(k[7:], 0.0) + float(v)
    rows = [("assets (reused)" if reused else "warm start + assets", t_assets)]
    rows += sorted(sums.items(), key=lambda kv: -kv[1])
    rows.append(("other (Ray/worker start, val before, shutdown)", max(total - sum(v for _, v in rows), 0.0)))
    body = "  ".join(f"{name} {sec:.0f}s ({sec / total:.0%})" for name, sec in rows)
    return f"time by phase ({total:.0f}s): {body}"
