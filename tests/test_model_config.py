"""HF config -> TransformerConfig mapping, precision errors, and the CPU compat pieces."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_hf_config

from megatron_dapo.actor import compat
from megatron_dapo.actor.model import padded_vocab_size, transformer_config_from_hf
from megatron_dapo.arch import ModelConfigError, arch_spec, load_hf_config


def test_qwen2_fields_map_onto_transformer_config():
    hf = tiny_hf_config("qwen2", hidden=64, heads=4, kv_heads=2, num_layers=2)
    cfg = transformer_config_from_hf(hf, tp=2, pp=1)
    assert (cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 2, 16)
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and cfg.gated_linear_unit
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == hf.rms_norm_eps
    assert cfg.tensor_model_parallel_size == 2 and cfg.params_dtype == torch.float32
    assert cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0


def test_llama_has_no_bias_and_reads_rope_theta_and_llama3_scaling():
    hf = tiny_hf_config("llama", tie_word_embeddings=True)
    spec = arch_spec(hf)
    assert not spec.qkv_bias and spec.tie_word_embeddings and spec.rope_theta == 500000.0
    assert spec.rope_scaling_factor is None
    hf.rope_parameters = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert arch_spec(hf).rope_scaling_factor == 32.0
    hf.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ModelConfigError, match="rope scaling type 'yarn' is not supported"):
        arch_spec(hf)


def test_config_loads_from_dict_and_rejects_unknown_architecture():
    hf = load_hf_config({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64})
    assert arch_spec(hf).family == "qwen2"
    other = load_hf_config({"model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ModelConfigError, match="supported: Qwen2ForCausalLM, LlamaForCausalLM"):
        transformer_config_from_hf(other)


def test_layout_errors():
    hf = tiny_hf_config("qwen2", num_layers=3)
    with pytest.raises(ModelConfigError, match="num_hidden_layers=3 is not divisible by pp\\*vpp=2\\*1"):
        transformer_config_from_hf(hf, pp=2)


@pytest.mark.skipif(not compat.on_cpu(), reason="checks the CPU-side FP8 refusal")
def test_fp8_without_gpu_is_a_config_error_that_says_why():
    with pytest.raises(ModelConfigError, match="compute capability >= 8.9"):
        transformer_config_from_hf(tiny_hf_config(), fp8="e4m3")
    with pytest.raises(ModelConfigError, match="fp8='e5m2' is not a valid FP8 format"):
        transformer_config_from_hf(tiny_hf_config(), fp8="e5m2")


def test_padded_vocab_is_multiple_of_divisor_times_tp():
    assert padded_vocab_size(256, 1) == 256
    assert padded_vocab_size(256, 4) == 512
    assert padded_vocab_size(151936, 2) == 152064  # Qwen2.5 vocab at TP=2
    assert padded_vocab_size(151936, 1) == 151936


@pytest.mark.skipif(not compat.on_cpu(), reason="CPU path only")
def test_cpu_compat_basics_and_rng_tracker_streams():
    compat.apply_cpu_compat()
    compat.apply_cpu_compat()  # idempotent
    assert compat.dist_backend() == "gloo" and compat.device() == torch.device("cpu")
    assert torch.cuda.current_device() == torch.device("cpu")
    tracker = compat.CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(5)
    with tracker.fork():
        a = torch.rand(3)
    after_fork = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_fork, torch.rand(3)), "fork must leave the default stream untouched"
    torch.manual_seed(123)
    assert torch.equal(a, torch.rand(3)), "the stream starts from its own seed"
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b), "the stream advances across forks"
    with pytest.raises(ValueError, match="already used"):
        tracker.add("other", 123)
