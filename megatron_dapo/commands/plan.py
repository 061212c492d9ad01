"""`megatron-dapo plan CONFIG [key=value ...]`: memory, fit and time estimate without GPUs."""

from __future__ import annotations

import argparse
import sys

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.plan import Assumptions, gpu_for, plan_from_config
from megatron_dapo.plan.report import render
from megatron_dapo.plan.sizing import resize


def register(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Read CONFIG (+ overrides) and the model's config.json (or the built-in Qwen2.5 table for "
        "hub names) and print per-role memory, whether it fits, and a rollout/train time split."
    )
    p.add_argument("config", help="YAML recipe, e.g. configs/dapo_qwen2.5_32b.yaml")
    p.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. parallel.pipeline_model_parallel_size=4"
    )
    p.add_argument(
        "--gpu", default="h100", help="h100 (default), h200 or a100: memory, peak FLOPS, bandwidth"
    )
    p.add_argument("--gpu-mem-gb", type=float, default=None, help="GPU memory in GiB (default: the --gpu's)")
    p.add_argument(
        "--num-gpus",
        type=int,
        default=None,
        help="total GPUs (default: from the config); also prints every override that sizes the recipe to them",
    )
    p.add_argument(
        "--print-overrides",
        action="store_true",
        help="with --num-gpus: print only the overrides, on one line (exit 1 when they do not make it fit)",
    )
    p.add_argument(
        "--mean-prompt-len", type=float, default=None, help="assumed mean prompt tokens (default 200)"
    )
    p.add_argument(
        "--mean-response-frac", type=float, default=0.25, help="assumed mean response / max (0.25)"
    )
    p.add_argument(
        "--keep-rate", type=float, default=0.5, help="assumed fraction of mixed-reward groups (0.5)"
    )
    p.add_argument(
        "--decode-tok-s-per-gpu", type=float, default=None, help="measured decode tokens/s per GPU"
    )
    p.add_argument("--mfu", type=float, default=0.30, help="assumed training MFU (0.30)")
    p.add_argument(
        "--env-token-frac",
        type=float,
        default=None,
        help="multi-turn: assumed share of a response that is tool answers, prefilled not decoded (0.15)",
    )
    p.add_argument(
        "--tool-calls-per-episode",
        type=float,
        default=None,
        help="multi-turn: assumed tool calls per episode (4, at most max_assistant_turns - 1)",
    )
    p.add_argument(
        "--tool-s-per-call", type=float, default=0.5, help="multi-turn: assumed seconds per tool call (0.5)"
    )
    p.add_argument(
        "--score-tok-s-per-gpu",
        type=float,
        default=None,
        help="reward.model: measured prefill tokens/s per reward GPU (default: 2 FLOPs a parameter at --mfu)",
    )
    p.add_argument(
        "--verdict-tokens",
        type=float,
        default=8.0,
        help="reward.model judge: assumed tokens of a verdict (8, at most reward.model.max_new_tokens)",
    )
    p.add_argument("--overhead-gb", type=float, default=5.0, help="assumed per-GPU runtime overhead, GiB (5)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    try:
        cfg = load_config(args.config, list(args.overrides))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    for name in ("keep_rate", "mfu", "mean_response_frac"):
        value = getattr(args, name)
        if not 0 < value <= 1:
            print(f"plan: --{name.replace('_', '-')}={value} must be in (0, 1]", file=sys.stderr)
            return 2
    if args.env_token_frac is not None and not 0 <= args.env_token_frac < 1:
        print(
            f"plan: --env-token-frac={args.env_token_frac} must be in [0, 1) (1 would leave nothing to decode)",
            file=sys.stderr,
        )
        return 2
    for name in ("tool_calls_per_episode", "tool_s_per_call", "verdict_tokens"):
        value = getattr(args, name)
        if value is not None and value < 0:
            print(f"plan: --{name.replace('_', '-')}={value} must be >= 0", file=sys.stderr)
            return 2
    if args.score_tok_s_per_gpu is not None and args.score_tok_s_per_gpu <= 0:
        print(f"plan: --score-tok-s-per-gpu={args.score_tok_s_per_gpu} must be > 0", file=sys.stderr)
        return 2
    try:
        gpu = gpu_for(args.gpu, args.gpu_mem_gb)
        assumptions = Assumptions(
            mean_prompt_len=args.mean_prompt_len,
            mean_response_frac=args.mean_response_frac,
            keep_rate=args.keep_rate,
            decode_tok_s_per_gpu=args.decode_tok_s_per_gpu,
            mfu=args.mfu,
            overhead_gib=args.overhead_gb,
            env_token_frac=args.env_token_frac,
            tool_calls_per_episode=args.tool_calls_per_episode,
            tool_s_per_call=args.tool_s_per_call,
            score_tok_s_per_gpu=args.score_tok_s_per_gpu,
            verdict_tokens=args.verdict_tokens,
        )
        if args.num_gpus is not None:
            if args.num_gpus < 1:
                raise ValueError(f"--num-gpus={args.num_gpus} must be >= 1")
            # the whole set for that many GPUs: actor world, TP/PP, engines, memory
            overrides, plan = resize(cfg, args.num_gpus, gpu, assumptions)
        else:
            overrides, plan = [], plan_from_config(cfg, gpu, assumptions)
    except ValueError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    if args.print_overrides:
        print(" ".join(overrides))
        return 0 if plan.fits else 1
    render(plan, Console(width=160))
    if args.num_gpus is not None:
        verdict = "it fits" if plan.fits else "it still does not fit: see the checks above"
        shown = " ".join(overrides) or "none (the config's layout already uses them)"
        print(f"overrides for {args.num_gpus} GPUs ({verdict}): {shown}")
    # Non-zero when something does not fit, so a launch script can refuse a recipe that would OOM.
    return 0 if plan.fits else 1
