"""Build (or reuse) what `megatron-dapo demo --task longhand` needs: data, tokenizer, and a
checkpoint warm-started by the two-style teacher (``teacher.py``), with its measured lengths."""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_dapo.demo.accuracy import sampled_accuracy
from megatron_dapo.demo.longhand.recipe import LONGHAND_RECIPE, LonghandRecipe
from megatron_dapo.demo.longhand.task import make_problems
from megatron_dapo.demo.longhand.teacher import LengthStats, Teacher, length_stats, work_accuracy
from megatron_dapo.demo.model import create_model, save_checkpoint
from megatron_dapo.demo.sft import SFTConfig, supervised_warm_start
from megatron_dapo.demo.task import to_rows, write_parquet
from megatron_dapo.demo.tokenizer import build_tokenizer
from megatron_dapo.driver.progress import heartbeat

# Bump when the task, tokenizer, model or warm start change, so cached assets are rebuilt.
ASSETS_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class LonghandAssets:
    root: Path
    hf_dir: Path
    train_file: Path
    val_file: Path
    initial_accuracy: float  # held-out avg@k, the demo's protocol
    lengths: LengthStats  # the warm start's sampled responses under the budget, as rollouts sample
    seed: int
    sft_steps: int
    sft_seconds: float
    reused: bool


def _cache_key(recipe: LonghandRecipe, seed: int, sft_steps: int, eval_problems: int | None) -> dict:
    return {
        "version": ASSETS_VERSION,
        "seed": seed,
        "sft_max_steps": sft_steps,
        "recipe": asdict(recipe),
        "eval_problems": eval_problems,
    }


def _from_manifest(root: Path, data: dict, reused: bool) -> LonghandAssets:
    return LonghandAssets(
        root=root,
        hf_dir=root / "hf",
        train_file=root / "train.parquet",
        val_file=root / "val.parquet",
        initial_accuracy=data["initial_accuracy"],
        lengths=LengthStats(**data["lengths"]),
        seed=data["key"]["seed"],
        sft_steps=data["sft_steps"],
        sft_seconds=data["sft_seconds"],
        reused=reused,
    )


def _load_cached(root: Path, key: dict) -> LonghandAssets | None:
    try:
        data = json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if data.get("key") != key:
        return None
    assets = _from_manifest(root, data, reused=True)
    needed = (
        assets.train_file,
        assets.val_file,
        assets.hf_dir / "config.json",
        assets.hf_dir / "model.safetensors",
    )
    return assets if all(p.is_file() for p in needed) else None


def describe(lengths: LengthStats, budget: int) -> str:
    return (
        f"{lengths.samples} sampled responses: mean {lengths.mean:.1f} tokens, p50 {lengths.p50:.0f}, "
        f"p90 {lengths.p90:.0f}, {lengths.truncated:.1%} cut at the {budget}-token budget, "
        f"{lengths.longhand:.0%} longhand"
    )


def prepare_longhand_assets(
    out_dir: str | Path,
    seed: int = 0,
    force: bool = False,
    *,
    sft_steps: int | None = None,
    recipe: LonghandRecipe = LONGHAND_RECIPE,
    eval_problems: int | None = None,
    console=None,
) -> LonghandAssets:
    """Write train/val parquet and a warm-started checkpoint under ``out_dir``; reuse them when
    its manifest records the same inputs (``force``: rebuild).

    The warm start stops when the greedy work, each style forced, is right on
    ``recipe.sft_stop_accuracy`` of a probe of training problems (at most ``sft_steps`` steps,
    default the recipe's). Then the held-out accuracy (the demo's protocol) and the length
    distribution of responses sampled as the rollouts sample, both on ``eval_problems``
    held-out problems (default all), go into the manifest.
    """
    import torch
    from rich.console import Console

    console = console or Console()
    root = Path(out_dir)
    steps = recipe.sft_steps if sft_steps is None else sft_steps
    key = _cache_key(recipe, seed, steps, eval_problems)
    if not force:
        cached = _load_cached(root, key)
        if cached is not None:
            console.print(
                f"[green]longhand demo assets[/] reused from {root} (seed {seed}, {cached.sft_steps} SFT steps, "
                f"initial held-out accuracy {cached.initial_accuracy:.1%}; "
                f"{describe(cached.lengths, recipe.max_response_length)})"
            )
            return cached

    root.mkdir(parents=True, exist_ok=True)
    (root / MANIFEST).unlink(missing_ok=True)  # a half-built directory must not look cached
    train, val = make_problems(seed, recipe.num_train, recipe.num_val)
    write_parquet(to_rows(train, "train"), root / "train.parquet")
    write_parquet(to_rows(val, "test"), root / "val.parquet")
    console.print(
        f"[bold]longhand task[/]: {len(train)} train / {len(val)} held-out problems, e.g. {val[0].question!r}"
    )
    tokenizer = build_tokenizer(recipe.model.vocab_size)
    model = create_model(recipe.model, tokenizer, seed=seed)
    teacher = Teacher(tokenizer, recipe.sft_longhand_rate, seed)
    config = SFTConfig(
        steps=steps,
        batch_size=recipe.sft_batch_size,
        lr=recipe.sft_lr,
        seed=seed,
        stop_accuracy=recipe.sft_stop_accuracy,
        check_every=recipe.sft_check_every,
        min_steps=recipe.sft_min_steps,
        lazy_rate=recipe.sft_lazy_rate,
    )
    probe_set = random.Random(seed).sample(train, min(recipe.sft_probe_problems, len(train)))
    state = {"step": 0, "loss": float("nan"), "probe": None}

    def probe(m) -> float:
        state["probe"] = work_accuracy(m, tokenizer, probe_set)
        return state["probe"]

    def on_step(s: int, loss: float) -> None:
        state.update(step=s, loss=loss)

    def line(elapsed: float) -> str:
        probe_text = "" if state["probe"] is None else f", last probe {state['probe']:.0%}"
        return (
            f"warm start (SFT, {recipe.sft_longhand_rate:.0%} of examples longhand) step {state['step']}/{steps} "
            f"loss {state['loss']:.3f}{probe_text}, {elapsed:.0f}s (stops when the work in both styles is right "
            f"on {recipe.sft_stop_accuracy:.0%} of the probe)"
        )

    # One thread, as the calculator demo's warm start measured: beside other work two threads'
    # spin-waits lose their core and a step takes several times longer. The run sets its own.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with heartbeat(console, line):
            result = supervised_warm_start(
                model, tokenizer, train, config, on_step=on_step, probe=probe, encode=teacher.encode
            )
        held_out = val if eval_problems is None else val[:eval_problems]
        with torch.no_grad(), heartbeat(console, lambda t: f"held-out check of the warm start... {t:.0f}s"):
            acc = sampled_accuracy(
                model,
                tokenizer,
                held_out,
                k=recipe.val_k,
                temperature=recipe.val_temperature,
                top_p=recipe.val_top_p,
                max_new_tokens=recipe.max_response_length,
                seed=recipe.val_seed,
            )
            lengths = length_stats(
                model,
                tokenizer,
                held_out,
                k=recipe.val_k,
                budget=recipe.max_response_length,
                temperature=recipe.rollout_temperature,
                top_p=1.0,
                seed=recipe.val_seed,
            )
    finally:
        torch.set_num_threads(threads)
    save_checkpoint(model, tokenizer, root / "hf")
    data = {
        "key": key,
        "initial_accuracy": acc.mean,
        "lengths": asdict(lengths),
        "sft_steps": result.steps,
        "sft_probe_accuracy": result.probe_accuracy,
        "sft_seconds": round(result.seconds, 2),
        "sft_final_loss": result.final_loss,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (root / MANIFEST).write_text(json.dumps(data, indent=2))
    console.print(
        f"[green]warm start done[/] in {result.steps} steps, {result.seconds:.1f}s (loss {result.final_loss:.3f}, "
        f"probe {result.probe_accuracy}); held-out avg@{acc.samples_per_problem}: {acc.mean:.1%}; "
        f"{describe(lengths, recipe.max_response_length)}"
    )
    return _from_manifest(root, data, reused=False)
