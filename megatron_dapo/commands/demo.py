"""`megatron-dapo demo`: the embedded default. A tiny Qwen2-architecture model learns 2-digit +-
1-digit arithmetic with DAPO on CPU, through the real stack (Ray, 2 Megatron ranks, the HF
engine, weight sync, dynamic sampling, overlong shaping). `--algo grpo` runs the same budget
with GRPO settings for comparison."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

GRPO_OVERRIDES = [
    "algorithm.clip_ratio_high=0.2",
    "algorithm.loss_agg_mode=seq-mean-token-mean",
    "algorithm.filter_groups.enable=false",
    "algorithm.allow_partial_batch=false",
    "algorithm.overlong_buffer.enable=false",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="DAPO on a tiny model on CPU, in minutes (what `make demo` runs)", description=__doc__
    )
    p.add_argument("--algo", choices=["dapo", "grpo"], default="dapo")
    p.add_argument("--seed", type=int, default=0, help="seed of the task, the warm start and the run")
    p.add_argument("--assets", default="runs/demo_assets", help="where the tiny model and data are cached")
    p.add_argument("overrides", nargs="*", help="key=value overrides of configs/demo.yaml")
    p.set_defaults(func=run)


def demo_config_path() -> Path:
    import megatron_dapo

    path = Path(megatron_dapo.__file__).resolve().parents[1] / "configs" / "demo.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run the demo from a checkout of megatron-dapo")
    return path


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from megatron_dapo.config import ConfigError
    from megatron_dapo.demo.assets import prepare_demo_assets
    from megatron_dapo.driver.launch import load_for_cli, run_train

    console = Console(stderr=True)
    t0 = time.perf_counter()
    console.rule(f"[bold]megatron-dapo demo ({args.algo.upper()})")
    assets = prepare_demo_assets(args.assets, seed=args.seed, console=console)
    overrides = [
        f"model.path={assets.hf_dir}",
        f"data.train_files=[{assets.train_file}]",
        f"data.val_files=[{assets.val_file}]",
        f"trainer.seed={args.seed}",
        f"trainer.run_name=demo_{args.algo}",
    ]
    if args.algo == "grpo":
        overrides += GRPO_OVERRIDES
    try:
        cfg = load_for_cli(str(demo_config_path()), overrides + list(args.overrides))
        summary = run_train(cfg)
    except ConfigError as e:
        console.print(f"[red]config error:[/] {e}")
        return 2
    key = f"val/avg@{cfg.rollout.val.n}"
    before = (summary.get("val_before") or {}).get(key)
    after = (summary.get("last") or {}).get(key)
    minutes = (time.perf_counter() - t0) / 60
    protocol = f"avg@{cfg.rollout.val.n}, T={cfg.rollout.val.temperature}, top_p={cfg.rollout.val.top_p}"
    console.rule("[bold]result")
    if before is not None and after is not None:
        console.print(
            f"held-out accuracy ({protocol}, {int(summary['last'].get('val/num_problems', 0))} problems): "
            f"[bold]{before:.1%} -> {after:.1%}[/] ({(after - before) * 100:+.1f} points) "
            f"in {summary['step']} {args.algo.upper()} steps"
        )
    console.print(f"time: {minutes:.1f} min (including set-up of the model and data)")
    console.print(f"run directory: {summary['run_dir']}  (metrics.jsonl, config.yaml, checkpoints/)")
    if summary.get("plots"):
        console.print(f"plots: {Path(summary['plots'][0]).parent}/ ({len(summary['plots'])} PNGs)")
    if summary.get("hf_export"):
        console.print(f"HF export: {summary['hf_export']}")
    return 0 if after is not None else 1
