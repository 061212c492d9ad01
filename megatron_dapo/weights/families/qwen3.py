"""Qwen3 dense (Qwen3ForCausalLM): Llama's names plus a per-head RMSNorm on q and k.

``q_norm``/``k_norm`` weights have ``head_dim`` entries shared by every head, so every TP rank
holds them whole (megatron's ``q_layernorm``/``k_layernorm`` act on [.., heads, head_dim]).
No q/k/v bias; ``head_dim`` is its own config field (128 in every Qwen3, not hidden/heads).
"""

from dataclasses import replace

from megatron_dapo.weights.families.base import Rule
from megatron_dapo.weights.families.llama import LLAMA
from megatron_dapo.weights.families.qwen2 import LAYER

_QK_NORMS = (
    Rule(("self_attention.q_layernorm.weight",), (LAYER + "self_attn.q_norm.weight",), "replicated"),
    Rule(("self_attention.k_layernorm.weight",), (LAYER + "self_attn.k_norm.weight",), "replicated"),
)


def _with_qk_norms(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """``rules`` with the q/k norms right after o_proj, where HF's state dict lists them."""
    out: list[Rule] = []
    for r in rules:
        out.append(r)
        if r.megatron == ("self_attention.linear_proj.weight",):
            out.extend(_QK_NORMS)
    return tuple(out)


QWEN3 = replace(LLAMA, architecture="Qwen3ForCausalLM", layer_rules=_with_qk_norms(LLAMA.layer_rules))
