"""Qwen3 dense config -> megatron TransformerConfig and weight map, checked against HF's own
Qwen3 config and state dict (the logits and bit-exact round trips are in
test_model_hf_equivalence.py and test_convert_roundtrip.py, parametrized over the families)."""

from __future__ import annotations

import pytest
from helpers import QWEN3_HEAD_DIM, hf_state_dict, tiny_hf_config

from megatron_dapo.actor.model import transformer_config_from_hf
from megatron_dapo.arch import ModelConfigError, arch_spec
from megatron_dapo.weights.plan import expected_hf_shapes


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_fields_map_onto_transformer_config(tied):
    hf = tiny_hf_config("qwen3", tie_word_embeddings=tied, hidden=64, heads=4, kv_heads=2)
    spec = arch_spec(hf)
    assert (spec.family, spec.qkv_bias, spec.qk_layernorm) == ("qwen3", False, True)
    assert spec.tie_word_embeddings is tied and spec.rope_theta == 1000000.0
    cfg = transformer_config_from_hf(hf, tp=2, pp=1)
    # head_dim is the config's (24), not hidden/heads (16).
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, QWEN3_HEAD_DIM)
    assert cfg.qk_layernorm and not cfg.add_qkv_bias and not cfg.add_bias_linear


def test_qwen3_with_attention_bias_or_sliding_window_is_refused():
    hf = tiny_hf_config("qwen3")
    hf.attention_bias = True
    with pytest.raises(ModelConfigError, match="Qwen3ForCausalLM with attention_bias"):
        arch_spec(hf)
    hf = tiny_hf_config("qwen3")
    hf.use_sliding_window = True
    with pytest.raises(ModelConfigError, match="Qwen3ForCausalLM with use_sliding_window"):
        arch_spec(hf)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_expected_names_and_shapes_equal_hfs_state_dict(tiny_hf_checkpoint, tied):
    from megatron_dapo.arch import load_hf_config

    path = tiny_hf_checkpoint(family="qwen3", tie_word_embeddings=tied, num_layers=2, seed=21)
    state = hf_state_dict(path)
    shapes = expected_hf_shapes(load_hf_config(path))
    assert shapes == {k: tuple(v.shape) for k, v in state.items()}
    assert shapes["model.layers.1.self_attn.q_norm.weight"] == (QWEN3_HEAD_DIM,)
