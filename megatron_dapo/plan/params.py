"""Parameter counts of a decoder-only transformer, whole and per Megatron model-parallel rank."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_dapo.plan.models import ModelShape


@dataclass(frozen=True)
class ParamCount:
    embedding: int
    attention_per_layer: int
    mlp_per_layer: int
    norms_per_layer: int
    final_norm: int
    output_head: int  # 0 when tied to the embedding
    experts_per_layer: int = 0  # the part of mlp_per_layer in experts (split over EP)
    active_experts_per_layer: int = 0  # the experts one token passes through (top-k of them)

    @property
    def per_layer(self) -> int:
        return self.attention_per_layer + self.mlp_per_layer + self.norms_per_layer

    def total(self, num_layers: int) -> int:
        return self.embedding + num_layers * self.per_layer + self.final_norm + self.output_head

    def active(self, num_layers: int) -> int:
        """Parameters one token uses: the total less the experts it is not routed to (= total for
        a dense model)."""
        return self.total(num_layers) - num_layers * (self.experts_per_layer - self.active_experts_per_layer)


def count_params(m: ModelShape, vocab: int | None = None) -> ParamCount:
    """Exact parameter count (as in the HF checkpoint when `vocab` is the HF vocab size).

    Attention: q (h x q_dim), k and v (h x kv_dim each, GQA), o (q_dim x h), plus q/k/v biases when
    the family has them (Qwen2). MLP: gate, up (h x ffn) and down (ffn x h) for SwiGLU. Two RMSNorm
    weights per layer (plus Qwen3's q and k norms, head_dim each, replicated over TP like the
    others), one final norm; the LM head is shared with the embedding when tied.
    """
    v = m.vocab_size if vocab is None else vocab
    h, f = m.hidden_size, m.intermediate_size
    attn = h * m.q_dim + 2 * h * m.kv_dim + m.q_dim * h
    if m.qkv_bias:
        attn += m.q_dim + 2 * m.kv_dim
    mlp = (3 if m.gated_mlp else 2) * h * f
    experts = active = 0
    if m.num_experts:
        # Router (num_experts x h, no bias) plus SwiGLU experts; Qwen2-MoE's shared expert (every
        # token, so outside experts_per_layer: replicated over EP like attention) and its gate (h x 1).
        expert = 3 * h * m.moe_intermediate_size
        experts, active = m.num_experts * expert, m.moe_topk * expert
        mlp = m.num_experts * h + experts
        if m.shared_expert_intermediate_size:
            mlp += 3 * h * m.shared_expert_intermediate_size + h
    return ParamCount(
        experts_per_layer=experts,
        active_experts_per_layer=active,
        embedding=v * h,
        attention_per_layer=attn,
        mlp_per_layer=mlp,
        norms_per_layer=2 * h + (2 * m.head_dim if m.qk_norm else 0),
        final_norm=h,
        output_head=0 if m.tie_word_embeddings else v * h,
    )


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by * TP."""
    multiple = divisible_by * tp
    return math.ceil(vocab / multiple) * multiple


@dataclass(frozen=True)
class StageParams:
    """Parameters on one GPU of a pipeline stage that holds `layers` transformer layers."""

    stage: str  # "only" (PP=1), "first" or "last"
    layers: int
    params: int
    has_head: bool  # computes the logits (last stage)
    expert_params: int = (
        0  # the part of params in MoE experts (their grads/optimizer shard over EP x expert-DP)
    )


def params_per_gpu(
    m: ModelShape, tp: int, pp: int, divisible_by: int = 128, ep: int = 1
) -> list[StageParams]:
    """Parameters on one GPU of the first and last pipeline stage (one entry when PP=1).

    Linear weights and biases split over TP; RMSNorm weights are replicated (small). The word
    embedding (vocab-parallel, padded) sits on the first stage, the final norm and LM head on the
    last; with PP > 1 a tied embedding is held on both (Megatron keeps a copy on the last stage and
    all-reduces their grads). Middle stages hold only layers, so they are never the largest.
    MoE experts split over EP x TP (megatron's expert tensor parallel size defaults to TP).
    """
    if m.num_layers % pp:
        raise ValueError(f"{m.num_layers} layers do not split into {pp} pipeline stages")
    if m.num_experts % ep:
        raise ValueError(f"{m.num_experts} experts do not split over expert parallel size {ep}")
    c = count_params(m, padded_vocab(m.vocab_size, divisible_by, tp))
    layers = m.num_layers // pp
    experts = layers * (c.experts_per_layer // (tp * ep))
    body = layers * (
        (c.attention_per_layer + c.mlp_per_layer - c.experts_per_layer) // tp + c.norms_per_layer
    )
    body += experts
    emb = c.embedding // tp
    head = emb if m.tie_word_embeddings else c.output_head // tp
    if pp == 1:
        untied_head = 0 if m.tie_word_embeddings else head
        return [StageParams("only", layers, body + emb + c.final_norm + untied_head, True, experts)]
    return [
        StageParams("first", layers, body + emb, False, experts),
        StageParams("last", layers, body + c.final_norm + head, True, experts),
    ]
