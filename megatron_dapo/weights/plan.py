"""Bind each parameter of this rank's Megatron model chunks to its HF tensors and layout."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from megatron_dapo.arch import arch_spec
from megatron_dapo.weights.families import Rule, family_map
from megatron_dapo.weights.layout import Dims
from megatron_dapo.weights.model_io import unwrap

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"local_experts\.(\d+)\.")


@dataclass
class Binding:
    """One local Megatron parameter, the HF tensors it holds (global layer index applied) and how.

    ``export`` is False for the last stage's copy of a tied embedding (PP > 1): it is loaded from
    ``model.embed_tokens.weight`` but never exported, since HF ties it to the first stage's copy.
    """

    chunk: int
    megatron_name: str
    param: torch.Tensor
    hf_names: tuple[str, ...]
    kind: str
    export: bool = True


def dims_of(hf_config: Any, padded_vocab_size: int) -> Dims:

    spec = arch_spec(hf_config)
    return Dims(
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        head_dim=spec.head_dim,
        vocab_size=hf_config.vocab_size,
        padded_vocab_size=padded_vocab_size,
    )


def _switches(hf_config: Any) -> set[str]:

    spec = arch_spec(hf_config)
    on = set()
    if spec.qkv_bias:
        on.add("qkv_bias")
    if not spec.tie_word_embeddings:
        on.add("untied")
    return on


def _index(rules: tuple[Rule, ...], on: set[str]) -> dict[str, Rule]:
    return {name: r for r in rules if r.when is None or r.when in on for name in r.megatron}


def bind(model_chunks: list[Any], hf_config: Any) -> list[Binding]:
    """Bindings of every parameter of ``model_chunks`` in model order; raises naming any parameter
    the family map does not cover (an unknown layer spec) or any HF tensor left unbound."""

    spec = arch_spec(hf_config)
    fmap = family_map(spec.architecture)
    on = _switches(hf_config)
    global_rules = _index(fmap.global_rules, on)
    layer_rules = _index(fmap.layer_rules, on)
    out: list[Binding] = []
    # Megatron numbers experts locally; EP rank r holds global experts r*n .. r*n + n-1.
    expert_offset = _expert_offset(spec.num_experts)
    for c, chunk in enumerate(model_chunks):
        chunk = unwrap(chunk)
        layers = chunk.decoder.layers
        for name, param in chunk.named_parameters():
            m = _LAYER.match(name)
            if m:
                # Expert parameters share one rule; the global index goes into the HF name.
                e = _EXPERT.search(m.group(2))
                rule = layer_rules.get(_EXPERT.sub("local_experts.{e}.", m.group(2)))
                if rule is None:
                    raise KeyError(f"no HF mapping for Megatron parameter {name!r} ({spec.architecture})")
                layer = layers[int(m.group(1))].layer_number - 1
                expert = str(expert_offset + int(e.group(1))) if e else ""
                hf = tuple(h.format(i=layer, e=expert) for h in rule.hf)
                out.append(Binding(c, name, param, hf, rule.kind))
            elif name == "output_layer.weight" and spec.tie_word_embeddings:
                out.append(Binding(c, name, param, ("model.embed_tokens.weight",), "vocab", export=False))
            elif name in global_rules:
                rule = global_rules[name]
                out.append(Binding(c, name, param, rule.hf, rule.kind))
            else:
                raise KeyError(f"no HF mapping for Megatron parameter {name!r} ({spec.architecture})")
    return out


def _expert_offset(num_experts: int) -> int:
    """Global index of this rank's first local expert (0 without MoE or expert parallelism)."""
    from megatron.core import parallel_state as ps

    if not num_experts or not ps.model_parallel_is_initialized():
        return 0
    return ps.get_expert_model_parallel_rank() * (num_experts // ps.get_expert_model_parallel_world_size())


def is_expert(binding: Binding) -> bool:
    """Whether the parameter is one expert's (split over expert-parallel ranks, not replicated)."""
    return ".mlp.experts." in binding.hf_names[0]


def expected_hf_names(hf_config: Any) -> list[str]:
    """Every tensor name of the HF checkpoint of ``hf_config``, in HF's order."""

    spec = arch_spec(hf_config)
    fmap = family_map(spec.architecture)
    on = _switches(hf_config)
    live = [r for r in fmap.global_rules if r.when is None or r.when in on]
    names = list(live[0].hf)
    for i in range(hf_config.num_hidden_layers):
        for r in fmap.layer_rules:
            if r.when is None or r.when in on:
                experts = range(spec.num_experts) if "{e}" in r.hf[0] else [""]
                names.extend(h.format(i=i, e=e) for e in experts for h in r.hf)
    for r in live[1:]:
        names.extend(r.hf)
    return names


def expected_hf_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor implied by ``hf_config`` (to reject mismatching checkpoints
    before any rank starts)."""

    spec = arch_spec(hf_config)
    h, hd, v = hf_config.hidden_size, spec.head_dim, hf_config.vocab_size
    heads = hf_config.num_attention_heads
    kv = hf_config.num_key_value_heads or heads
    ffn = hf_config.intermediate_size
    by_suffix = {
        "embed_tokens.weight": (v, h),
        "lm_head.weight": (v, h),
        "norm.weight": (h,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "q_proj.weight": (heads * hd, h),
        "k_proj.weight": (kv * hd, h),
        "v_proj.weight": (kv * hd, h),
        "q_proj.bias": (heads * hd,),
        "k_proj.bias": (kv * hd,),
        "v_proj.bias": (kv * hd,),
        "o_proj.weight": (h, heads * hd),
        "q_norm.weight": (hd,),
        "k_norm.weight": (hd,),
        "gate_proj.weight": (ffn, h),
        "up_proj.weight": (ffn, h),
        "down_proj.weight": (h, ffn),
    }
    moe_ffn = spec.moe_ffn_hidden_size
    expert = {
        "gate_proj.weight": (moe_ffn, h),
        "up_proj.weight": (moe_ffn, h),
        "down_proj.weight": (h, moe_ffn),
    }
    out = {}
    for name in expected_hf_names(hf_config):
        suffix = ".".join(name.split(".")[-2:])
        if name.endswith("mlp.gate.weight"):
            out[name] = (spec.num_experts, h)
        elif name.endswith("shared_expert_gate.weight"):
            out[name] = (1, h)
        elif ".shared_expert." in name:
            out[name] = _ffn_shapes(spec.shared_expert_ffn_hidden_size, h)[suffix]
        elif ".experts." in name:
            out[name] = expert[suffix]
        else:
            out[name] = by_suffix[suffix]
    return out


def _ffn_shapes(ffn: int, h: int) -> dict[str, tuple[int, int]]:
    return {"gate_proj.weight": (ffn, h), "up_proj.weight": (ffn, h), "down_proj.weight": (h, ffn)}
