"""Put the arithmetic together: roles and GPU counts, per-GPU memory of each role, whether it fits
(with a fix when it does not), tokens per step and the rollout/train time split.

A served reward model (``reward.model.path``) is a role of its own: with
``reward.model.placement=own``, ``num_servers x gpus_per_server`` GPUs added to the job's, each
server holding the model's bf16 weights over its TP and a KV cache in
``rollout.sglang.mem_fraction_static`` of its GPU, as an engine does, its scoring overlapping the
engines' decoding. ``colocated``: no GPUs added; each server takes
``reward.model.mem_fraction_static`` of rollout engine GPUs (the config keeps the two fractions
within 0.9 of a GPU) and its scoring adds to the decoding time on them instead of overlapping it.
A ``reward.model.url`` server runs elsewhere: no GPUs, memory or time of it is counted."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from megatron_dapo.plan.gpus import GPU
from megatron_dapo.plan.inputs import (
    BUILTIN_JUDGE_TEMPLATE_CHARS,
    CHARS_PER_TOKEN,
    MULTI_TURN_ENV_TOKEN_FRAC,
    MULTI_TURN_TOOL_CALLS,
    Assumptions,
    PlanInputs,
    as_overrides,
    inputs_from_config,
)
from megatron_dapo.plan.memory import (
    GIB,
    EngineMemory,
    StaticState,
    activation_bytes,
    engine_memory,
    in_flight_microbatches,
    logits_bytes,
    static_state_bytes,
)
from megatron_dapo.plan.models import ModelShape, resolve_model_shape
from megatron_dapo.plan.params import StageParams, count_params, padded_vocab, params_per_gpu
from megatron_dapo.plan.throughput import (
    ScoringLoad,
    StepTokens,
    TimeSplit,
    forward_flops_per_token,
    moe_all_to_all_bytes_per_gpu,
    scoring_load,
    step_tokens,
    time_split,
)


@dataclass(frozen=True)
class Roles:
    total_gpus: int
    actor_gpus: int
    rollout_gpus: int
    colocated: bool
    reward_gpus: int = 0  # the reward servers' own GPUs (reward.model.path, placement=own)


@dataclass(frozen=True)
class RewardServers:
    """The reward servers of ``reward.model.path``: the model, and one server's memory per GPU.

    ``memory.weights`` is bf16 weights over the server's TP; ``longest_request`` is the most
    tokens one request holds in the KV cache (the longest prompt and response, a judge's
    template and verdict), ``mean_request`` the tokens of an average one."""

    kind: str
    model: str
    servers: int
    tp: int
    params: int
    memory: EngineMemory
    longest_request: int
    mean_request: float


@dataclass(frozen=True)
class StageMemory:
    """Peak bytes on one actor GPU of a pipeline stage during the train phase."""

    stage: str
    params: int
    state: StaticState
    activations: float
    activations_other: float  # the same stage with recompute toggled, for comparison
    logits: float
    overhead: float
    # The reference model's weights on this GPU (actor.use_kl_loss / algorithm.use_kl_in_reward):
    # in host memory between uses, on the GPU only for its forward-only scoring pass, which saves
    # no activations; 0 without a reference.
    reference: float = 0.0

    @property
    def train_total(self) -> float:
        return self.state.total + self.activations + self.logits + self.overhead

    @property
    def scoring_total(self) -> float:
        """The reference's scoring pass: the actor's resident state plus the reference's weights
        and one micro-batch's logits."""
        return self.state.total + self.reference + self.logits + self.overhead

    @property
    def total(self) -> float:
        return max(self.train_total, self.scoring_total)


@dataclass(frozen=True)
class Check:
    role: str
    ok: bool
    what: str
    fix: list[str] | None = None  # config overrides that make it pass


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    gpu: GPU
    inputs: PlanInputs
    roles: Roles
    total_params: int
    num_microbatches: int
    stages: list[StageMemory]
    engine: EngineMemory
    rollout_phase_bytes: float | None  # colocated: actor resident + engine, during generation
    tokens: StepTokens
    times: TimeSplit
    checks: list[Check]
    assumptions: list[tuple[str, str, str]]  # (name, value, why)
    active_params: int = 0  # per token (MoE: the top-k experts only); = total_params for dense
    a2a_bytes_per_gpu: float = 0.0  # MoE token dispatch + combine sent per actor GPU per step
    tool_s_per_call: float = 0.0  # multi-turn: the assumed wall time of one tool call
    reward: RewardServers | None = None  # reward.model.path's servers
    scoring: ScoringLoad | None = None  # their work in one step

    @property
    def fits(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def actor_peak(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)


def decode_rule(params: int, gpu: GPU) -> float:
    """Decode tokens/s per GPU at high concurrency for a model of `params` (see below)."""
    return 40_000.0 / (params / 1e9) * (gpu.hbm_tb_s / 3.35)


def resolve_assumptions(
    p: PlanInputs,
    shape: ModelShape,
    gpu: GPU,
    a: Assumptions,
    total_params: int,
    reward_params: int = 0,
) -> dict:
    """Fill the defaults that depend on the config (mean lengths, decode and scoring rates)."""
    mean_prompt = a.mean_prompt_len if a.mean_prompt_len is not None else min(200.0, p.max_prompt_length)
    mean_response = a.mean_response_frac * p.max_response_length
    # Decode is bound by HBM bandwidth at high concurrency; ~40k tok/s per H100 divided by the model's
    # size in billions matches published large-batch SGLang figures within ~2x. Measure and pass yours.
    decode = a.decode_tok_s_per_gpu or decode_rule(total_params, gpu)
    if not p.multi_turn:
        if a.env_token_frac or a.tool_calls_per_episode:
            raise ValueError(
                "environment tokens and tool calls need a multi-turn config: set "
                "rollout.multi_turn.enable=true, or drop --env-token-frac / --tool-calls-per-episode"
            )
        env, calls = 0.0, 0.0
    else:
        env = MULTI_TURN_ENV_TOKEN_FRAC if a.env_token_frac is None else a.env_token_frac
        # the last model turn answers: at most one call per earlier turn
        default_calls = min(MULTI_TURN_TOOL_CALLS, max(0, p.max_assistant_turns - 1))
        calls = default_calls if a.tool_calls_per_episode is None else a.tool_calls_per_episode
    score_rate = verdict_rate = verdicts = 0.0
    if reward_params:
        # prefill is compute-bound: 2 FLOPs a parameter a token
        score_rate = a.score_tok_s_per_gpu or gpu.bf16_tflops * 1e12 * a.mfu / (2 * reward_params)
        verdict_rate = decode_rule(reward_params, gpu)
        if p.reward_kind == "judge":
            verdicts = min(a.verdict_tokens, p.reward_max_new_tokens)
    return {
        "mean_prompt": mean_prompt,
        "mean_response": mean_response,
        "decode": decode,
        "env_frac": env,
        "tool_calls": calls,
        "score_rate": score_rate,
        "verdict_rate": verdict_rate,
        "verdict_tokens": verdicts,
    }


def assign_roles(p: PlanInputs, num_gpus: int | None) -> tuple[Roles, PlanInputs]:
    """Colocated: actor and engines share every GPU. Disaggregated: trainer.rollout_gpus for the
    engines, the rest for the actor. The reward servers' GPUs (reward.model.num_servers x
    gpus_per_server) come on top. `num_gpus` (e.g. --num-gpus, all of the job's) resizes the
    actor world."""
    reward = p.reward_own_gpus
    if p.placement == "colocated":
        total = num_gpus or p.actor_world_size + reward
        if total <= reward:
            raise ValueError(f"{total} GPUs leave none for the actor after the reward servers' {reward}")
        p = replace(p, actor_world_size=total - reward)
        return Roles(total, total - reward, total - reward, True, reward), p
    rollout = p.rollout_gpus
    total = num_gpus or p.actor_world_size + rollout + reward
    if total <= rollout + reward:
        raise ValueError(
            f"{total} GPUs leave none for the actor after trainer.rollout_gpus={rollout}"
            + (f" and the reward servers' {reward}" if reward else "")
        )
    p = replace(p, actor_world_size=total - rollout - reward)
    return Roles(total, total - rollout - reward, rollout, False, reward), p


def _num_microbatches(p: PlanInputs, mean_seq: float, packing: float) -> int:
    tokens_per_dp_rank = p.ppo_mini_batch_size * p.n * mean_seq / max(1, p.dp)
    return max(1, math.ceil(tokens_per_dp_rank / (p.micro_batch_max_tokens * packing)))


def actor_stages(
    p: PlanInputs, shape: ModelShape, a: Assumptions, mean_seq: float
) -> tuple[list[StageMemory], int]:
    """Train-phase memory of the first and last pipeline stage (the heaviest two)."""
    vocab = padded_vocab(shape.vocab_size, p.make_vocab_size_divisible_by, p.tp)
    micro = _num_microbatches(p, mean_seq, a.packing_efficiency)
    # A micro-batch is at most the token budget, but never less than one whole sequence.
    tokens = max(p.micro_batch_max_tokens, p.max_seq_len) / p.cp
    out = []
    for st in params_per_gpu(shape, p.tp, p.pp, p.make_vocab_size_divisible_by, p.ep):
        stage_index = 0 if st.stage in ("first", "only") else p.pp - 1
        flight = in_flight_microbatches(stage_index, p.pp, micro, p.vpp)
        act = [
            activation_bytes(shape, tokens, st.layers, flight, p.tp, p.sequence_parallel, rc)
            for rc in (p.recompute, not p.recompute)
        ]
        out.append(
            StageMemory(
                stage=st.stage if p.pp > 1 else "only",
                params=st.params,
                state=_stage_state(st, p),
                activations=act[0],
                activations_other=act[1],
                logits=logits_bytes(tokens, vocab, p.tp) if st.has_head else 0.0,
                overhead=a.overhead_gib * GIB,
                reference=_stage_state(st, p).weights if p.reference else 0.0,
            )
        )
    return out, micro


def _stage_state(st: StageParams, p: PlanInputs) -> StaticState:
    """Static bytes of one stage's GPU: the distributed optimizer shards dense parameters over
    DP x CP, experts over their expert-data-parallel ranks (DP x CP / EP)."""
    dense = static_state_bytes(
        st.params - st.expert_params, p.dtype, p.dp * p.cp, p.use_distributed_optimizer
    )
    if not st.expert_params:
        return dense
    experts = static_state_bytes(
        st.expert_params, p.dtype, max(1, p.dp * p.cp // p.ep), p.use_distributed_optimizer
    )
    return StaticState(
        dense.weights + experts.weights, dense.grads + experts.grads, dense.optimizer + experts.optimizer
    )


def _actor_fits(
    p: PlanInputs, shape: ModelShape, gpu: GPU, a: Assumptions, mean_seq: float, colocated: bool
) -> bool:
    stages, _ = actor_stages(p, shape, a, mean_seq)
    reward = _resident_reward_bytes(p, gpu, colocated)
    budget = gpu.memory_gib * GIB - (a.paused_engine_gib * GIB if colocated else 0) - reward
    if any(s.total > budget for s in stages):
        return False
    if colocated:
        resident = max(s.state.total for s in stages)
        during_rollout = (
            resident + gpu.memory_gib * GIB * p.mem_fraction_static + a.sglang_runtime_gib * GIB + reward
        )
        return during_rollout <= gpu.memory_gib * GIB
    return True


def _resident_reward_bytes(p: PlanInputs, gpu: GPU, colocated: bool) -> float:
    """A colocated reward server's share of an actor GPU (engines on the actor's GPUs): it never
    releases it, in training as in generation."""
    return gpu.memory_gib * GIB * p.reward_mem_fraction if colocated and p.reward_colocated else 0.0


def valid_tp(shape: ModelShape, limit: int = 8) -> list[int]:
    """TP sizes that divide the attention and KV heads, within one node (NVLink)."""
    return [t for t in range(1, limit + 1) if shape.num_heads % t == 0 and shape.num_kv_heads % t == 0]


def find_actor_fix(
    p: PlanInputs, shape: ModelShape, gpu: GPU, a: Assumptions, mean_seq: float, colocated: bool
) -> dict | None:
    """The cheapest change of layout/recompute/optimizer/micro-batch budget that fits, or None.

    Cost: model-parallel size tp*pp (more of it means smaller, slower GEMMs and more
    communication), x1.33 for full recompute (one extra forward), x1.05 for a smaller micro-batch
    budget (more, shorter micro-batches). The world size and the mini-batch stay as configured.
    """
    tps = [t for t in valid_tp(shape) if t >= p.tp]
    pps = [d for d in range(p.pp, min(shape.num_layers, 16) + 1) if shape.num_layers % d == 0]
    budgets = sorted({p.micro_batch_max_tokens, max(p.max_seq_len, 1024 * math.ceil(p.max_seq_len / 1024))})
    budgets = [b for b in budgets if b <= p.micro_batch_max_tokens] or [p.micro_batch_max_tokens]
    best: tuple[float, int, dict] | None = None
    for tp in tps:
        for pp in pps:
            mp = tp * pp * p.cp
            if p.actor_world_size % mp or (p.ppo_mini_batch_size * p.n) % (p.actor_world_size // mp):
                continue
            if (p.actor_world_size // (tp * pp)) % p.ep:  # experts split over the DP x CP ranks
                continue
            for rc in sorted({p.recompute, True}):
                for mbt in budgets:
                    change = {
                        "tp": tp,
                        "pp": pp,
                        "recompute": rc,
                        "micro_batch_max_tokens": mbt,
                        "use_distributed_optimizer": True,
                        "sequence_parallel": tp > 1 or p.sequence_parallel,
                        "vpp": p.vpp if pp > 1 else None,
                    }
                    cand = replace(p, **change)
                    if not _actor_fits(cand, shape, gpu, a, mean_seq, colocated):
                        continue
                    diff = {k: v for k, v in change.items() if getattr(p, k) != v}
                    cost = tp * pp * (1.33 if rc else 1.0) * (1.05 if mbt < p.micro_batch_max_tokens else 1.0)
                    key = (cost, len(diff), diff)
                    if best is None or key[:2] < best[:2]:
                        best = key
    return best[2] if best else None


def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def _layout_checks(p: PlanInputs, shape: ModelShape, roles: Roles) -> list[Check]:
    out = []
    if shape.num_heads % p.tp or shape.num_kv_heads % p.tp:
        tps = ", ".join(map(str, valid_tp(shape, 64)))
        out.append(
            Check(
                "actor",
                False,
                f"TP={p.tp} must divide {shape.num_heads} heads and {shape.num_kv_heads} "
                f"KV heads (valid: {tps})",
                None,
            )
        )
    if shape.num_layers % (p.pp * (p.vpp or 1)):
        out.append(
            Check(
                "actor",
                False,
                f"{shape.num_layers} layers do not split into PP={p.pp} x VPP={p.vpp or 1} equal stages",
                None,
            )
        )
    mp = p.tp * p.pp * p.cp
    if roles.actor_gpus % mp:
        out.append(
            Check("actor", False, f"{roles.actor_gpus} actor GPUs are not a multiple of TP*PP*CP={mp}", None)
        )
    if not roles.actor_gpus % mp and (p.ppo_mini_batch_size * p.n) % p.dp:
        out.append(
            Check(
                "actor",
                False,
                f"mini-batch of {p.ppo_mini_batch_size * p.n} responses does not split over DP={p.dp} ranks",
                None,
            )
        )
    if p.micro_batch_max_tokens < p.max_seq_len:
        need = 1024 * math.ceil(p.max_seq_len / 1024)
        out.append(
            Check(
                "actor",
                False,
                f"micro-batch budget {p.micro_batch_max_tokens} tokens < one full sequence "
                f"({p.max_prompt_length}+{p.max_response_length}={p.max_seq_len})",
                [f"actor.micro_batch_max_tokens={need}"],
            )
        )
    return out


def _engine_checks(
    p: PlanInputs,
    shape: ModelShape,
    roles: Roles,
    eng: EngineMemory,
    gpu: GPU,
    a: Assumptions,
    mean_seq: float,
) -> list[Check]:
    out = []
    t = p.engine_tp
    if shape.num_heads % t or (shape.num_kv_heads % t and t % shape.num_kv_heads):
        out.append(
            Check(
                "rollout",
                False,
                f"SGLang TP={t} must divide the {shape.num_heads} heads (and divide or be a "
                f"multiple of the {shape.num_kv_heads} KV heads)",
                [f"rollout.tensor_parallel_size={max(d for d in valid_tp(shape) if d <= t)}"],
            )
        )
    engines = roles.rollout_gpus // t
    if p.num_engines * t != roles.rollout_gpus:
        out.append(
            Check(
                "rollout",
                False,
                f"rollout.num_engines={p.num_engines} x TP={t} = {p.num_engines * t} GPUs, "
                f"but the rollout role has {roles.rollout_gpus}",
                [f"rollout.num_engines={engines}"],
            )
        )
    if not roles.colocated:
        used = eng.static_pool + a.sglang_runtime_gib * GIB
        if used > gpu.memory_gib * GIB:
            frac = math.floor((gpu.memory_gib - a.sglang_runtime_gib) / gpu.memory_gib * 20) / 20
            out.append(
                Check(
                    "rollout",
                    False,
                    f"engine needs {_gib(used)} > {gpu.memory_gib:g} GiB",
                    [f"rollout.sglang.mem_fraction_static={frac:.2f}"],
                )
            )
    if eng.kv_tokens < p.max_seq_len:
        bigger = [d for d in valid_tp(shape) if d > t]
        fix = (
            [
                f"rollout.tensor_parallel_size={bigger[0]}",
                f"rollout.num_engines={roles.rollout_gpus // bigger[0]}",
            ]
            if bigger
            else None
        )
        out.append(
            Check(
                "rollout",
                False,
                f"KV cache holds {eng.kv_tokens} tokens per engine, less than one "
                f"{p.max_seq_len}-token sequence (weights {_gib(eng.weights)} of a {_gib(eng.static_pool)} pool)",
                fix,
            )
        )
    else:
        out.append(
            Check(
                "rollout",
                True,
                f"KV cache {_gib(eng.kv_room)} = {eng.kv_tokens:,} tokens per engine: "
                f"~{eng.kv_tokens / mean_seq:.0f} sequences at the mean length, "
                f"{eng.kv_tokens // p.max_seq_len} at the maximum",
            )
        )
    return out


def reward_servers(
    p: PlanInputs, shape: ModelShape, gpu: GPU, a: Assumptions, mean_prompt: float, mean_response: float
) -> RewardServers:
    """The reward model's parameters and one server's memory per GPU (`shape`: its decoder)."""
    params = reward_params(p, shape)
    memory = engine_memory(shape, params, p.reward_tp, gpu.memory_gib * GIB, p.reward_memory_fraction)
    template = judge_template_tokens(p)
    verdict = p.reward_max_new_tokens if p.reward_kind == "judge" else 0
    return RewardServers(
        kind=p.reward_kind,
        model=p.reward_path,
        servers=p.reward_servers,
        tp=p.reward_tp,
        params=params,
        memory=memory,
        longest_request=int(p.max_seq_len + template + verdict),
        mean_request=mean_prompt + mean_response + template,
    )


def reward_params(p: PlanInputs, shape: ModelShape) -> int:
    """Parameters of the reward model: the decoder's, with a classifier's score head (hidden x 1
    label) in place of the LM head (a tied head is the embedding, which a classifier keeps)."""
    counts = count_params(shape)
    params = counts.total(shape.num_layers)
    if p.reward_kind == "classifier":
        params += shape.hidden_size - counts.output_head
    return params


def judge_template_tokens(p: PlanInputs) -> float:
    """A judge's template in tokens (from its characters); 0 for a classifier."""
    if p.reward_kind != "judge":
        return 0.0
    chars = (
        BUILTIN_JUDGE_TEMPLATE_CHARS if p.reward_prompt_template is None else len(p.reward_prompt_template)
    )
    return math.ceil(chars / CHARS_PER_TOKEN)


def _reward_checks(
    p: PlanInputs, shape: ModelShape, rs: RewardServers, gpu: GPU, a: Assumptions
) -> list[Check]:
    t = rs.tp
    bigger = [d for d in valid_tp(shape) if d > t]
    grow = [f"reward.model.gpus_per_server={bigger[0]}"] if bigger else None
    if shape.num_heads % t or (shape.num_kv_heads % t and t % shape.num_kv_heads):
        fit = max(d for d in valid_tp(shape) if d <= t)
        return [
            Check(
                "reward",
                False,
                f"SGLang TP={t} must divide the reward model's {shape.num_heads} heads (and divide or be a "
                f"multiple of its {shape.num_kv_heads} KV heads)",
                [f"reward.model.gpus_per_server={fit}"],
            )
        ]
    m = rs.memory
    used = m.static_pool + a.sglang_runtime_gib * GIB
    if used > gpu.memory_gib * GIB:
        frac = math.floor((gpu.memory_gib - a.sglang_runtime_gib) / gpu.memory_gib * 20) / 20
        return [
            Check(
                "reward",
                False,
                f"reward server needs {_gib(used)} > {gpu.memory_gib:g} GiB",
                [f"rollout.sglang.mem_fraction_static={frac:.2f}"],
            )
        ]
    if m.kv_tokens < rs.longest_request:
        return [
            Check(
                "reward",
                False,
                f"reward server's KV cache holds {m.kv_tokens:,} tokens, less than its longest request of "
                f"{rs.longest_request:,} (weights {_gib(m.weights)} of a {_gib(m.static_pool)} pool)",
                grow,
            )
        ]
    return [
        Check(
            "reward",
            True,
            f"reward server: weights {_gib(m.weights)}, KV cache {_gib(m.kv_room)} = {m.kv_tokens:,} tokens: "
            f"~{m.kv_tokens / rs.mean_request:.0f} requests at the mean length, "
            f"{m.kv_tokens // rs.longest_request} at the longest",
        )
    ]


def make_plan(
    p: PlanInputs,
    shape: ModelShape,
    gpu: GPU,
    a: Assumptions | None = None,
    num_gpus: int | None = None,
    reward_shape: ModelShape | None = None,
) -> Plan:
    """The whole plan for config values `p` on `gpu`. Pure: no config files, no network.

    `reward_shape`: the decoder shape of `reward.model.path` (needed when it is set)."""
    a = a or Assumptions()
    roles, p = assign_roles(p, num_gpus)
    counts = count_params(shape)
    total_params = counts.total(shape.num_layers)
    active_params = counts.active(shape.num_layers)
    if p.reward_gpus and reward_shape is None:
        raise ValueError(f"reward.model.path={p.reward_path}: the planner needs the reward model's shape")
    rparams = reward_params(p, reward_shape) if p.reward_gpus else 0
    r = resolve_assumptions(p, shape, gpu, a, total_params, rparams)
    mean_seq = r["mean_prompt"] + r["mean_response"]
    checks = _layout_checks(p, shape, roles)
    layout_ok = all(c.ok for c in checks if c.fix is None)
    stages, micro = actor_stages(p, shape, a, mean_seq) if layout_ok else ([], 0)

    gpu_bytes = gpu.memory_gib * GIB
    rollout_phase = None
    if stages:
        peak = max(stages, key=lambda s: s.total)
        reward_bytes = _resident_reward_bytes(p, gpu, roles.colocated)
        budget = gpu_bytes - (a.paused_engine_gib * GIB if roles.colocated else 0) - reward_bytes
        train_ok = peak.total <= budget
        if roles.colocated:
            resident = max(s.state.total for s in stages)
            rollout_phase = (
                resident + gpu_bytes * p.mem_fraction_static + a.sglang_runtime_gib * GIB + reward_bytes
            )
        rollout_ok = rollout_phase is None or rollout_phase <= gpu_bytes
        fix = None
        if not (train_ok and rollout_ok):
            change = find_actor_fix(p, shape, gpu, a, mean_seq, roles.colocated)
            fix = as_overrides(change) if change is not None else None
        checks.append(
            Check(
                "actor",
                train_ok,
                f"train phase: {_gib(peak.total)} on the {peak.stage} stage of {gpu.memory_gib:g} GiB"
                + (
                    " (in the reference model's scoring pass)"
                    if peak.scoring_total > peak.train_total
                    else ""
                ),
                None if train_ok else fix,
            )
        )
        if rollout_phase is not None:
            room = (gpu_bytes - resident - a.sglang_runtime_gib * GIB - reward_bytes) / gpu_bytes
            alt = (
                [f"rollout.sglang.mem_fraction_static={math.floor(room * 20) / 20:.2f}"]
                if room > 0.3
                else fix
            )
            checks.append(
                Check(
                    "colocated",
                    rollout_ok,
                    f"generation phase: actor state {_gib(resident)} + SGLang "
                    f"pool {_gib(gpu_bytes * p.mem_fraction_static)} + runtime {a.sglang_runtime_gib:g} GiB "
                    + (f"+ reward server {_gib(reward_bytes)} " if reward_bytes else "")
                    + f"= {_gib(rollout_phase)}",
                    None if rollout_ok else alt,
                )
            )

    eng = engine_memory(shape, total_params, p.engine_tp, gpu_bytes, p.mem_fraction_static)
    checks += _engine_checks(p, shape, roles, eng, gpu, a, mean_seq)
    rs = None
    if p.reward_gpus:
        rs = reward_servers(p, reward_shape, gpu, a, r["mean_prompt"], r["mean_response"])
        checks += _reward_checks(p, reward_shape, rs, gpu, a)

    tokens = step_tokens(
        p.train_batch_size,
        p.n,
        p.gen_batch_size,
        p.filter_groups,
        p.max_num_gen_batches,
        a.keep_rate,
        r["mean_prompt"],
        r["mean_response"],
        env_token_frac=r["env_frac"],
        tool_calls_per_episode=r["tool_calls"],
    )
    scoring = None
    if rs is not None:
        scoring = scoring_load(
            tokens.generated_responses,
            rs.mean_request,
            r["verdict_tokens"],
            p.reward_gpus,
            r["score_rate"],
            r["verdict_rate"],
        )
    a2a_bytes = moe_all_to_all_bytes_per_gpu(
        shape, tokens.train_tokens, p.ppo_epochs, p.recompute, p.ep, roles.actor_gpus
    )
    intra_node = p.tp * p.ep <= a.gpus_per_node
    a2a_rate = (a.a2a_intra_node_gb_s if intra_node else a.a2a_inter_node_gb_s) * 1e9
    times = time_split(
        tokens,
        # A token's matmuls run through its top-k experts only (MoE): FLOPs follow active params.
        forward_flops_per_token(shape, active_params, mean_seq),
        p.ppo_epochs,
        p.recompute,
        roles.rollout_gpus,
        roles.actor_gpus,
        r["decode"],
        gpu.bf16_tflops,
        a.mfu,
        overlapped=p.mode in ("one_step_off", "async") and not roles.colocated,
        a2a_s=a2a_bytes / a2a_rate,
        reference=p.reference,
        tool_s_per_call=a.tool_s_per_call,
        tool_workers=p.tool_workers,
        score_s=scoring.score_s if scoring is not None else 0.0,
        score_shares_gpus=p.reward_colocated,
    )
    assumptions = [
        (
            "mean prompt length",
            f"{r['mean_prompt']:.0f} tokens",
            "DAPO-Math prompts with the template are ~100-300",
        ),
        (
            "mean response length",
            f"{r['mean_response']:.0f} tokens",
            f"{a.mean_response_frac:g} x max_response_length; the paper's 32B run grows from ~1k to ~5-6k",
        ),
        (
            "mixed-group keep rate",
            f"{a.keep_rate:g}",
            "fraction of groups with reward spread (dynamic sampling)",
        ),
        (
            "decode throughput",
            f"{r['decode']:,.0f} tok/s per GPU",
            "40k / params[B] x HBM/3.35 TB/s, high concurrency; prefill and the long tail ignored",
        ),
        ("training MFU", f"{a.mfu:g}", f"of {gpu.bf16_tflops:g} dense BF16 TFLOPS"),
        ("actor overhead", f"{a.overhead_gib:g} GiB", "CUDA context, NCCL buffers, allocator fragmentation"),
        (
            "SGLang runtime",
            f"{a.sglang_runtime_gib:g} GiB",
            "outside the static pool: CUDA graphs, activations",
        ),
        ("micro-batch packing", f"{a.packing_efficiency:g}", "filled fraction of the token budget"),
        ("grads", "fp32", "Megatron reduces bf16 grads in fp32 (main_grad)"),
    ]
    if p.multi_turn:
        assumptions += [
            (
                "environment tokens",
                f"{r['env_frac']:g} of each response",
                "tool answers (loss mask 0): prefilled, not decoded (earlier turns are in the prefix "
                "cache), trained on like the rest; guess: ~4 calls x ~150 tokens of a ~4k response",
            ),
            (
                "tool calls",
                f"{r['tool_calls']:g} per episode",
                "verl's 32B ReTool run: 10 turns on average = prompt + 4 answers + 5 model turns; "
                "at most max_assistant_turns - 1",
            ),
            (
                "tool time",
                f"{a.tool_s_per_call:g} s per call on one of {p.tool_workers} workers",
                "guess: the builtin python took 0.1 s to print, 0.27 s to import numpy (fresh "
                "interpreter); imports, loops, time-outs add; overlaps decoding",
            ),
        ]
    assumptions += _reward_assumptions(p, rs, r, gpu, a)
    if a2a_bytes:
        assumptions.append(
            (
                "MoE all-to-all",
                f"{a2a_rate / 1e9:g} GB/s per GPU",
                f"achievable {'NVLink' if intra_node else 'network'} rate: the EP group spans TP x EP = "
                f"{p.tp * p.ep} GPUs, {'within' if intra_node else 'more than'} a node of {a.gpus_per_node}; "
                "routing assumed even, not overlapped with compute",
            )
        )
    if roles.colocated:
        assumptions.append(
            (
                "paused engine",
                f"{a.paused_engine_gib:g} GiB",
                "SGLang's footprint while released (memory saver) during training",
            )
        )
    return Plan(
        shape,
        gpu,
        p,
        roles,
        total_params,
        micro,
        stages,
        eng,
        rollout_phase,
        tokens,
        times,
        checks,
        assumptions,
        active_params=active_params,
        a2a_bytes_per_gpu=a2a_bytes,
        tool_s_per_call=a.tool_s_per_call if p.multi_turn else 0.0,
        reward=rs,
        scoring=scoring,
    )


def _reward_assumptions(p: PlanInputs, rs: RewardServers | None, r: dict, gpu: GPU, a: Assumptions) -> list:
    if p.reward_kind is None:
        return []
    if rs is None:
        return [
            (
                "reward model",
                f"at reward.model.url={p.reward_url}",
                "served elsewhere: none of its GPUs, memory or scoring time is counted here",
            )
        ]
    if p.reward_colocated:
        placement = (
            "reward placement",
            f"{p.reward_servers} x {p.reward_tp} GPUs shared with rollout engines",
            "reward.model.placement=colocated: no GPUs added; their weights and KV take "
            "reward.model.mem_fraction_static of each, and scoring adds to the decoding time there",
        )
    else:
        placement = (
            "reward placement",
            f"{p.reward_servers} x {p.reward_tp} GPUs of their own",
            "added to the job's (reward.model.placement=own); scoring overlaps the engines' decoding",
        )
    rows = [
        placement,
        (
            "reward scoring",
            f"{r['score_rate']:,.0f} prefill tok/s per reward GPU",
            f"2 FLOPs a parameter a token at the training MFU {a.mfu:g} of {gpu.bf16_tflops:g} TFLOPS; every "
            "generated response is one request, "
            + (
                "scored on the engines' GPUs (its time added to decoding's)"
                if p.reward_colocated
                else "scored while others decode (the last ones' tail ignored)"
            ),
        ),
        (
            "reward server memory",
            f"mem_fraction_static={p.reward_memory_fraction:g}",
            ("reward.model's" if p.reward_colocated else "rollout.sglang's")
            + ": bf16 weights over the server's TP, the rest KV cache, as an engine",
        ),
    ]
    if p.reward_kind == "judge":
        rows += [
            (
                "judge template",
                f"{judge_template_tokens(p):.0f} tokens a request",
                f"its characters / {CHARS_PER_TOKEN:g} (English rule of thumb)",
            ),
            (
                "judge verdict",
                f"{r['verdict_tokens']:g} tokens at {r['verdict_rate']:,.0f} tok/s per GPU",
                "a one-word verdict and its end token (at most reward.model.max_new_tokens); decoded at "
                "the engines' rule for the judge's size",
            ),
        ]
    return rows


def plan_from_config(cfg, gpu: GPU, a: Assumptions | None = None, num_gpus: int | None = None) -> Plan:
    """`make_plan` for a loaded config: the policy's shape from model.path, the reward model's
    from reward.model.path (its config.json, or the built-in table by name)."""
    p = inputs_from_config(cfg)
    shape = resolve_model_shape(p.model_path)
    reward_shape = None
    if p.reward_gpus:
        reward_shape = resolve_model_shape(p.reward_path, key="reward.model.path")
    return make_plan(p, shape, gpu, a, num_gpus, reward_shape)
