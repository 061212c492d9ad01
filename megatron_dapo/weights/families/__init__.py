"""Per-architecture HF <-> Megatron weight maps."""

from __future__ import annotations

from megatron_dapo.weights.families.base import FamilyMap, Rule
from megatron_dapo.weights.families.llama import LLAMA
from megatron_dapo.weights.families.qwen2 import QWEN2
from megatron_dapo.weights.families.qwen2_moe import QWEN2_MOE
from megatron_dapo.weights.families.qwen3 import QWEN3
from megatron_dapo.weights.families.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, FamilyMap] = {m.architecture: m for m in (QWEN2, LLAMA, QWEN3, QWEN3_MOE, QWEN2_MOE)}


def family_map(architecture: str) -> FamilyMap:
    """The weight map of an HF architecture name (e.g. "Qwen2ForCausalLM")."""
    try:
        return FAMILIES[architecture]
    except KeyError:
        raise ValueError(
            f"no weight map for architecture {architecture!r}; supported: {', '.join(FAMILIES)}"
        ) from None


__all__ = ["FAMILIES", "FamilyMap", "Rule", "family_map"]
