"""A recipe sized to an allocation: the GPUs its layout needs, and the overrides that fit it to
another number of GPUs by the planner's rules (actor world size, then each failed check's fix,
replanned until nothing is left to fix)."""

from __future__ import annotations

import math
from typing import Any

from omegaconf import OmegaConf

from megatron_dapo.config.errors import ConfigError
from megatron_dapo.config.loader import merge_overrides
from megatron_dapo.plan.gpus import gpu_for
from megatron_dapo.plan.inputs import Assumptions, inputs_from_config
from megatron_dapo.plan.models import resolve_model_shape
from megatron_dapo.plan.planner import Plan, assign_roles, plan_from_config, valid_tp

# Each round applies every fix the last plan named; a fix may make another check fail (more
# engines need less memory each, ...), so a few rounds; the planner's fixes do not cycle.
ROUNDS = 4
MAX_LAYOUTS = 12  # TP/PP pairs tried, nearest the config's first


def layout_gpus(cfg: Any) -> int:
    """GPUs the config's layout places: the actor's (colocated engines share them) plus
    disaggregated engines' and reward servers' own."""
    roles, _ = assign_roles(inputs_from_config(cfg), None)
    return roles.total_gpus


def _with(cfg: Any, overrides: list[str]) -> Any:
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    return merge_overrides(plain, overrides)


def _set(overrides: list[str], item: str) -> list[str]:
    key = item.split("=", 1)[0]
    return [o for o in overrides if o.split("=", 1)[0] != key] + [item]


def _fix_rounds(cfg: Any, overrides: list[str], gpu: Any, a: Assumptions | None) -> tuple[list[str], Plan]:
    plan = plan_from_config(_with(cfg, overrides), gpu, a)
    for _ in range(ROUNDS):
        fixes = [f for c in plan.checks if not c.ok and c.fix for f in c.fix]
        new = [f for f in fixes if f not in overrides]
        if not new:
            break
        for item in new:
            overrides = _set(overrides, item)
        plan = plan_from_config(_with(cfg, overrides), gpu, a)
    return overrides, plan


def _layouts(cfg: Any, actor_gpus: int) -> list[tuple[int, int]]:
    """(TP, PP) pairs whose model-parallel group divides ``actor_gpus`` and the model's heads and
    layers, nearest the config's first (TP kept within a node: at most 8)."""
    p = inputs_from_config(cfg)
    shape = resolve_model_shape(p.model_path)
    pairs = [
        (tp, pp)
        for tp in valid_tp(shape)
        for pp in range(1, shape.num_layers + 1)
        if shape.num_layers % pp == 0 and actor_gpus % (tp * pp * p.cp) == 0
    ]
    return sorted(pairs, key=lambda t: (abs(math.log(t[0] / p.tp)) + abs(math.log(t[1] / p.pp)), -t[0]))


def resize(cfg: Any, num_gpus: int, gpu: Any, a: Assumptions | None = None) -> tuple[list[str], Plan]:
    """(overrides, the plan with them) for ``num_gpus`` GPUs: the actor world size the GPUs leave
    for it; TP/PP when the config's do not divide it; then the fixes the planner names (engines,
    memory, ...) until the plan has none left. The first layout that fits, nearest the config's."""
    roles, _ = assign_roles(inputs_from_config(cfg), num_gpus)
    base: list[str] = []
    if roles.actor_gpus != cfg.parallel.actor_world_size:
        base.append(f"parallel.actor_world_size={roles.actor_gpus}")
    first = None
    for tp, pp in _layouts(cfg, roles.actor_gpus)[:MAX_LAYOUTS]:
        overrides = list(base)
        if tp != cfg.parallel.tensor_model_parallel_size:
            overrides.append(f"parallel.tensor_model_parallel_size={tp}")
        if pp != cfg.parallel.pipeline_model_parallel_size:
            overrides.append(f"parallel.pipeline_model_parallel_size={pp}")
        result = _fix_rounds(cfg, overrides, gpu, a)
        if result[1].fits:
            return result
        first = first or result
    return first or _fix_rounds(cfg, base, gpu, a)


def check_gpus(cfg: Any, num_gpus: int, gpu_name: str = "h100", source: str = "the config") -> None:
    """Raise a one-line ConfigError unless the layout uses exactly ``num_gpus`` GPUs; it names
    both numbers and the overrides that size the recipe to ``num_gpus``."""
    if num_gpus < 1:
        raise ConfigError(f"--num-gpus={num_gpus} must be >= 1")
    need = layout_gpus(cfg)
    if need == num_gpus:
        return
    what = f"{source} places {need} GPUs (parallel.actor_world_size={cfg.parallel.actor_world_size}"
    what += f", trainer.placement={cfg.trainer.placement}) but the allocation has {num_gpus}"
    try:
        overrides, plan = resize(cfg, num_gpus, gpu_for(gpu_name, None))
    except ValueError as e:
        raise ConfigError(f"{what}: no layout fits it ({e}); ask for {need} GPUs") from None
    see = f"`megatron-dapo plan {source} --num-gpus {num_gpus} --gpu {gpu_name}` shows the fit"
    if not plan.fits:
        failed = "; ".join(c.what for c in plan.checks if not c.ok)
        raise ConfigError(
            f"{what}; the planner found no complete fix ({failed}); {see}, or ask for {need} GPUs"
        )
    raise ConfigError(f"{what}: add {' '.join(overrides)} ({see}), or ask for {need} GPUs")
