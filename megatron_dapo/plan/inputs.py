"""What the planner reads from a run config, and the assumptions it states, as plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_dapo.config.knobs import config_keys, from_config, knob


@dataclass(frozen=True)
class PlanInputs:
    """The config values that size memory and time; each field is a config key, with its default."""

    model_path: str = knob("model.path")
    dtype: str = knob("model.dtype")
    recompute: bool = knob("model.recompute")
    make_vocab_size_divisible_by: int = knob("model.make_vocab_size_divisible_by")
    tp: int = knob("parallel.tensor_model_parallel_size")
    pp: int = knob("parallel.pipeline_model_parallel_size")
    vpp: int | None = knob("parallel.virtual_pipeline_model_parallel_size")
    cp: int = knob("parallel.context_parallel_size")
    # expert parallel (MoE): experts split over this many of the DP x CP ranks
    ep: int = knob("parallel.expert_model_parallel_size")
    sequence_parallel: bool = knob("parallel.sequence_parallel")
    use_distributed_optimizer: bool = knob("parallel.use_distributed_optimizer")
    actor_world_size: int = knob("parallel.actor_world_size")
    max_prompt_length: int = knob("data.max_prompt_length")
    max_response_length: int = knob("data.max_response_length")
    n: int = knob("rollout.n")
    gen_batch_size: int = knob("rollout.gen_batch_size")
    filter_groups: bool = knob("algorithm.filter_groups.enable")
    max_num_gen_batches: int = knob("algorithm.filter_groups.max_num_gen_batches")
    engine_tp: int = knob("rollout.tensor_parallel_size")
    num_engines: int = knob("rollout.num_engines")
    mem_fraction_static: float = knob("rollout.sglang.mem_fraction_static")
    train_batch_size: int = knob("trainer.train_batch_size")
    ppo_mini_batch_size: int = knob("actor.ppo_mini_batch_size")
    ppo_epochs: int = knob("actor.ppo_epochs")
    micro_batch_max_tokens: int = knob("actor.micro_batch_max_tokens")
    placement: str = knob("trainer.placement")
    rollout_gpus: int = knob("trainer.rollout_gpus")
    mode: str = knob("trainer.mode")  # one_step_off/async overlap rollout and training
    # either builds the frozen reference model (actor/reference.py)
    use_kl_loss: bool = knob("actor.use_kl_loss")
    use_kl_in_reward: bool = knob("algorithm.use_kl_in_reward")
    # multi-turn tool use: responses hold the environment's tokens, and the tools take time
    multi_turn: bool = knob("rollout.multi_turn.enable")
    max_assistant_turns: int = knob("rollout.multi_turn.max_assistant_turns")
    tool_workers: int = knob("rollout.multi_turn.tool_workers")
    # a served reward model (reward.model): its servers' GPUs, memory and scoring time
    reward_kind: str | None = knob("reward.model.kind")
    reward_path: str | None = knob("reward.model.path")
    reward_url: str | None = knob("reward.model.url")
    reward_servers: int = knob("reward.model.num_servers")
    reward_tp: int = knob("reward.model.gpus_per_server")
    reward_placement: str = knob("reward.model.placement")
    reward_mem_fraction: float = knob("reward.model.mem_fraction_static")
    reward_prompt_template: str | None = knob("reward.model.prompt_template")
    reward_max_new_tokens: int = knob("reward.model.max_new_tokens")

    @property
    def reference(self) -> bool:
        return self.use_kl_loss or self.use_kl_in_reward

    @property
    def reward_gpus(self) -> int:
        """GPUs the reward servers the run starts (reward.model.path) run on, their own or shared
        with the rollout engines; a reward.model.url server runs elsewhere and counts none."""
        if self.reward_kind is None or self.reward_path is None:
            return 0
        return self.reward_servers * self.reward_tp

    @property
    def reward_colocated(self) -> bool:
        return bool(self.reward_gpus) and self.reward_placement == "colocated"

    @property
    def reward_own_gpus(self) -> int:
        """GPUs the reward servers add to the job's: none when they share the engines' GPUs."""
        return 0 if self.reward_colocated else self.reward_gpus

    @property
    def reward_memory_fraction(self) -> float:
        """A reward server's share of its GPU: its own, or rollout.sglang's on GPUs of its own."""
        return self.reward_mem_fraction if self.reward_colocated else self.mem_fraction_static

    @property
    def max_seq_len(self) -> int:
        return self.max_prompt_length + self.max_response_length

    @property
    def dp(self) -> int:
        return self.actor_world_size // (self.tp * self.pp * self.cp)


# Config key of each PlanInputs field, so a fix can be printed as overrides.
CONFIG_KEYS: dict[str, str] = config_keys(PlanInputs)


def inputs_from_config(cfg: Any) -> PlanInputs:
    """PlanInputs from a loaded config (a DictConfig or a nested dict)."""
    return from_config(PlanInputs, cfg)


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
    # Multi-turn tool use (rollout.multi_turn.enable), None: resolve_assumptions' defaults. The
    # share of a response that is the environment's (tool answers in the chat template's tool turn).
    env_token_frac: float | None = None
    tool_calls_per_episode: float | None = None
    tool_s_per_call: float = 0.5  # wall time of one call on one tool worker
    # Served reward model (reward.model), None: resolve_assumptions' defaults. Prefill tokens a
    # reward GPU scores per second (the whole request: prompt, response, judge template), and the
    # tokens of a judge's verdict.
    score_tok_s_per_gpu: float | None = None
    verdict_tokens: float = 8.0


# Multi-turn defaults (guesses, stated with the plan): a ReTool-like episode makes ~4 calls (verl's
# 32B ReTool run: 10 turns on average = the prompt + 4 tool answers + 5 model turns), each answer
# ~150 tokens (a 400-character output and the tool turn's template), of a ~4k-token response.
MULTI_TURN_ENV_TOKEN_FRAC = 0.15
MULTI_TURN_TOOL_CALLS = 4.0

# A judge's template in tokens, from its characters: ~4 characters a token for English text (a
# rule of thumb). The built-in template (rewards/served/judge.py DEFAULT_PROMPT_TEMPLATE) has 317.
CHARS_PER_TOKEN = 4.0
BUILTIN_JUDGE_TEMPLATE_CHARS = 317
