"""Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2's attention (q/k/v bias) with Qwen3-MoE's router and
experts, plus one shared expert per layer whose output is scaled by a sigmoid gate.

megatron's ``mlp.shared_experts`` (SharedExpertMLP with ``moe_shared_expert_gate``) holds the
fused gate/up projection, the down projection and ``gate_weight`` ([1, hidden], HF's
``shared_expert_gate.weight``).
"""

from dataclasses import replace

from megatron_dapo.weights.families.base import Rule
from megatron_dapo.weights.families.qwen2 import LAYER, QWEN2
from megatron_dapo.weights.families.qwen3_moe import moe_rules

_SHARED_EXPERT = (
    Rule(
        ("mlp.shared_experts.linear_fc1.weight",),
        (LAYER + "mlp.shared_expert.gate_proj.weight", LAYER + "mlp.shared_expert.up_proj.weight"),
        "gate_up",
    ),
    Rule(("mlp.shared_experts.linear_fc2.weight",), (LAYER + "mlp.shared_expert.down_proj.weight",), "row"),
    Rule(("mlp.shared_experts.gate_weight",), (LAYER + "mlp.shared_expert_gate.weight",), "replicated"),
)

QWEN2_MOE = replace(
    QWEN2, architecture="Qwen2MoeForCausalLM", layer_rules=moe_rules(QWEN2.layer_rules, _SHARED_EXPERT)
)
