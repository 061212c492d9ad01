"""What the planner reads from a run config, and the assumptions it states, as plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlanInputs:
    """The config values that size memory and time (names follow the config keys)."""

    model_path: str
    dtype: str = "bf16"
    recompute: bool = False
    make_vocab_size_divisible_by: int = 128
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1  # expert parallel (MoE): experts split over this many of the DP x CP ranks
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    actor_world_size: int = 1
    max_prompt_length: int = 2048
    max_response_length: int = 20480
    n: int = 16
    gen_batch_size: int = 1536
    filter_groups: bool = True
    max_num_gen_batches: int = 10
    engine_tp: int = 1
    num_engines: int = 1
    mem_fraction_static: float = 0.7
    train_batch_size: int = 512
    ppo_mini_batch_size: int = 32
    ppo_epochs: int = 1
    micro_batch_max_tokens: int = 16384
    placement: str = "colocated"
    rollout_gpus: int = 0
    mode: str = "sync"  # trainer.mode: one_step_off/async overlap rollout and training

    @property
    def max_seq_len(self) -> int:
        return self.max_prompt_length + self.max_response_length

    @property
    def dp(self) -> int:
        return self.actor_world_size // (self.tp * self.pp * self.cp)


# Config key of each PlanInputs field, so a fix can be printed as overrides.
CONFIG_KEYS: dict[str, str] = {
    "model_path": "model.path",
    "dtype": "model.dtype",
    "recompute": "model.recompute",
    "make_vocab_size_divisible_by": "model.make_vocab_size_divisible_by",
    "tp": "parallel.tensor_model_parallel_size",
    "pp": "parallel.pipeline_model_parallel_size",
    "vpp": "parallel.virtual_pipeline_model_parallel_size",
    "cp": "parallel.context_parallel_size",
    "ep": "parallel.expert_model_parallel_size",
    "sequence_parallel": "parallel.sequence_parallel",
    "use_distributed_optimizer": "parallel.use_distributed_optimizer",
    "actor_world_size": "parallel.actor_world_size",
    "max_prompt_length": "data.max_prompt_length",
    "max_response_length": "data.max_response_length",
    "n": "rollout.n",
    "gen_batch_size": "rollout.gen_batch_size",
    "filter_groups": "algorithm.filter_groups.enable",
    "max_num_gen_batches": "algorithm.filter_groups.max_num_gen_batches",
    "engine_tp": "rollout.tensor_parallel_size",
    "num_engines": "rollout.num_engines",
    "mem_fraction_static": "rollout.sglang.mem_fraction_static",
    "train_batch_size": "trainer.train_batch_size",
    "ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    "ppo_epochs": "actor.ppo_epochs",
    "micro_batch_max_tokens": "actor.micro_batch_max_tokens",
    "placement": "trainer.placement",
    "rollout_gpus": "trainer.rollout_gpus",
    "mode": "trainer.mode",
}


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def inputs_from_config(cfg: Any) -> PlanInputs:
    """PlanInputs from a loaded config (a DictConfig or a nested dict)."""
    return PlanInputs(**{name: _get(cfg, key) for name, key in CONFIG_KEYS.items()})


def as_overrides(changes: dict[str, Any]) -> list[str]:
    """{'tp': 8} -> ['parallel.tensor_model_parallel_size=8'] (booleans lower-case, None as null)."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return str(v).lower()
        return "null" if v is None else str(v)

    return [f"{CONFIG_KEYS[k]}={fmt(v)}" for k, v in changes.items()]


@dataclass(frozen=True)
class Assumptions:
    """Numbers the planner cannot read from a config; every one is printed with the plan."""

    mean_prompt_len: float | None = None  # default: min(200, max_prompt_length)
    mean_response_frac: float = 0.25  # of max_response_length
    keep_rate: float = 0.5  # fraction of generated groups with mixed rewards
    decode_tok_s_per_gpu: float | None = None  # default: rule of thumb from model size and HBM
    mfu: float = 0.30
    overhead_gib: float = 5.0
    sglang_runtime_gib: float = 4.0
    paused_engine_gib: float = 1.0
    packing_efficiency: float = 0.9
    # MoE all-to-all per GPU, achievable (not link peak): NVLink within a node, the network across
    # nodes; an EP group of TP x EP GPUs larger than a node runs at the network's rate.
    a2a_intra_node_gb_s: float = 200.0
    a2a_inter_node_gb_s: float = 40.0
    gpus_per_node: int = 8
