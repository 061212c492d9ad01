"""Model shapes for the planner: read from an HF `config.json`, or from a built-in table of the
Qwen2.5 family (and Qwen3-8B) so `megatron-dapo plan` works offline when `model.path` is a hub name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a decoder-only transformer that size its parameters and memory."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: int
    qkv_bias: bool = True  # Qwen2 has q/k/v biases; Llama does not.
    gated_mlp: bool = True  # SwiGLU: gate + up + down projections.
    qk_norm: bool = False  # Qwen3: an RMSNorm of head_dim weights on q and one on k per layer.
    # Mixture of experts (Qwen3-MoE: every layer's MLP is a router plus num_experts SwiGLU experts
    # of moe_intermediate_size, moe_topk of them per token; Qwen2-MoE adds one shared SwiGLU expert
    # every token passes through, with a one-output gate). For MoE shapes intermediate_size is the
    # FFN width one token passes through (topk x moe_intermediate_size + shared), which sizes
    # activations.
    num_experts: int = 0
    moe_topk: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim


def _qwen(name, hidden, inter, layers, heads, kv, vocab, tied) -> ModelShape:
    return ModelShape(name, hidden, inter, layers, heads, kv, vocab, tied, hidden // heads)


# Qwen/Qwen3-8B's config.json on the hub: head_dim 128 is its own field (4096/32 happens to agree),
# no qkv bias, q/k norms, untied head.
QWEN3: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("Qwen3-8B", 4096, 12288, 36, 32, 8, 151936, False, 128, qkv_bias=False, qk_norm=True),
        # Qwen/Qwen3-30B-A3B: 128 experts of 768, top-8 (8 x 768 = 6144 per token).
        ModelShape(
            "Qwen3-30B-A3B",
            2048,
            6144,
            48,
            32,
            4,
            151936,
            False,
            128,
            qkv_bias=False,
            qk_norm=True,
            num_experts=128,
            moe_topk=8,
            moe_intermediate_size=768,
        ),
    )
}

# From each model's config.json on the hub (Qwen/Qwen2.5-*; the -Instruct and -Math variants of the
# same size share these shapes).
QWEN2_5: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _qwen("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 151936, True),
        _qwen("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, True),
        _qwen("Qwen2.5-3B", 2048, 11008, 36, 16, 2, 151936, True),
        _qwen("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 152064, False),
        _qwen("Qwen2.5-14B", 5120, 13824, 48, 40, 8, 152064, False),
        _qwen("Qwen2.5-32B", 5120, 27648, 64, 40, 8, 152064, False),
    )
}

_TABLE = {**QWEN2_5, **QWEN3}

_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def shape_from_hf_config(cfg: dict, name: str = "model") -> ModelShape:
    """A ModelShape from the dict of an HF `config.json` (Qwen2 / Llama style keys)."""
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"{name}: config.json lacks {', '.join(missing)}; is it a decoder-only LM config?")
    moe = _moe_fields(cfg, name)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    model_type = str(cfg.get("model_type", "qwen2"))
    # Qwen2 always has q/k/v biases; Llama-style configs say so with `attention_bias`.
    qkv_bias = bool(cfg.get("attention_bias", model_type.startswith("qwen2")))
    fields = dict(
        name=name,
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        vocab_size=int(cfg["vocab_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        qkv_bias=qkv_bias,
        qk_norm=model_type.startswith("qwen3"),
    )
    return ModelShape(**{**fields, **moe})


def _moe_fields(cfg: dict, name: str) -> dict:
    """Qwen3-MoE's and Qwen2-MoE's expert fields (intermediate_size replaced by the per-token FFN
    width); {} for a dense config; other MoE layouts are refused by name."""
    if cfg.get("num_local_experts"):
        raise ValueError(
            f"{name}: num_local_experts (Mixtral-style MoE) is not supported; Qwen3-MoE and Qwen2-MoE are"
        )
    if not cfg.get("num_experts"):
        return {}
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(
            f"{name}: only MoE in every layer is supported (decoder_sparse_step=1, mlp_only_layers=[])"
        )
    topk, width = int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"])
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return dict(
        num_experts=int(cfg["num_experts"]),
        moe_topk=topk,
        moe_intermediate_size=width,
        shared_expert_intermediate_size=shared,
        intermediate_size=topk * width + shared,
    )


def _table_key(path: str) -> str | None:
    """'Qwen/Qwen2.5-32B-Instruct' or '/ckpt/qwen2.5-7b-math' -> the table's size entry."""
    base = path.rstrip("/").rsplit("/", 1)[-1].lower()
    for key in sorted(_TABLE, key=len, reverse=True):
        stem = key.lower()
        if base == stem or base.startswith(stem + "-"):
            return key
    return None


def resolve_model_shape(path: str, key: str = "model.path") -> ModelShape:
    """`path/config.json` when it exists, else the built-in Qwen2.5 entry the name points at.
    ``key``: the config key that gave ``path`` (named in errors)."""
    f = Path(path) / "config.json"
    if f.is_file():
        try:
            return shape_from_hf_config(json.loads(f.read_text()), name=str(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"{key}: {f} is not valid JSON ({e})") from e
    entry = _table_key(path)
    if entry is None:
        known = ", ".join(f"Qwen/{k}" for k in _TABLE)
        raise ValueError(
            f"{key}={path!r}: no config.json there and not a known hub name; point {key} at an "
            f"HF checkpoint directory or use one of {known}"
        )
    return _TABLE[entry]
