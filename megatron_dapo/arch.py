"""The model's architecture as this package needs it, read from an HF config.json.

Below both the actor (which builds a megatron model from it) and the weight maps (which name and
shape HF tensors from it): imports neither, nor megatron.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "Qwen2ForCausalLM",
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
)


class ModelConfigError(ValueError):
    """The HF config or the requested precision cannot be mapped onto megatron-core."""


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported HF families, read from config.json."""

    architecture: str
    family: str  # "qwen2" | "qwen3" | "qwen3_moe" | "qwen2_moe" | "llama"
    qkv_bias: bool
    qk_layernorm: bool  # Qwen3: RMSNorm over head_dim on each q and k head, before RoPE
    tie_word_embeddings: bool
    head_dim: int
    rope_theta: float
    rope_scaling_factor: float | None  # llama3-style scaling, None when off
    num_experts: int = 0  # 0: dense MLP in every layer
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    # Qwen2-MoE: one shared expert of this FFN size in every MoE layer, its output scaled by
    # sigmoid(shared_expert_gate(x)); 0: none
    shared_expert_ffn_hidden_size: int = 0
    # The load-balancing loss coefficient HF trains with: router_aux_loss_coef, but only when
    # output_router_logits is true (HF's forward adds the loss only then); 0 otherwise.
    router_aux_loss_coef: float = 0.0


def load_hf_config(hf_dir_or_config: Any) -> Any:
    """An HF ``PretrainedConfig`` from a directory, a config.json path, a dict or a config object."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(hf_dir_or_config, PretrainedConfig):
        return hf_dir_or_config
    if isinstance(hf_dir_or_config, dict):
        data = dict(hf_dir_or_config)
        model_type = data.pop("model_type", None)
        if model_type is None:
            raise ModelConfigError("HF config dict has no 'model_type'")
        return AutoConfig.for_model(model_type, **data)
    path = Path(hf_dir_or_config)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise FileNotFoundError(f"HF config not found: {config_file} (expected an HF model directory)")
    try:
        data = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{config_file} is not valid JSON: {e}") from e
    return load_hf_config(data)


def _architecture(hf_config: Any) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        by_type = {
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM",
            "llama": "LlamaForCausalLM",
        }
        if hf_config.model_type in by_type:
            return by_type[hf_config.model_type]
        raise ModelConfigError(
            f"HF config (model_type={hf_config.model_type!r}) names no architecture; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"unsupported architecture {archs[0]!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0]


def _rope(hf_config: Any) -> tuple[float, float | None]:
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        # megatron-core implements Llama-3.1 scaling with these constants fixed.
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, want in fixed.items():
            if float(params.get(key, want)) != float(want):
                raise ModelConfigError(
                    f"rope_scaling.{key}={params[key]} is not supported (megatron-core fixes it to {want})"
                )
        return float(theta), float(params.get("factor", 8.0))
    raise ModelConfigError(f"rope scaling type {rope_type!r} is not supported; supported: default, llama3")


def arch_spec(hf_config: Any) -> ArchSpec:
    """Validate ``hf_config`` and extract the family-specific switches."""
    arch = _architecture(hf_config)
    family = {
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "Qwen2MoeForCausalLM": "qwen2_moe",
    }.get(arch, "llama")
    if family != "llama" and getattr(hf_config, "use_sliding_window", False):
        raise ModelConfigError(f"{arch} with use_sliding_window=true is not supported")
    if family == "qwen2":
        qkv_bias = True
    elif family == "qwen2_moe":
        qkv_bias = bool(getattr(hf_config, "qkv_bias", True))
    else:
        # Qwen3's and Llama's configs both carry attention_bias (False in every released model).
        if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
            raise ModelConfigError(f"{arch} with attention_bias or mlp_bias is not supported")
        qkv_bias = False
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"hidden_act={act!r} is not supported (SwiGLU with silu only)")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    theta, scaling = _rope(hf_config)
    moe = _moe_fields(hf_config, arch) if family in ("qwen3_moe", "qwen2_moe") else {}
    return ArchSpec(
        architecture=arch,
        family=family,
        qkv_bias=qkv_bias,
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling_factor=scaling,
        **moe,
    )


def _moe_fields(hf_config: Any, arch: str) -> dict[str, Any]:
    """Qwen3-MoE's / Qwen2-MoE's expert settings; only an MoE block in every layer (all released
    Qwen3-MoE and Qwen2-MoE) maps onto megatron's uniform layer spec."""
    step = getattr(hf_config, "decoder_sparse_step", 1)
    dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
    if step != 1 or dense:
        raise ModelConfigError(
            f"{arch} with dense layers (decoder_sparse_step={step}, mlp_only_layers={dense}) "
            "is not supported; every layer must be MoE (decoder_sparse_step=1, mlp_only_layers=[])"
        )
    return dict(
        num_experts=int(hf_config.num_experts),
        moe_topk=int(hf_config.num_experts_per_tok),
        moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_expert_ffn_hidden_size=int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0),
        router_aux_loss_coef=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
        if getattr(hf_config, "output_router_logits", False)
        else 0.0,
    )
