"""Llama 2/3 (LlamaForCausalLM): GQA, no biases, SwiGLU, RMSNorm; tied (Llama-3.2 1B/3B) or not.

Same HF names as Qwen2 minus the q/k/v biases.
"""

from dataclasses import replace

from megatron_dapo.weights.families.qwen2 import QWEN2

LLAMA = replace(
    QWEN2,
    architecture="LlamaForCausalLM",
    layer_rules=tuple(r for r in QWEN2.layer_rules if r.when != "qkv_bias"),
)
