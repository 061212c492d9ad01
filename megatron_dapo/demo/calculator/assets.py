"""Build (or reuse) what `megatron-dapo demo --task calculator` needs: data, tokenizer, and a
checkpoint warm-started by the lazy teacher (``teacher.py``)."""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_dapo.agent.runner import MultiTurnSettings
from megatron_dapo.agent.tools.spec import load_tool_config
from megatron_dapo.demo.calculator.recipe import CALCULATOR_RECIPE, CalculatorRecipe
from megatron_dapo.demo.calculator.task import make_products
from megatron_dapo.demo.calculator.teacher import (
    Teacher,
    calculator,
    sampled_episodes,
    tool_use_accuracy,
    tools_of,
)
from megatron_dapo.demo.model import create_model, save_checkpoint
from megatron_dapo.demo.sft import SFTConfig, supervised_warm_start
from megatron_dapo.demo.task import to_rows, write_parquet
from megatron_dapo.demo.tokenizer import build_calculator_tokenizer
from megatron_dapo.driver.progress import heartbeat

# Bump when the task, tokenizer, model or warm start change, so cached assets are rebuilt.
ASSETS_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class CalculatorAssets:
    root: Path
    hf_dir: Path
    train_file: Path
    val_file: Path
    initial_accuracy: float  # held-out avg@k of episodes with the tool (the demo's protocol)
    initial_call_rate: float  # share of those episodes whose first turn called the tool
    seed: int
    sft_steps: int
    sft_seconds: float
    reused: bool


def _cache_key(recipe: CalculatorRecipe, seed: int, sft_steps: int, tool_config: Path, eval_problems) -> dict:
    return {
        "version": ASSETS_VERSION,
        "seed": seed,
        "sft_max_steps": sft_steps,
        "recipe": asdict(recipe),
        "tools": hashlib.sha256(tool_config.read_bytes()).hexdigest(),
        "eval_problems": eval_problems,
    }


def _from_manifest(root: Path, data: dict, reused: bool) -> CalculatorAssets:
    return CalculatorAssets(
        root=root,
        hf_dir=root / "hf",
        train_file=root / "train.parquet",
        val_file=root / "val.parquet",
        initial_accuracy=data["initial_accuracy"],
        initial_call_rate=data["initial_call_rate"],
        seed=data["key"]["seed"],
        sft_steps=data["sft_steps"],
        sft_seconds=data["sft_seconds"],
        reused=reused,
    )


def _load_cached(root: Path, key: dict) -> CalculatorAssets | None:
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


def episode_settings(recipe: CalculatorRecipe, max_context: int) -> MultiTurnSettings:
    """The episode loop's settings of the demo's config (configs/demo_calculator.yaml)."""
    return MultiTurnSettings(
        max_assistant_turns=recipe.max_assistant_turns,
        max_turn_tokens=recipe.max_turn_tokens,
        max_tool_response_tokens=16,
        tool_response_truncate_side="middle",
        max_parallel_calls=1,
        max_context=max_context,
    )


def prepare_calculator_assets(
    out_dir: str | Path,
    tool_config: str | Path,
    seed: int = 0,
    force: bool = False,
    *,
    sft_steps: int | None = None,
    recipe: CalculatorRecipe = CALCULATOR_RECIPE,
    eval_problems: int | None = None,
    console=None,
) -> CalculatorAssets:
    """Write train/val parquet and a warm-started checkpoint (with the calculator tokenizer) under
    ``out_dir``; reuse them when its manifest records the same inputs (``force``: rebuild).

    ``tool_config`` is the run's tool YAML: the prompts list its tools, and the teacher's tool
    answers are the ones its calculator gives (run as the run runs it). The warm start stops when
    the greedy call and copy are right on ``recipe.sft_stop_accuracy`` of a probe of training
    problems (at most ``sft_steps`` steps, default the recipe's). The initial accuracy is the
    demo's protocol on ``eval_problems`` held-out problems (default all), episodes with the tool.
    """
    import torch
    from rich.console import Console

    console = console or Console()
    root = Path(out_dir)
    tool_config = Path(tool_config)
    steps = recipe.sft_steps if sft_steps is None else sft_steps
    key = _cache_key(recipe, seed, steps, tool_config, eval_problems)
    if not force:
        cached = _load_cached(root, key)
        if cached is not None:
            console.print(
                f"[green]calculator demo assets[/] reused from {root} (seed {seed}, {cached.sft_steps} SFT steps, "
                f"initial held-out accuracy {cached.initial_accuracy:.1%}, tool called in {cached.initial_call_rate:.0%})"
            )
            return cached

    root.mkdir(parents=True, exist_ok=True)
    (root / MANIFEST).unlink(missing_ok=True)  # a half-built directory must not look cached
    train, val = make_products(seed, recipe.num_train, recipe.num_val)
    write_parquet(to_rows(train, "train"), root / "train.parquet")
    write_parquet(to_rows(val, "test"), root / "val.parquet")
    console.print(
        f"[bold]calculator task[/]: {len(train)} train / {len(val)} held-out problems, e.g. {val[0].question!r}"
    )
    tokenizer = build_calculator_tokenizer(recipe.model.vocab_size)
    model = create_model(recipe.model, tokenizer, seed=seed)
    schemas = [spec.schema for spec in load_tool_config(tool_config)]
    config = SFTConfig(
        steps=steps,
        batch_size=recipe.sft_batch_size,
        lr=recipe.sft_lr,
        seed=seed,
        stop_accuracy=recipe.sft_stop_accuracy,
        check_every=recipe.sft_check_every,
        min_steps=recipe.sft_min_steps,
        lazy_rate=1.0 - recipe.sft_tool_rate,
    )
    probe_set = random.Random(seed).sample(train, min(recipe.sft_probe_problems, len(train)))
    state = {"step": 0, "loss": float("nan"), "probe": None}

    def line(elapsed: float) -> str:
        probe = "" if state["probe"] is None else f", last probe {state['probe']:.0%}"
        return (
            f"warm start (SFT, lazy teacher calling the tool in {recipe.sft_tool_rate:.0%}) step {state['step']}/{steps} "
            f"loss {state['loss']:.3f}{probe}, {elapsed:.0f}s (stops when call and copy are right on "
            f"{recipe.sft_stop_accuracy:.0%} of the probe)"
        )

    # One thread. A warm-start step took 0.08 s with one and 0.05 s with two on 2 idle cores, but
    # 0.25-0.45 s with one and 2.5 s with two beside other work (load ~10: two threads' spin-waits
    # lose their core): ~10 s more alone, minutes saved on a shared machine. The run's processes
    # set their own.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tools_of(tool_config) as tools:
            teacher = Teacher(tokenizer, schemas, calculator(tools), seed=seed)

            def probe(m) -> float:
                state["probe"] = tool_use_accuracy(m, teacher, probe_set)
                return state["probe"]

            with heartbeat(console, line):
                result = supervised_warm_start(
                    model,
                    tokenizer,
                    train,
                    config,
                    on_step=lambda s, loss: state.update(step=s, loss=loss),
                    probe=probe,
                    encode=teacher.encode,
                )
            held_out = val if eval_problems is None else val[:eval_problems]
            with (
                torch.no_grad(),
                heartbeat(console, lambda t: f"held-out check of the warm start... {t:.0f}s"),
            ):
                acc = sampled_episodes(
                    model,
                    teacher,
                    tools,
                    held_out,
                    k=recipe.val_k,
                    temperature=recipe.val_temperature,
                    top_p=recipe.val_top_p,
                    max_response_length=recipe.max_response_length,
                    settings=episode_settings(recipe, recipe.model.max_position_embeddings),
                    seed=recipe.val_seed,
                )
    finally:
        torch.set_num_threads(threads)
    save_checkpoint(model, tokenizer, root / "hf")
    data = {
        "key": key,
        "initial_accuracy": acc.mean,
        "initial_call_rate": acc.call_rate,
        "sft_steps": result.steps,
        "sft_probe_accuracy": result.probe_accuracy,
        "sft_seconds": round(result.seconds, 2),
        "sft_final_loss": result.final_loss,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (root / MANIFEST).write_text(json.dumps(data, indent=2))
    console.print(
        f"[green]warm start done[/] in {result.steps} steps, {result.seconds:.1f}s (loss {result.final_loss:.3f}, "
        f"probe {result.probe_accuracy if result.probe_accuracy is not None else float('nan'):.0%}); held-out "
        f"avg@{acc.samples_per_problem} with the tool: {acc.mean:.1%}, first turn calls it in {acc.call_rate:.0%}"
    )
    return _from_manifest(root, data, reused=False)
