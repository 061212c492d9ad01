"""The MoE routers' load-balancing loss in the training objective (``actor.moe_aux_loss_coeff``).

What: for each MoE layer and each sequence, HF transformers' ``load_balancing_loss_func`` (the
Switch Transformer loss Qwen3-MoE / Qwen2-MoE train with), ``E * sum_e f_e * P_e`` with ``f_e``
the fraction of the sequence's top-k assignments that went to expert ``e`` and ``P_e`` the mean
router probability of ``e`` over the sequence's tokens (padding excluded). A micro-batch's loss
is the mean over the MoE layers of ``sum_s w_s * loss_s``, with ``w_s`` from
:func:`megatron_dapo.algo.sequence_weights`: the policy loss's mode and *global* normalisers, so
micro-batches and data-parallel ranks add up to the mini-batch's value whatever the layout.

Why per sequence and per layer rather than HF's pooling of every row and every layer of a
forward into one ``f`` and ``P``: pooling makes the value depend on which sequences share a
micro-batch (so on the token budget, DP/EP size) and, across pipeline stages, needs every
stage's counts before any backward. Per layer is how megatron-core balances each router; the mean
over layers (not megatron's sum) keeps HF's coefficient scale (a uniform router scores top-k
either way). For a single-sequence, single-layer forward the value *is* HF's.

How: a forward hook on each ``TopKRouter`` recomputes the router logits from its input (one
gating matmul, differentiable), counts the routing the router used (the replayed one under
routing replay), and when the coefficient is > 0 attaches ``coeff * loss`` to the router's
probabilities with megatron's ``MoEAuxLossAutoScaler``, which back-propagates it with the main
loss's scale (``calculate_per_token_loss``: the grad scaler's, 1 without fp16). With sequence
parallelism (MoE with TP > 1) and context parallelism a sequence's tokens are spread over the
TP x CP ranks: the expert counts and token counts (no gradient) are summed over that group and
each rank keeps the probability sums of its own tokens, so the ranks' losses add up to the
sequence's loss and their gradients to its gradient. Every rank's share of the value is
accumulated here; the actor sums them over the world. With activation recomputation the actor
neither trains nor measures it (``actor._moe_aux_loss_coeff`` refuses a coefficient > 0).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

# This rank's share of the load-balancing loss (coefficient not applied) since the last
# take_total(); on the loss's device, so a GPU run does not synchronise per layer.
_TOTAL = torch.zeros((), dtype=torch.float64)


@dataclass
class _Context:
    # [b, L] int64: this rank's positions (CP share): the sequence whose real token each holds,
    # -1 for padding (a packed row holds several sequences)
    seq_ids: torch.Tensor
    weights: torch.Tensor  # [n] float64: sequence_weights of the sequences
    coeff: float
    num_layers: int  # MoE layers of the whole model (the mean's divisor)


def _routers(chunk: Any) -> list[Any]:
    """The chunk's routers, found once (a module walk per micro-batch adds up on large models)."""
    found = getattr(chunk, "_aux_routers", None)
    if found is None:
        from megatron.core.transformer.moe.router import TopKRouter

        found = [m for m in chunk.modules() if isinstance(m, TopKRouter)]
        chunk._aux_routers = found
    return found


def prepare(chunk: Any, seq_ids: torch.Tensor, weights: torch.Tensor, coeff: float) -> None:
    """Make the chunk's routers compute the loss in the next training forward of the micro-batch
    whose positions' sequences (``[b, L]``, this rank's CP share, -1 for padding) and sequence
    weights are given."""
    routers = _routers(chunk)
    if not routers:
        return
    ctx = _Context(seq_ids, weights.to(seq_ids.device), float(coeff), int(routers[0].config.num_layers))
    for router in routers:
        # One context per prepared forward, taken in order by the router's forwards.
        queue = getattr(router, "_aux_queue", None)
        if queue is None:
            queue = router._aux_queue = deque()
        queue.append(ctx)
        if not getattr(router, "_aux_hooked", False):
            router.register_forward_hook(_hook)
            router._aux_hooked = True


def clear(chunk: Any) -> None:
    for router in _routers(chunk):
        router._aux_queue = deque()


def reset_total() -> None:
    _TOTAL.zero_()


def take_total() -> torch.Tensor:
    """This rank's share of the loss since :func:`reset_total` (float64 scalar, on the CPU)."""
    out = _TOTAL.detach().cpu().clone()
    _TOTAL.zero_()
    return out


def _split_group(config: Any):
    """The ranks among which one sequence's router tokens are spread (None: all here)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
    cp = ps.get_context_parallel_world_size()
    if tp * cp == 1:
        return None
    if cp == 1:
        return ps.get_tensor_model_parallel_group()
    if tp == 1:
        return ps.get_context_parallel_group()
    return ps.get_tensor_and_context_parallel_group()


def _router_rows(seq_ids: torch.Tensor, s_local: int, config: Any) -> torch.Tensor:
    """The positions' sequences in the router's token order ([s, b] flattened) for this TP
    rank's sequence-parallel shard."""
    from megatron.core import parallel_state as ps

    if config.sequence_parallel:
        start = ps.get_tensor_model_parallel_rank() * s_local
        seq_ids = seq_ids[:, start : start + s_local]
    return seq_ids.transpose(0, 1).reshape(-1)


def _hook(router: Any, args: tuple, out: tuple):
    global _TOTAL
    queue = getattr(router, "_aux_queue", None)
    # Scoring forwards (no autograd) prepare nothing and take nothing.
    if not queue or not router.training or not torch.is_grad_enabled():
        return None
    ctx = queue.popleft()
    probs, routing_map = out
    hidden = args[0]
    s_local = hidden.shape[0]
    experts = router.config.num_moe_experts
    attach = ctx.coeff > 0
    n = ctx.weights.numel()
    with torch.set_grad_enabled(attach):
        logits = router.gating(hidden).reshape(-1, experts)
        scores = torch.softmax(logits.float(), dim=-1)
        ids = _router_rows(ctx.seq_ids, s_local, router.config).to(scores.device)
        keep = ids >= 0
        ids = ids[keep]
        # [n, E], this rank's tokens of each sequence
        prob_sums = scores.new_zeros(n, experts).index_add(0, ids, scores[keep])
    with torch.no_grad():
        counts = scores.new_zeros(n, experts).index_add(0, ids, routing_map[keep].to(scores.dtype))
        tokens = scores.new_zeros(n).index_add(0, ids, scores.new_ones(ids.numel()))
        whole = torch.cat([counts, tokens[:, None]], dim=1)
        group = _split_group(router.config)
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(whole, group=group)
        counts, tokens = whole[:, :experts], whole[:, experts].clamp(min=1)
        # counts / T is f_e (summed over the k slots); prob_sums / T is this rank's part of P_e
        scale = experts * counts / tokens[:, None] ** 2
    with torch.set_grad_enabled(attach):
        per_seq = (scale * prob_sums).sum(-1)
        loss = (ctx.weights.to(per_seq.dtype) * per_seq).sum() / ctx.num_layers
    if _TOTAL.device != loss.device:
        _TOTAL = _TOTAL.to(loss.device)
    _TOTAL += loss.detach().double()
    if not attach:
        return None
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    return MoEAuxLossAutoScaler.apply(probs, ctx.coeff * loss), routing_map
