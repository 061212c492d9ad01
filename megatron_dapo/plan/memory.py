"""Per-GPU memory of the actor (Megatron) and of an SGLang engine. Pure arithmetic, in bytes.

Activation formula: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv 2205.05198), Sec. 4, which counts the bytes each layer saves for
backward: 34*s*b*h + 5*a*s^2*b for a GPT layer, split over TP as
s*b*h*(10 + 24/t + 5*a*s/(h*t)) without sequence parallelism and s*b*h*(34 + 5*a*s/h)/t with it.
Adapted here to what a Qwen2/Llama layer saves, per token, in bf16 (2 bytes):
  - flash attention: no s^2 score/softmax/dropout tensors; it keeps Q, K, V, its output and an
    fp32 log-sum-exp per head;
  - GQA: K and V are kv_heads * head_dim wide, not hidden;
  - SwiGLU: the fc1 output is gate + up (2 * ffn wide) and the activation output ffn wide;
  - no dropout (Qwen2.5 trains with dropout 0), so no masks;
  - two RMSNorm inputs and the two linear inputs (QKV in, fc1 in) are the part that TP alone
    does not split; sequence parallelism splits it too (the Korthikanti "10" term, less dropout).
Per token per layer, with q = heads*head_dim, kv = kv_heads*head_dim, f = ffn, a = heads, t = TP:
    8*h / (t if SP else 1)  +  (4*q + 4*kv + 4*a + 6*f) / t   bytes
(Qwen2.5-32B: 40960 + 190624 = 231,584 bytes at t=1.) Full recompute keeps only each layer's input (h*2 bytes,
split by SP) plus one layer's full activations while it is recomputed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_dapo.plan.models import ModelShape

GIB = 1024**3


@dataclass(frozen=True)
class StaticState:
    """Bytes that live on a GPU for the whole run: weights, grads, optimizer state."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def static_state_bytes(params: int, dtype: str, dp_cp: int, distributed_optimizer: bool) -> StaticState:
    """Megatron mixed precision, as in its distributed-optimizer docs (bytes per parameter).

    bf16/fp16: 2 (param) + 4 (fp32 main grad: Megatron accumulates and reduces grads in fp32 for
    bf16) + 12 (fp32 main param + Adam m + v), the 12 sharded over DP x CP by the distributed
    optimizer ("6 + 12/d" in Megatron's table). fp32: 4 + 4 + 8 (m, v; the param is its own master).
    """
    if dtype == "fp32":
        weight_b, grad_b, opt_b = 4, 4, 8
    else:
        weight_b, grad_b, opt_b = 2, 4, 12
    shard = dp_cp if distributed_optimizer else 1
    return StaticState(params * weight_b, params * grad_b, params * opt_b / shard)


def activation_bytes_per_token_layer(
    m: ModelShape, tp: int, sequence_parallel: bool, act_bytes: int = 2
) -> float:
    """Bytes one layer saves for backward per token, on one GPU of a TP group (see module doc)."""
    h, f = m.hidden_size, m.intermediate_size
    unsplit = 4 * h * act_bytes  # 2 RMSNorm inputs + QKV input + fc1 input
    fc1_out = (2 if m.gated_mlp else 1) * f
    split = (
        (m.q_dim + 2 * m.kv_dim) * act_bytes  # Q, K, V kept by flash attention
        + m.q_dim * act_bytes  # attention output = input of the output projection
        + m.num_heads * 4  # fp32 log-sum-exp per head
        + fc1_out * act_bytes  # gate and up projections, inputs of SwiGLU
        + f * act_bytes  # SwiGLU output = input of fc2
    )
    return unsplit / (tp if sequence_parallel else 1) + split / tp


def layer_input_bytes_per_token(m: ModelShape, tp: int, sequence_parallel: bool, act_bytes: int = 2) -> float:
    """What full recompute keeps per layer and token: the layer's input."""
    return m.hidden_size * act_bytes / (tp if sequence_parallel else 1)


def activation_bytes(
    m: ModelShape,
    tokens: float,
    layers: int,
    in_flight: float,
    tp: int,
    sequence_parallel: bool,
    recompute: bool,
) -> float:
    """Peak activation bytes of a stage with `layers` layers holding `in_flight` micro-batches of
    `tokens` tokens each (per GPU, i.e. already divided by CP)."""
    full = activation_bytes_per_token_layer(m, tp, sequence_parallel)
    if not recompute:
        return tokens * full * layers * in_flight
    kept = layer_input_bytes_per_token(m, tp, sequence_parallel)
    return tokens * (kept * layers * in_flight + full)


def logits_bytes(tokens: float, padded_vocab: int, tp: int) -> float:
    """The LM head's vocab-parallel logits for one micro-batch: bf16 output plus an fp32 copy for
    the log-softmax / entropy (6 bytes per vocab entry per token)."""
    return tokens * (padded_vocab / tp) * 6


def in_flight_microbatches(stage_index: int, pp: int, num_microbatches: int, vpp: int | None) -> float:
    """Micro-batches whose activations a stage holds at the 1F1B peak: pp - stage_index for the
    non-interleaved schedule (the first stage holds pp); interleaving adds the factor
    1 + (pp - 1) / (pp * vpp) of Korthikanti et al. Sec. 4.2.3 (their m = vpp chunks)."""
    warmup = min(pp - stage_index, num_microbatches)
    if vpp and pp > 1:
        return warmup * (1 + (pp - 1) / (pp * vpp))
    return float(warmup)


def kv_heads_per_gpu(m: ModelShape, engine_tp: int) -> int:
    """SGLang splits KV heads over TP and replicates them when TP exceeds their number."""
    return max(1, math.ceil(m.num_kv_heads / engine_tp))


def kv_bytes_per_token(m: ModelShape, engine_tp: int, kv_dtype_bytes: int = 2) -> int:
    """KV-cache bytes per token on one GPU of an engine: 2 (K and V) * layers * kv_heads/TP *
    head_dim * dtype bytes."""
    return 2 * m.num_layers * kv_heads_per_gpu(m, engine_tp) * m.head_dim * kv_dtype_bytes


@dataclass(frozen=True)
class EngineMemory:
    static_pool: float  # mem_fraction_static * GPU memory: weights + KV cache
    weights: float
    kv_room: float
    kv_bytes_per_token: int

    @property
    def kv_tokens(self) -> int:
        """Tokens the engine's KV cache holds (each GPU holds its heads for every token)."""
        return max(0, int(self.kv_room // self.kv_bytes_per_token))


def engine_memory(
    m: ModelShape, total_params: int, engine_tp: int, gpu_bytes: float, mem_fraction: float
) -> EngineMemory:
    """SGLang sizes its static pool as mem_fraction_static of the GPU: bf16 weights (split over
    the engine's TP) first, the rest is KV cache."""
    pool = gpu_bytes * mem_fraction
    weights = total_params * 2 / engine_tp
    return EngineMemory(pool, weights, pool - weights, kv_bytes_per_token(m, engine_tp))
