"""The structured run configuration.

One tree of dataclasses, validated by OmegaConf for names and types, then by `validate.py` for
cross-field rules. Knob names follow verl where its users know them (clip_ratio_low,
loss_agg_mode, overlong_buffer.len, filter_groups.max_num_gen_batches, rollout.n, ...), so a verl
DAPO script translates key by key. Sizes of batches are counted in prompts (groups), like verl.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ModelConfig:
    # HF checkpoint directory (config.json + safetensors + tokenizer files), or a hub id
    # (owner/name[@revision]) resolved to its snapshot in the hub cache (HF_HOME; HF_HUB_OFFLINE=1:
    # the cache only) before the run starts.
    path: str = "???"
    # Hub revision (commit, tag or branch) of a hub id in model.path; null: main.
    revision: Optional[str] = None
    # Optional Megatron dist checkpoint to start from instead of converting `path` on the fly.
    megatron_path: Optional[str] = None
    # Tokenizer directory when it is not model.path's; null: model.path.
    tokenizer_path: Optional[str] = None
    # Parameter dtype of the actor: fp32 (CPU tests), bf16 (GPU; fp32 main params in the optimizer).
    dtype: str = "bf16"
    # Layer implementation: auto = Transformer Engine when importable and a GPU is present.
    transformer_impl: str = "auto"  # auto | transformer_engine | local
    # FP8 (Hopper+, needs Transformer Engine): null | e4m3 | hybrid.
    fp8: Optional[str] = None
    fp8_recipe: str = "delayed"  # delayed | tensorwise | blockwise | mxfp8
    # Full activation recompute in the actor's layers: less memory, one extra forward.
    recompute: bool = False
    # The embedding's rows are padded to a multiple of this (x TP), as Megatron does.
    make_vocab_size_divisible_by: int = 128


@dataclass
class ParallelConfig:
    # Actor tensor parallel (TP): must divide the attention and KV heads.
    tensor_model_parallel_size: int = 1
    # Actor pipeline parallel (PP): must divide the layers (x VPP).
    pipeline_model_parallel_size: int = 1
    # Interleaved pipeline: model chunks per PP stage; null: none.
    virtual_pipeline_model_parallel_size: Optional[int] = None
    # Actor context parallel (CP): each sequence split over this many ranks.
    context_parallel_size: int = 1
    # MoE: experts split over this many of the data-parallel x context-parallel ranks.
    expert_model_parallel_size: int = 1
    # Megatron sequence parallelism inside each TP group (needs TP > 1).
    sequence_parallel: bool = False
    # Actor world size; data parallel = world / (tp * pp * cp).
    actor_world_size: int = 1
    # Shard the optimizer state over the data-parallel ranks (GPU; the CPU path uses the plain
    # optimizer).
    use_distributed_optimizer: bool = True
    # How checkpoints write the distributed optimizer's state (actor/optimizer.py says more):
    # dp_reshardable (every rank writes its own shard; a resume may change only the DP size) or
    # fully_reshardable (gathered per model-parallel shard on DP rank 0's host memory; resumes into
    # any TP/PP/CP/EP layout).
    optimizer_checkpoint_format: str = "dp_reshardable"
    # DP communication overlap on GPU (ignored on CPU); null = the default: grad reduce on, param
    # gather on with the distributed optimizer (it needs both; see actor/gpu_settings.py).
    overlap_grad_reduce: Optional[bool] = None
    # See overlap_grad_reduce.
    overlap_param_gather: Optional[bool] = None


@dataclass
class DataConfig:
    # Training prompt files (verl parquet, jsonl) or HF dataset names; `megatron-dapo data prepare`
    # writes the recipes' files.
    train_files: list[str] = field(default_factory=list)
    # Held-out prompt files, evaluated every trainer.test_freq steps; empty: no validation.
    val_files: list[str] = field(default_factory=list)
    format: str = "auto"  # auto | parquet | jsonl | hf
    # Column with the prompt: chat messages or a string (a missing `prompt` falls back to
    # `problem`).
    prompt_key: str = "prompt"
    # Column with the ground truth (dots reach into dicts); null: reward_model.ground_truth, answer,
    # ground_truth.
    answer_key: Optional[str] = None
    # auto: apply the DAPO template to bare problems; dapo: always; none: never.
    template: str = "auto"
    # Render prompts with the tokenizer's chat template.
    apply_chat_template: bool = True
    # Prompt budget in tokens; a longer prompt is an error naming it.
    max_prompt_length: int = 2048
    # Response budget in tokens (generation stops there; overlong shaping counts from it).
    max_response_length: int = 20480
    # Shuffle the training prompts every epoch (seeded by data.seed).
    shuffle: bool = True
    # Seed of the prompt order.
    seed: int = 1
    # Skip malformed rows (counted and logged) instead of stopping at the first.
    skip_bad_rows: bool = False
    # Use only the first this many held-out prompts; null: all.
    val_max_samples: Optional[int] = None


@dataclass
class SGLangConfig:
    # SGLang's --mem-fraction-static: the share of GPU memory for weights and KV cache.
    mem_fraction_static: float = 0.7
    # API key sent to the servers (rollout.sglang.urls); null: none.
    api_key: Optional[str] = None
    # Colocated: the servers release their memory while the actor trains.
    enable_memory_saver: bool = True
    # Address the servers the run starts listen on.
    host: str = "127.0.0.1"
    # First port of the servers on each node (one port per engine from here).
    base_port: int = 30000
    # A server that is not healthy this long after its start is a start-up failure.
    startup_timeout_s: float = 900.0
    # A running server that does not answer GET /health within this (a hung process: port open,
    # no answers) is taken as dead: marked down, its work re-queued, restarted by its node.
    # /health runs a one-token generation behind the queued work, so not a ping's timeout.
    health_timeout_s: float = 120.0
    # Existing servers to use instead of launching them (torchrun mode, external engines).
    urls: list[str] = field(default_factory=list)
    # Extra command-line flags for `sglang.launch_server`.
    extra_args: list[str] = field(default_factory=list)
    # Interpreter that runs `python -m sglang.launch_server`. None: the repo's .venv-sglang
    # (built by `make setup-sglang`) when it exists, else the trainer's own interpreter.
    python: Optional[str] = None
    # KV pool size in tokens (--max-total-tokens). None: derived from the run's lengths; never
    # left to SGLang, which sizes the pool from the memory free at its start.
    max_total_tokens: Optional[int] = None
    # --enable-deterministic-inference: without it SGLang ignores each request's sampling_seed,
    # so the rollouts of a seeded run are not reproducible.
    deterministic: bool = True
    # --sleep-on-idle: an idle server's scheduler waits on its sockets instead of spinning a CPU
    # core at 100% through every actor update and weight sync (cores the trainer's ranks and
    # data loading need, colocated or on a CPU node); a request wakes it at once.
    sleep_on_idle: bool = True


@dataclass
class ValSamplingConfig:
    # Samples per held-out prompt (avg@n).
    n: int = 32
    # Validation sampling temperature.
    temperature: float = 1.0
    # Validation nucleus sampling (0.7 in the DAPO AIME protocol).
    top_p: float = 0.7
    # Validation top-k; -1: off.
    top_k: int = -1
    # Validation response budget; null: data.max_response_length.
    max_response_length: Optional[int] = None


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a Slurm step's or a container's
    share), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS (macOS)
        return os.cpu_count() or 1


@dataclass
class MultiTurnConfig:
    """Multi-turn tool-use episodes (megatron_dapo/agent/), verl's names where verl has them.

    An episode is the prompt, then model turns and environment (tool) turns, all as token ids; the
    environment's tokens are in the response with loss mask 0. The response budget
    (data.max_response_length) counts both kinds; overlong shaping counts the sampled ones."""

    enable: bool = False
    # Model turns per episode; an episode still calling tools after this many ends "turns".
    max_assistant_turns: int = 8
    # Cap on one model turn's new tokens; null: none (the budget left and the context left apply).
    max_turn_tokens: Optional[int] = None
    # A tool's answer is cut to this many tokens of the model's tokenizer (not characters).
    max_tool_response_tokens: int = 256
    # Which part of a long tool answer is kept: left (its start), right (its end) or middle (both
    # ends, the middle elided).
    tool_response_truncate_side: str = "middle"
    # Tool YAML: `tools: [{function: path.py:fn | class_name: pkg.Cls, config: {...}, tool_schema:
    # {type: function, function: {name, description, parameters}}}]` (verl's file loads as is).
    # Relative, in a YAML: the file beside that YAML when there is one, else the working directory.
    tool_config_path: Optional[str] = None
    # How a model turn's tool calls are written: hermes (<tool_call>{json}</tool_call>, Qwen2.5/3)
    # or any name registered with megatron_dapo.agent.calls.register_call_format; MODULE:NAME or
    # path/to/file.py:NAME imports the module that registers NAME first (the calculator demo's:
    # megatron_dapo.demo.calculator.calls:demo_calc).
    format: str = "hermes"
    # Wall-clock limit of one tool call; the tool's process is killed past it.
    tool_timeout_s: float = 30.0
    # Tool calls of one model turn that run (in parallel); more get an error observation.
    max_parallel_calls: int = 1
    # Run the calls a model writes inside <think>...</think> too (Qwen3's reasoning); false: the
    # reasoning is thought, not action, and only calls after it run.
    calls_in_think: bool = False
    # The token check of a finished episode against the chat template's rendering of its whole
    # conversation (verl's knob): strict, any difference masks the episode and it leaves its
    # group; ignore_strippable, differences in whitespace alone are tolerated; disable. Counted
    # in rollout/multiturn/rerender_mismatches. Qwen3 with thinking off needs disable (its
    # template drops the empty think block of every assistant message but the last).
    tokenization_sanity_check_mode: str = "strict"
    # Processes that run tools at most (user code runs only there, each restarted after a kill),
    # started as calls need them; as many tool calls run at once. Default: the cores this process
    # may use where the config is loaded (the trainer's node, where the tools run). Tools that
    # wait rather than compute (a web search, a remote sandbox) want more: each idle one is a
    # small Python process.
    tool_workers: int = field(default_factory=usable_cores)
    # Address-space limit of each tool process, MiB.
    tool_memory_mb: int = 2048


@dataclass
class RolloutConfig:
    engine: str = "auto"  # auto (sglang on GPU, hf on CPU) | sglang | hf
    # Responses per prompt (the group size G).
    n: int = 16
    # Training sampling temperature.
    temperature: float = 1.0
    # Training nucleus sampling.
    top_p: float = 1.0
    # Training top-k; -1: off.
    top_k: int = -1
    # Prompts per generation round; verl's gen_batch_size (3x train batch in the 32B script).
    gen_batch_size: int = 1536
    # Adaptive over-sampling: ask for more prompts per round from the observed keep rate.
    over_sample: bool = True
    # Adaptive over-sampling asks for at most this many times the prompts still needed.
    max_over_sample_factor: float = 3.0
    # Rollout engines (SGLang servers or HF engines); with rollout.tensor_parallel_size GPUs each.
    num_engines: int = 1
    # GPUs (SGLang TP) per rollout engine.
    tensor_parallel_size: int = 1
    # Requests in flight per engine.
    max_concurrency_per_engine: int = 1024
    # Prompt groups per engine call: SGLang batches across calls itself (1 is right); the HF
    # engine batches only within a call, so give it several groups.
    groups_per_call: int = 1
    # One engine call's time limit.
    request_timeout_s: float = 1800.0
    # An engine holding requests that returned nothing for this long is asked for its health
    # once (SGLang: GET /health, up to sglang.health_timeout_s); when that fails it is taken as
    # hung and its requests go to the other engines, without waiting for request_timeout_s.
    health_probe_interval_s: float = 60.0
    # Retries of a failed engine call (on another engine when one is down).
    max_retries: int = 2
    # Partial rollouts: the responses dynamic sampling aborts once the batch is full are kept
    # (tokens, log-probs, per-token weight versions) and continued by the next rollout.
    partial: bool = False
    # Write every step's rollouts (prompts, responses, rewards) under the run's rollouts/.
    dump_rollouts: bool = False
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    val: ValSamplingConfig = field(default_factory=ValSamplingConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class FilterGroupsConfig:
    # Dynamic sampling: drop groups whose metric has no spread, generate until the batch is full.
    enable: bool = True
    metric: str = "acc"  # acc | score | seq_final_reward
    # Generation rounds per step before giving up; 0 = unlimited.
    max_num_gen_batches: int = 10


@dataclass
class OverlongBufferConfig:
    # Soft overlong punishment within `len` tokens of the response budget.
    enable: bool = True
    # The buffer L_cache in tokens.
    len: int = 4096
    # The penalty at the budget (linear from 0 at the buffer's start).
    penalty_factor: float = 1.0


@dataclass
class TISConfig:
    # Deprecated (a warning at load): algorithm.rollout_correction.mode=tis with threshold=cap is
    # the same loss.
    enable: bool = False
    cap: float = 2.0


@dataclass
class RolloutCorrectionConfig:
    # Importance weight rho = exp(pi_old - rollout) per token (megatron_dapo/algo/rollout_correction.py).
    mode: str = "none"  # none | tis (loss x min(rho, threshold)) | mask (drop rho outside the bounds)
    level: str = "token"  # token | sequence (product over the sequence) | geometric (its geometric mean)
    threshold: float = 2.0  # tis: the cap; mask: the upper bound
    threshold_lower: Optional[float] = None  # mask only; null = 1 / threshold


@dataclass
class KLControlConfig:
    """The reward penalty's coefficient (algorithm.use_kl_in_reward), verl's algorithm.kl_ctrl:
    fixed, or adaptive toward target_kl over horizon samples (algo/kl_control.py). Its value is
    saved in checkpoints and restored on resume."""

    type: str = "fixed"  # fixed | adaptive
    # The (initial) coefficient.
    kl_coef: float = 0.001
    # adaptive: the KL the coefficient steers toward.
    target_kl: float = 0.1
    # adaptive: the controller's horizon in responses.
    horizon: float = 10000.0


@dataclass
class AlgorithmConfig:
    # grpo | rloo | reinforce_plus_plus_baseline (verl's names; megatron_dapo/algo/advantages.py).
    # Dr. GRPO: grpo with norm_adv_by_std_in_grpo=false and loss_agg_mode=seq-mean-token-sum-norm.
    adv_estimator: str = "grpo"
    # grpo only: divide by the group's reward std (false: Dr. GRPO's score - group mean)
    norm_adv_by_std_in_grpo: bool = True
    # The per-token policy loss, verl's policy_loss.loss_mode (megatron_dapo/algo/loss_terms.py):
    # vanilla (DAPO's decoupled-clip PPO) | gspo | cispo | sapo | gpg.
    policy_loss: str = "vanilla"
    # sapo only: the soft gates' temperatures for positive / other advantages (verl's defaults).
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    # vanilla, gspo, cispo; cispo may set 1.0 (no lower bound on its weight, as MiniMax-M1).
    clip_ratio_low: float = 0.2
    # Upper clip eps_high (DAPO's clip-higher: 0.28).
    clip_ratio_high: float = 0.28
    # Dual-clip bound for negative advantages (the 32B recipe: 10); null disables it.
    clip_ratio_c: Optional[float] = None
    loss_agg_mode: str = "token-mean"
    # Mask truncated responses out of the loss (DAPO's overlong filtering; off in the recipe).
    overlong_filter: bool = False
    # Dynamic sampling out of rounds (filter_groups.max_num_gen_batches): train on the mixed groups
    # found instead of stopping.
    allow_partial_batch: bool = False
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    tis: TISConfig = field(default_factory=TISConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # Entropy bonus: the loss is policy loss - entropy_coeff x entropy, the entropy aggregated like
    # the policy loss (loss_agg_mode, the same global normalisers). 0: off.
    entropy_coeff: float = 0.0
    # A KL penalty to the reference policy (the run's initial weights) in the reward, verl's
    # use_kl_in_reward: each response's score becomes score - coef x sum over its tokens of the
    # estimate kl_penalty(pi_old, pi_ref), before the advantages; coef from kl_ctrl. The group
    # filter (dynamic sampling) sees the scores without it. Builds the reference model.
    use_kl_in_reward: bool = False
    # The per-token estimator of the reward penalty (megatron_dapo/algo/kl.py): kl/k1, abs,
    # mse/k2, low_var_kl/k3 (verl's algorithm.kl_penalty; default kl).
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)


@dataclass
class RewardModelConfig:
    """A reward from a served model (megatron_dapo/rewards/served/). Off while kind is null.

    A classifier (a *ForSequenceClassification reward model) scores the prompt and response,
    rendered with its own chat template, through SGLang's /classify; a judge (a chat model) is
    asked with prompt_template and its verdict read by parser. A sample whose score times out,
    meets a 5xx, a dead server or an unparseable verdict is unscored, never scored 0."""

    kind: Optional[str] = None  # null (off) | classifier | judge
    # An HF checkpoint directory the run serves with SGLang, or the URL of a running server
    # (SGLang; for a judge any OpenAI-compatible /v1/chat/completions). Exactly one of the two.
    path: Optional[str] = None
    url: Optional[str] = None
    # Servers the run starts for `path`, and the GPUs (tensor parallel) of each.
    num_servers: int = 1
    gpus_per_server: int = 1
    # Where those servers go. own: GPUs that no actor rank or rollout engine uses (added to the
    # job's), on any node of the Ray cluster (under torchrun, the driver's node). colocated: server
    # i on the first gpus_per_server GPUs of rollout engine i, in mem_fraction_static of each (next to the engine's own
    # rollout.sglang.mem_fraction_static): no GPUs of their own, but scoring then competes with
    # decoding on those GPUs.
    placement: str = "own"
    mem_fraction_static: float = 0.15
    # One request's limit, and the retries after it for timeouts, 5xx and dropped connections
    # (a 4xx is never retried: it stops the run with the server's reason).
    timeout_s: float = 60.0
    max_retries: int = 2
    # Requests in flight per server; more wait their turn.
    max_in_flight: int = 32
    # How long a server may stay unreachable before the run stops.
    down_grace_s: float = 300.0
    # The longest a rollout step's scoring may take, from the step's start: a response not
    # scored by then is unscored (timeout) instead of holding the step. null: no deadline (each
    # request is still bounded by timeout_s and max_retries).
    step_timeout_s: Optional[float] = None
    # Restarts of each server the run started (after it died, or failed its start-up probe
    # after a restart) before the run stops with one line naming the server, its log and its
    # restarts: a server that dies again and again (out of memory under load) stops the run
    # instead of leaving most samples unscored. Counted as reward/server_restarts.
    max_restarts: int = 3
    # classifier: "path.py:fn" mapping the model's logit (a list with several labels) to the reward.
    transform: Optional[str] = None
    # judge: the question to the judge; {question} (the prompt's last user message), {response}
    # and {ground_truth} are replaced, other text is kept. null: the built-in template
    # (rewards/served/judge.py DEFAULT_PROMPT_TEMPLATE, a yes/no question for yes_no).
    prompt_template: Optional[str] = None
    # judge: yes_no (the verdict's first yes/no -> +1/-1, the DAPO rule's values) | boxed_score (the number
    # in the last \boxed{}) | "path.py:fn" (verdict text -> float, or None for unparseable).
    parser: str = "yes_no"
    # judge: its own sampling, not the policy's (0 = greedy).
    temperature: float = 0.0
    max_new_tokens: int = 1024
    # classifier: the start-up probe's tolerance (|served - transformers| on two probe texts).
    # null: by the server's precision, 1e-4 for float32 (CPU), 4e-2 for float16/bfloat16 (GPU).
    probe_tolerance: Optional[float] = None
    # judge: a prompt that does not fit the judge's context (known from the server at start-up;
    # the verdict keeps max_new_tokens of it, at most a quarter): cut (the response's beginning
    # is dropped, its last tokens, where the final answer is, kept) | unscored (the sample is
    # left unscored "too_long"). Either is counted; the run never stops on it.
    too_long: str = "cut"


@dataclass
class RewardConfig:
    # verl-style custom reward "path/to/file.py:function"; default = registry by data_source.
    custom_fn: Optional[str] = None
    timeout_s: float = 10.0
    boxed_fallback: bool = False
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    # "path.py:fn" mixing the rule reward and the model score: fn(data_source, solution_str,
    # ground_truth, extra_info, rule_score=..., model_score=...) -> float | dict. null: the model
    # score alone (with reward.model set).
    combine: Optional[str] = None


@dataclass
class OptimConfig:
    # Peak learning rate (AdamW).
    lr: float = 1e-6
    # cosine: the floor the rate decays to.
    min_lr: float = 0.0
    # AdamW weight decay.
    weight_decay: float = 0.1
    # AdamW beta1.
    adam_beta1: float = 0.9
    # AdamW beta2.
    adam_beta2: float = 0.999
    # AdamW epsilon.
    adam_eps: float = 1e-8
    # Global gradient-norm clip; 0: off.
    clip_grad: float = 1.0
    # Optimizer steps of linear warm-up.
    lr_warmup_steps: int = 10
    lr_scheduler: str = "constant"  # constant | cosine


@dataclass
class ActorConfig:
    # Prompts (groups) per optimizer step; the rollout step is split train_batch_size / this.
    ppo_mini_batch_size: int = 32
    # Passes over each rollout step's batch.
    ppo_epochs: int = 1
    # Token budget of one micro-batch (dynamic batch size): sequences are packed up to it.
    micro_batch_max_tokens: int = 16384
    # true: micro-batches carry samples back to back (THD packed sequences, each attending to
    # itself only), the budget counts real tokens; false: one right-padded sample per row, the
    # budget counts rows x longest. actor/padding_fraction shows the padding either way.
    pack_sequences: bool = True
    # Tokens per chunk of the output layer fused with the log-prob and entropy: the [tokens x
    # vocab] logits never exist, one chunk's do (~chunk x vocab/TP float32 values, a few at once).
    # Default measured on CPU only (tools/bench_logprobs.py --chunks); not measured on GPU.
    logprob_chunk_tokens: int = 512
    # Shuffle the batch into mini-batches.
    shuffle: bool = True
    # Optimizer steps skipped in a row for a non-finite loss or gradient before the run stops.
    max_consecutive_skips: int = 3
    # MoE: none | rollout. rollout replays the experts the engines chose (the engines record them)
    # in the actor's log-prob and training forwards (actor/routing_replay.py).
    routing_replay: str = "none"
    # MoE: the routers' load-balancing loss coefficient (megatron's/verl's moe_aux_loss_coeff).
    # null: the HF config's router_aux_loss_coef when its output_router_logits is true, else 0.
    # The loss is reported as actor/moe_aux_loss either way (actor/moe_aux_loss.py).
    moe_aux_loss_coeff: float | None = None
    # A KL to the reference policy (the run's initial weights, a frozen copy in the actor's
    # layout, offloaded to host memory between uses on GPU) as a loss term, verl's names: the
    # loss gains kl_loss_coef x kl_loss_type's estimate aggregated like the policy loss.
    # kl_loss_type: kl/k1, abs, mse/k2, low_var_kl/k3, or any of them with "+" (that value, k2's
    # gradient). The GRPO paper's setting: low_var_kl at 0.001.
    use_kl_loss: bool = False
    # The KL loss's coefficient (actor.use_kl_loss).
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # algorithm.loss_agg_mode=seq-mean-token-sum-norm (Dr. GRPO) divides each response's token
    # sum by this constant (verl's name). null: data.max_response_length, the generation budget,
    # which is verl's default too (its padded response width); never the step's longest response,
    # which would change the loss's scale from step to step.
    loss_scale_factor: Optional[int] = None


@dataclass
class WeightSyncConfig:
    # Size of the weight buckets sent to the engines after every step.
    bucket_mb: int = 512
    # One weight sync's time limit; the error names the engine and the bucket.
    timeout_s: float = 600.0
    transport: str = "auto"  # auto | object_store | nccl | cuda_ipc | disk


@dataclass
class CallTimeoutConfig:
    """The longest the driver waits on one call to the training ranks before it ends the run with
    one line naming the call, the ranks and the last checkpoint. This catches a rank that hangs; a
    rank that dies is reported at once. Generous: a 32B step with 20k-token responses takes tens
    of minutes."""

    train_step_s: float = 7200.0
    checkpoint_s: float = 3600.0  # save, load, HF export
    other_s: float = 1800.0  # memory hand-over between actor and colocated engines, transport reset


@dataclass
class TrainerConfig:
    # The W&B project.
    project: str = "megatron-dapo"
    # The run's directory under runs_dir (and its W&B name).
    run_name: str = "dapo"
    # Where run directories go.
    runs_dir: str = "runs"
    device: str = "auto"  # auto | cpu | cuda
    # Prompts (groups) per rollout step.
    train_batch_size: int = 512
    # Rollout steps to train.
    total_steps: int = 100
    # Seed of sampling and initialisation.
    seed: int = 1
    # Checkpoint every this many steps (and at a stop).
    save_freq: int = 20
    # Checkpoints kept; older ones are deleted.
    keep_last: int = 3
    resume: str = "auto"  # auto | never | PATH
    # SIGTERM/SIGINT: the longest the stop (abandon the rollout or finish the update, save, shut
    # down) may take before the process exits anyway; below Slurm's usual 120 s grace.
    stop_timeout_s: float = 90.0
    call_timeout: CallTimeoutConfig = field(default_factory=CallTimeoutConfig)
    # Validate every this many steps; 0: never.
    test_freq: int = 10
    # Validate before the first step.
    val_before_train: bool = True
    # Write an HF checkpoint under the run's hf/ at the end.
    hf_export_at_end: bool = True
    placement: str = "colocated"  # colocated | disaggregated
    # sync: generate, then train, then sync weights. one_step_off (disaggregated only): the
    # engines generate step k+1's batch while the actor trains step k (staleness 1). async
    # (disaggregated only): the engines stay max_staleness batches ahead (driver/pipeline.py).
    mode: str = "sync"
    # async: the most versions a token may lag the actor that trains on it (older groups are
    # dropped and counted as rollout/stale_dropped_samples); 1 is one_step_off's bound
    max_staleness: int = 1
    # one_step_off/async resume: a checkpoint carries the batches generated ahead of it (its
    # carried.safetensors); true drops them and draws their prompts again with the resumed weights
    drop_carried_on_resume: bool = False
    rollout_gpus: int = 0  # disaggregated: GPUs for engines; actor gets the rest
    # A Ray cluster to join (HEAD:PORT or auto); null: a local one for this run.
    ray_address: Optional[str] = None
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)


@dataclass
class LoggingConfig:
    # Log metrics to Weights & Biases (offline unless wandb_mode=online); the run id is kept in the
    # run directory and reused on resume.
    wandb: bool = False
    wandb_mode: str = "offline"  # offline | online
    # The W&B entity (team or user); null: the account's default. The project is trainer.project,
    # the run's name trainer.run_name.
    wandb_entity: Optional[str] = None
    # A W&B group to file the run under (e.g. one per sweep or ablation); null: none.
    wandb_group: Optional[str] = None
    # W&B tags of the run.
    wandb_tags: list[str] = field(default_factory=list)
    # Also write TensorBoard event files under the run's tensorboard/ (needs the tensorboard
    # package, which the project does not install: said once when it is absent).
    tensorboard: bool = False
    # Print a progress line per step.
    progress: bool = True
    # Write the run's PNG curves under plots/ at the end.
    plots_at_end: bool = True


@dataclass
class DAPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
