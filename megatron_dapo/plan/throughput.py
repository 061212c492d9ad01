"""Tokens per DAPO step and a rollout / train time split from stated throughput assumptions."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_dapo.plan.models import ModelShape


@dataclass(frozen=True)
class StepTokens:
    gen_rounds: int
    generated_prompts: int
    generated_responses: int
    decode_tokens: float  # response tokens the engines sample
    train_sequences: int
    train_tokens: float  # prompt + response tokens the actor trains on
    # Multi-turn: the responses' environment tokens (tool answers), which the engines prefill (the
    # earlier turns are in the prefix cache) instead of decoding; the actor trains on them as well.
    env_tokens: float = 0.0
    tool_calls: float = 0.0


def step_tokens(
    train_batch: int,
    n: int,
    gen_batch: int,
    filter_groups: bool,
    max_rounds: int,
    keep_rate: float,
    mean_prompt: float,
    mean_response: float,
    env_token_frac: float = 0.0,
    tool_calls_per_episode: float = 0.0,
) -> StepTokens:
    """With dynamic sampling, rounds of `gen_batch` prompts are generated until `train_batch` mixed
    groups are kept: ceil(train_batch / (gen_batch * keep_rate)) rounds, capped by the budget.
    Without it, exactly the train batch is generated. `env_token_frac` of each response is the
    environment's: not decoded, still trained on (its loss mask 0 drops it from the loss, not from
    the forward and backward passes)."""
    if filter_groups:
        rounds = max(1, math.ceil(train_batch / (gen_batch * keep_rate)))
        if max_rounds > 0:
            rounds = min(rounds, max_rounds)
        prompts = rounds * gen_batch
    else:
        rounds, prompts = 1, train_batch
    response_tokens = prompts * n * mean_response
    return StepTokens(
        gen_rounds=rounds,
        generated_prompts=prompts,
        generated_responses=prompts * n,
        decode_tokens=response_tokens * (1 - env_token_frac),
        train_sequences=train_batch * n,
        train_tokens=train_batch * n * (mean_prompt + mean_response),
        env_tokens=response_tokens * env_token_frac,
        tool_calls=prompts * n * tool_calls_per_episode,
    )


def forward_flops_per_token(m: ModelShape, total_params: int, mean_seq: float) -> float:
    """2 FLOPs per matmul weight (the embedding lookup is not a matmul unless it is tied to the
    head) plus causal attention: QK^T and PV over on average mean_seq/2 keys, 2*2*(mean_seq/2)*q
    per layer. Using the mean length underestimates attention a little (E[s^2] > E[s]^2)."""
    matmul = total_params - (0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size)
    return 2 * matmul + 2 * m.num_layers * m.q_dim * mean_seq


def moe_all_to_all_bytes_per_gpu(
    m: ModelShape, train_tokens: float, ppo_epochs: int, recompute: bool, ep: int, actor_gpus: int
) -> float:
    """Bytes one actor GPU sends in megatron's alltoall token dispatcher over one DAPO step (bf16
    hidden states; 0 for a dense model or EP=1).

    Per MoE layer a forward sends each token's hidden state to its top-k experts (dispatch) and
    takes the k outputs back (combine); a backward moves the same volume of gradients. Forwards:
    one for the old log-probs, then per epoch one (two under full recompute) plus one backward. With
    routing spread evenly, (ep-1)/ep of the copies leave the rank. DP x CP split the tokens, TP
    splits them further (megatron-core requires sequence parallel for MoE at TP>1) and PP the
    layers, so every GPU routes train_tokens x layers / actor_gpus token-layers."""
    if not m.num_experts or ep <= 1:
        return 0.0
    exchanges = 1 + ppo_epochs * (2 + (1 if recompute else 0))
    token_layers = train_tokens * m.num_layers / actor_gpus
    return token_layers * exchanges * 2 * m.moe_topk * m.hidden_size * 2 * (ep - 1) / ep


@dataclass(frozen=True)
class TimeSplit:
    rollout_s: float
    train_s: float  # compute plus the MoE all-to-all (a2a_s), which is not assumed to overlap it
    train_flops: float
    # trainer.mode one_step_off/async on disaggregated GPUs: the next batch is generated while
    # the actor trains, so in the steady state a step takes the longer of the two, not the sum
    # (assumed: the sync between them is short, and each round takes about the mean; async's
    # deeper queue also absorbs a slow round, which this does not model)
    overlapped: bool = False
    a2a_s: float = 0.0
    # rollout_s is the longest of the engines' decoding, the tool workers' busy time and the
    # reward servers' scoring
    decode_s: float = 0.0
    tool_s: float = 0.0
    score_s: float = 0.0

    @property
    def step_s(self) -> float:
        if self.overlapped:
            return max(self.rollout_s, self.train_s)
        return self.rollout_s + self.train_s

    @property
    def rollout_fraction(self) -> float:
        """The rollout's share of the work (the sum), whether or not the two overlap."""
        work = self.rollout_s + self.train_s
        return self.rollout_s / work if work else 0.0


def time_split(
    tokens: StepTokens,
    fwd_flops_per_token: float,
    ppo_epochs: int,
    recompute: bool,
    rollout_gpus: int,
    actor_gpus: int,
    decode_tok_s_per_gpu: float,
    peak_tflops: float,
    mfu: float,
    overlapped: bool = False,
    a2a_s: float = 0.0,
    reference: bool = False,
    tool_s_per_call: float = 0.0,
    tool_workers: int = 1,
    score_s: float = 0.0,
    score_shares_gpus: bool = False,
) -> TimeSplit:
    """Rollout: decode tokens / (per-GPU decode rate * rollout GPUs), prefill and the long tail
    ignored; with tools, the longer of that and the tool calls' seconds / `tool_workers` (the
    engines decode other episodes while one waits for its tools, so the two overlap; an episode's
    own wait is ignored like the long tail); with a served reward model, also `score_s` (each
    response is scored as it completes, while others decode: the scores of the last ones, after
    decoding ends, are ignored like the long tail); `score_shares_gpus` (reward servers colocated
    with the engines): the scoring runs on the decoding GPUs, so its time adds to decoding's. Train: one forward for the old log-probs, then per epoch forward + backward (3
    forwards' worth) plus one more forward under full recompute, and with a `reference` model one
    forward of it (its log-probs), at `mfu` of peak. The sync DAPO
    step adds the two up whether the roles share GPUs or not; `overlapped` (one_step_off/async on
    their own GPUs) takes the longer of the two. `a2a_s` (MoE token exchange) adds to the train time:
    megatron-core overlaps it with compute only in setups this planner does not assume."""
    decode_s = tokens.decode_tokens / (decode_tok_s_per_gpu * rollout_gpus)
    tool_s = tokens.tool_calls * tool_s_per_call / tool_workers
    passes = 1 + (1 if reference else 0) + ppo_epochs * (3 + (1 if recompute else 0))
    flops = tokens.train_tokens * fwd_flops_per_token * passes
    train_s = flops / (actor_gpus * peak_tflops * 1e12 * mfu) + a2a_s
    busy = decode_s + score_s if score_shares_gpus else max(decode_s, score_s)
    return TimeSplit(max(busy, tool_s), train_s, flops, overlapped, a2a_s, decode_s, tool_s, score_s)


@dataclass(frozen=True)
class ScoringLoad:
    """A served reward model's work in one step: every generated response is one request."""

    requests: int
    prefill_tokens: float  # prompt + response + a judge's template, per request, summed
    verdict_tokens: float  # a judge's decoded verdicts, summed (0 for a classifier)
    prefill_s: float
    verdict_s: float

    @property
    def score_s(self) -> float:
        return self.prefill_s + self.verdict_s


def scoring_load(
    responses: int,
    request_tokens: float,
    verdict_tokens: float,
    reward_gpus: int,
    prefill_tok_s_per_gpu: float,
    decode_tok_s_per_gpu: float,
) -> ScoringLoad:
    """The reward servers' time for one step: the requests' tokens prefilled at
    `prefill_tok_s_per_gpu`, the verdicts decoded at `decode_tok_s_per_gpu`, on `reward_gpus`
    GPUs (servers share the requests evenly)."""
    prefill = responses * request_tokens
    verdicts = responses * verdict_tokens
    return ScoringLoad(
        responses,
        prefill,
        verdicts,
        prefill / (prefill_tok_s_per_gpu * reward_gpus),
        verdicts / (decode_tok_s_per_gpu * reward_gpus) if verdicts else 0.0,
    )
