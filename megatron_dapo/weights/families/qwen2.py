"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): GQA, bias on q/k/v only, SwiGLU, RMSNorm, tied or untied."""

from megatron_dapo.weights.families.base import FamilyMap, Rule

LAYER = "model.layers.{i}."

QWEN2 = FamilyMap(
    architecture="Qwen2ForCausalLM",
    global_rules=(
        Rule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), "vocab"),
        Rule(("decoder.final_layernorm.weight",), ("model.norm.weight",), "replicated"),
        Rule(("output_layer.weight",), ("lm_head.weight",), "vocab", when="untied"),
    ),
    layer_rules=(
        Rule(
            ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
            (LAYER + "input_layernorm.weight",),
            "replicated",
        ),
        Rule(
            ("self_attention.linear_qkv.weight",),
            (
                LAYER + "self_attn.q_proj.weight",
                LAYER + "self_attn.k_proj.weight",
                LAYER + "self_attn.v_proj.weight",
            ),
            "qkv",
        ),
        Rule(
            ("self_attention.linear_qkv.bias",),
            (
                LAYER + "self_attn.q_proj.bias",
                LAYER + "self_attn.k_proj.bias",
                LAYER + "self_attn.v_proj.bias",
            ),
            "qkv",
            when="qkv_bias",
        ),
        Rule(("self_attention.linear_proj.weight",), (LAYER + "self_attn.o_proj.weight",), "row"),
        Rule(
            ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
            (LAYER + "post_attention_layernorm.weight",),
            "replicated",
        ),
        Rule(
            ("mlp.linear_fc1.weight",),
            (LAYER + "mlp.gate_proj.weight", LAYER + "mlp.up_proj.weight"),
            "gate_up",
        ),
        Rule(("mlp.linear_fc2.weight",), (LAYER + "mlp.down_proj.weight",), "row"),
    ),
)
