"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (q/k norms, head_dim, no bias) with a
top-k router and SwiGLU experts in place of the dense MLP in every layer, no shared expert.

``{e}`` in a name is the expert index (megatron's ``local_experts.{e}``, HF's ``experts.{e}``),
global in HF names; EP rank r holds experts r*n .. r*n+n-1 (n = num_experts / EP), see
``weights.plan.bind``.
"""

from dataclasses import replace

from megatron_dapo.weights.families.base import Rule
from megatron_dapo.weights.families.qwen2 import LAYER
from megatron_dapo.weights.families.qwen3 import QWEN3

_DENSE_MLP = {("mlp.linear_fc1.weight",), ("mlp.linear_fc2.weight",)}

_MOE = (
    Rule(("mlp.router.weight",), (LAYER + "mlp.gate.weight",), "replicated"),
    Rule(
        ("mlp.experts.local_experts.{e}.linear_fc1.weight",),
        (LAYER + "mlp.experts.{e}.gate_proj.weight", LAYER + "mlp.experts.{e}.up_proj.weight"),
        "gate_up",
    ),
    Rule(
        ("mlp.experts.local_experts.{e}.linear_fc2.weight",),
        (LAYER + "mlp.experts.{e}.down_proj.weight",),
        "row",
    ),
)


def moe_rules(rules: tuple[Rule, ...], extra: tuple[Rule, ...] = ()) -> tuple[Rule, ...]:
    """A dense family's layer rules with the MLP replaced by router and experts (then ``extra``,
    e.g. a shared expert)."""
    out: list[Rule] = []
    for r in rules:
        if r.megatron in _DENSE_MLP:
            continue
        if r.hf == (LAYER + "post_attention_layernorm.weight",):
            # The MoE layer has no fused fc1 to carry the norm: it is always the separate one.
            r = replace(r, megatron=("pre_mlp_layernorm.weight",))
        out.append(r)
        if r.megatron == ("pre_mlp_layernorm.weight",):
            out.extend(_MOE + extra)
    return tuple(out)


QWEN3_MOE = replace(QWEN3, architecture="Qwen3MoeForCausalLM", layer_rules=moe_rules(QWEN3.layer_rules))
