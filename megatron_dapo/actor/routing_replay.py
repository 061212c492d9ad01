"""Rollout routing replay: the trainer's MoE routers use the experts the rollout engine chose.

Why: a MoE router near a tie picks different experts in the trainer than in the engine (weights a
sync apart, other kernels, other rounding), and the token's log-prob then comes from another
network; the importance ratios of those tokens explode. Replaying the engine's choice makes the
trainer score the network that sampled the token.

What is replayed: megatron-core's ``RouterReplay`` (``moe_enable_routing_replay``) in its
REPLAY_FORWARD action replaces the router's top-k *indices* by the given ones and takes the
probabilities from the trainer's own scores at those indices (``scores.gather``), so the router
still gets gradients. With Qwen3's ``norm_topk_prob`` the scores are the logits and the softmax
over the k gathered logits is the renormalised top-k of the full softmax; without it the scores
are the full softmax. That is exactly an HF forward whose top-k is forced to the recorded experts.

Layout: ``routed_experts`` of a micro-batch is ``[b, L, layers, k]`` in token positions (the
collated rows). megatron's router sees the hidden states as ``[L, b, h]`` flattened, so a layer's
indices are handed over transposed to ``[L * b, k]``. A pipeline stage's chunk holds only its
layers; each router takes the slice of its own global layer number. Context parallelism cuts the
tensor along the sequence with the other per-position fields; under sequence parallelism (MoE at
TP > 1) each TP rank's routers see their shard of the sequence and take those rows.
"""

from __future__ import annotations

from typing import Any

import torch


class RoutingReplayError(ValueError):
    """Recorded experts that do not fit the model or the batch."""


def _routers(chunk: Any) -> list[tuple[int, Any]]:
    """``(global layer index from 0, router)`` of every MoE layer of a model chunk."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [(int(m.layer_number) - 1, m) for m in chunk.modules() if isinstance(m, TopKRouter)]


# [differing, counted] (token, MoE layer) routings at counted positions since reset_counts():
# the trainer's own top-k set against the replayed one.
_COUNTS = torch.zeros(2, dtype=torch.float64)


def reset_counts() -> None:
    _COUNTS.zero_()


def take_counts() -> torch.Tensor:
    """``[differing, counted]`` since :func:`reset_counts` on this rank."""
    return _COUNTS.clone()


def _count_mismatch(router: Any, args: tuple, out: tuple) -> None:
    """Forward hook: how many counted tokens' own top-k differs from the routing used (the
    replayed one). One extra gating matmul per MoE layer, without autograd."""
    mask = getattr(router, "_replay_count_mask", None)
    if mask is None:
        return
    with torch.no_grad():
        logits = router.gating(args[0]).reshape(-1, router.config.num_moe_experts)
        own = torch.zeros_like(out[1], dtype=torch.bool)
        own.scatter_(1, logits.topk(router.topk, dim=-1).indices, True)
        differs = (own != out[1].bool()).any(dim=-1)
        mask = mask.to(differs.device)
        _COUNTS[0] += float((differs & mask).sum())
        _COUNTS[1] += float(mask.sum())


def apply(chunk: Any, routed_experts: torch.Tensor | None, count_mask: torch.Tensor | None = None) -> None:
    """Make the chunk's routers replay ``routed_experts`` ([b, L, layers, k]) in the next forward,
    or route by their own top-k when it is None. ``count_mask`` ([b, L] bool): the positions whose
    own-vs-replayed routing difference is counted (see :func:`take_counts`)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for layer, router in _routers(chunk):
        replay = router.router_replay
        if routed_experts is None:
            router._replay_count_mask = None
            if replay is not None:
                replay.clear_indices()
                replay.clear_router_replay_action()
            continue
        if replay is None:
            raise RoutingReplayError(
                "the batch carries routed experts but the model was built without routing replay; "
                "set actor.routing_replay: rollout (moe_enable_routing_replay)"
            )
        b, length, layers, k = routed_experts.shape
        if layer >= layers or k != router.topk:
            raise RoutingReplayError(
                f"routed_experts has {layers} layers x top-{k}; the model's MoE layer {layer} routes "
                f"top-{router.topk}: the rollout engine served another model"
            )
        # Set directly rather than with set_target_indices, which also appends to the list kept
        # for activation recomputation and would grow by one tensor per forward.
        rows = _sequence_shard(router.config, length * b)
        replay.target_topk_idx = (
            routed_experts[:, :, layer].transpose(0, 1).reshape(length * b, k)[rows].long()
        )
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        if not getattr(router, "_replay_hooked", False):
            router.register_forward_hook(_count_mismatch)
            router._replay_hooked = True
        router._replay_count_mask = (
            None if count_mask is None else count_mask.transpose(0, 1).reshape(-1)[rows]
        )


def _sequence_shard(config: Any, tokens: int) -> slice:
    """The rows of the flattened ``[L * b]`` positions this rank's routers see. Sequence parallel
    (forced for MoE at TP > 1) scatters the hidden states along the sequence before the MoE
    layer: TP rank r holds positions ``[r L / tp, (r + 1) L / tp)`` of every row, which are rows
    ``r tokens / tp`` on of the sequence-major flattening."""
    if not getattr(config, "sequence_parallel", False):
        return slice(None)
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    per_rank = tokens // tp
    return slice(rank * per_rank, (rank + 1) * per_rank)


def keep_only_instances_of(chunks: list) -> None:
    """megatron-core appends every RouterReplay it creates to a class-level list and never drops
    one: each model built in a process (a test's actors, a rebuilt actor) would keep its replay
    targets alive. Keep the list to the routers of the model just built."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.global_router_replay_instances[:] = [
        router.router_replay
        for chunk in chunks
        for _, router in _routers(chunk)
        if router.router_replay is not None
    ]


def check_supported(config: Any) -> None:
    """Replay sets one target per router per forward; activation recomputation would rerun a
    router in the backward pass against the target of a later micro-batch."""
    if getattr(config, "recompute_granularity", None):
        raise RoutingReplayError(
            "actor.routing_replay: rollout does not support activation recomputation yet "
            "(recompute reruns the routers in backward); turn recompute off"
        )


def pad_value(k: int) -> torch.Tensor:
    """Experts for positions nobody recorded (padding, a sequence's last token): their outputs
    reach no scored log-prob under causal attention, any valid distinct experts do."""
    return torch.arange(k, dtype=torch.int32)
