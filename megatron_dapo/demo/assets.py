"""Build (or reuse) everything `make demo` needs: data, tokenizer, warm-started HF checkpoint."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_dapo.demo.accuracy import sampled_accuracy, worked_line_accuracy
from megatron_dapo.demo.model import create_model, save_checkpoint
from megatron_dapo.demo.recipe import DEMO_RECIPE, DemoRecipe
from megatron_dapo.demo.sft import SFTConfig, supervised_warm_start
from megatron_dapo.demo.task import make_problems, to_rows, write_parquet
from megatron_dapo.demo.tokenizer import build_tokenizer
from megatron_dapo.driver.progress import heartbeat

# Bump when the task, tokenizer, model or warm start change, so cached assets are rebuilt.
ASSETS_VERSION = 3
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class DemoAssets:
    """Paths and facts about one prepared asset directory."""

    root: Path
    hf_dir: Path
    train_file: Path
    val_file: Path
    initial_accuracy: float
    initial_accuracy_k: int
    seed: int
    sft_steps: int  # steps actually run (the warm start may stop early at its probe target)
    sft_seconds: float
    reused: bool


def _cache_key(recipe: DemoRecipe, seed: int, sft_steps: int) -> dict:
    return {
        "version": ASSETS_VERSION,
        "seed": seed,
        "sft_max_steps": sft_steps,
        "sft": [
            recipe.sft_stop_accuracy,
            recipe.sft_min_steps,
            recipe.sft_check_every,
            recipe.sft_probe_problems,
            recipe.sft_lazy_rate,
            recipe.sft_lr,
            recipe.sft_batch_size,
        ],
        "model": asdict(recipe.model),
        "num_train": recipe.num_train,
        "num_val": recipe.num_val,
        "eval": [recipe.val_k, recipe.val_temperature, recipe.val_top_p, recipe.val_seed],
    }


def _load_cached(root: Path, key: dict) -> DemoAssets | None:
    manifest = root / MANIFEST
    if not manifest.is_file():
        return None
    try:
        data = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return None
    if data.get("key") != key:
        return None
    assets = _assets_from(root, data, reused=True)
    needed = (
        assets.train_file,
        assets.val_file,
        assets.hf_dir / "config.json",
        assets.hf_dir / "model.safetensors",
    )
    return assets if all(p.is_file() for p in needed) else None


def _assets_from(root: Path, data: dict, reused: bool) -> DemoAssets:
    return DemoAssets(
        root=root,
        hf_dir=root / "hf",
        train_file=root / "train.parquet",
        val_file=root / "val.parquet",
        initial_accuracy=data["initial_accuracy"],
        initial_accuracy_k=data["initial_accuracy_k"],
        seed=data["key"]["seed"],
        sft_steps=data["sft_steps"],
        sft_seconds=data["sft_seconds"],
        reused=reused,
    )


def prepare_demo_assets(
    out_dir: str | Path,
    seed: int = 0,
    force: bool = False,
    *,
    sft_steps: int | None = None,
    recipe: DemoRecipe = DEMO_RECIPE,
    eval_problems: int | None = None,
    console=None,
) -> DemoAssets:
    """Write train/val parquet, tokenizer and a warm-started Qwen2 checkpoint under ``out_dir``.

    The warm start (a lazy teacher, see ``demo.sft``) runs until the greedy worked line ("a + b =
    c") is right on ``recipe.sft_stop_accuracy`` of ``recipe.sft_probe_problems`` training
    problems (at most ``sft_steps`` steps). The initial held-out accuracy uses the evaluation protocol (avg@``val_k`` at
    ``val_temperature`` / ``val_top_p``, seeded by ``val_seed``). Reuses an existing directory
    when its manifest records the same seed, SFT settings, model shape, protocol and asset
    version (``force=True`` rebuilds). ``sft_steps`` overrides the recipe's most warm-start steps (tests use a few);
    ``eval_problems`` limits the held-out problems used to measure the initial accuracy (default:
    all of val). Progress goes to a rich ``console``.
    """
    import random

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    root = Path(out_dir)
    steps = recipe.sft_steps if sft_steps is None else sft_steps
    key = _cache_key(recipe, seed, steps)
    if not force:
        cached = _load_cached(root, key)
        if cached is not None:
            console.print(
                f"[green]demo assets[/] reused from {root} (seed {seed}, {cached.sft_steps} SFT steps, "
                f"initial held-out accuracy {cached.initial_accuracy:.1%})"
            )
            return cached

    root.mkdir(parents=True, exist_ok=True)
    (root / MANIFEST).unlink(missing_ok=True)  # a half-built directory must not look cached
    train, val = make_problems(seed, recipe.num_train, recipe.num_val)
    write_parquet(to_rows(train, "train"), root / "train.parquet")
    write_parquet(to_rows(val, "test"), root / "val.parquet")
    console.print(
        f"[bold]demo task[/]: {len(train)} train / {len(val)} held-out problems, e.g. {val[0].question!r}"
    )

    tokenizer = build_tokenizer(recipe.model.vocab_size)
    model = create_model(recipe.model, tokenizer, seed=seed)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"[bold]model[/]: Qwen2 {recipe.model.num_hidden_layers} layers x {recipe.model.hidden_size} hidden, "
        f"{n_params / 1e3:.0f}k parameters, vocab {recipe.model.vocab_size}"
    )

    cfg = SFTConfig(
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
        state["probe"] = worked_line_accuracy(m, tokenizer, probe_set, recipe.max_response_length)
        return state["probe"]

    def on_step(s: int, loss: float) -> None:
        state.update(step=s, loss=loss)
        bar.update(task, completed=s, loss=loss)

    def sft_line(elapsed: float) -> str:
        probe_text = "" if state["probe"] is None else f", last probe {state['probe']:.1%}"
        return (
            f"warm start (SFT) step {state['step']}/{steps} loss {state['loss']:.3f}{probe_text}, "
            f"{elapsed:.0f}s (stops when the worked line is right on {recipe.sft_stop_accuracy:.0%} of the probe)"
        )

    with Progress(
        TextColumn("[bold]warm start (SFT)[/]"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task("sft", total=steps, loss=float("nan"))
        with heartbeat(console, sft_line):
            result = supervised_warm_start(model, tokenizer, train, cfg, on_step=on_step, probe=probe)

    probe = val if eval_problems is None else val[:eval_problems]
    check = f"held-out check of the warm start ({len(probe)} problems x {recipe.val_k})"
    with torch.no_grad(), heartbeat(console, lambda t: f"{check}... {t:.0f}s"):
        acc = sampled_accuracy(
            model,
            tokenizer,
            probe,
            k=recipe.val_k,
            temperature=recipe.val_temperature,
            top_p=recipe.val_top_p,
            max_new_tokens=recipe.max_response_length,
            seed=recipe.val_seed,
        )
    save_checkpoint(model, tokenizer, root / "hf")
    data = {
        "key": key,
        "initial_accuracy": acc.mean,
        "initial_accuracy_k": acc.samples_per_problem,
        "sft_steps": result.steps,
        "sft_probe_accuracy": result.probe_accuracy,
        "sft_seconds": round(result.seconds, 2),
        "sft_final_loss": result.final_loss,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (root / MANIFEST).write_text(json.dumps(data, indent=2))
    console.print(
        f"[green]warm start done[/] in {result.steps} steps, {result.seconds:.1f}s (loss {result.final_loss:.3f}); "
        f"held-out avg@{acc.samples_per_problem} at T={acc.temperature}, top_p={acc.top_p}: {acc.mean:.1%} "
        f"on {acc.num_problems} problems"
    )
    return _assets_from(root, data, reused=False)
