"""The declarative form of a model family's HF <-> Megatron weight map."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter and the HF tensors it is made of.

    ``megatron``: the parameter's name under each layer spec it may take (the local spec's
    separate norm first, TE's fused ``layer_norm_weight`` second); names below
    ``decoder.layers.{i}.`` are relative to a layer and ``{i}`` in ``hf`` is the *global* layer
    index (PP/VPP offsets applied). ``kind`` is a layout of :mod:`megatron_dapo.weights.layout`.
    ``when``: a switch of the family map that must be on (e.g. "qkv_bias", "untied").
    """

    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    kind: str
    when: str | None = None


@dataclass(frozen=True)
class FamilyMap:
    """All rules of one HF architecture; ``layer_rules`` apply to every transformer layer."""

    architecture: str
    global_rules: tuple[Rule, ...]
    layer_rules: tuple[Rule, ...]
