"""CPU stand-in for Transformer Engine's context-parallel attention (CPU path only).

megatron-core 0.16's local ``DotProductAttention`` asserts ``context_parallel_size == 1``; only
TE's attention (ring attention over the CP group) takes a CP group, and TE needs a GPU. So that the
actor's CP path (load-balanced chunks, CP-aware RoPE, loss and log-prob reductions over CP) can be
tested on CPU, :class:`CpuContextParallelAttention` computes the same attention exactly, not fast:
it all-gathers K and V over the CP group (gloo), puts the ``2 * cp`` chunks back in sequence order
and applies the causal mask built from the global positions of this rank's two query chunks.
Its backward sums the full-sequence K/V gradients over CP and keeps this rank's share, which is
the exact gradient of the gather. Memory is ``[b, heads, s/cp, s]``: a test tool, never the GPU
path (``compat.cpu_context_parallel_spec`` installs it only when there is no CUDA).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_dapo.actor.context_parallel import cp_split, cp_unsplit


class _GatherSequence(torch.autograd.Function):
    """``[s_local, ...]`` shares of every CP rank -> the whole sequence ``[s, ...]`` in order."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        shares = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shares, local.contiguous(), group=group)
        return cp_unsplit(shares, dim=0)

    @staticmethod
    def backward(ctx, grad):
        # Every rank's queries read the whole K/V, so a share's gradient is the CP sum.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        cp = dist.get_world_size(ctx.group)
        return cp_split(grad, cp, dist.get_rank(ctx.group), dim=0), None


class CpuContextParallelAttention(DotProductAttention):
    """Drop-in for ``DotProductAttention`` (same constructor and ``[sq, b, np, hn]`` inputs) with
    context parallelism: causal self-attention of this rank's load-balanced chunks over the whole
    sequence."""

    def __init__(self, config, *args, **kwargs):
        # The parent's constructor refuses CP; build it from a copy that says cp=1 and keep the
        # real config for everything else.
        plain = copy.copy(config)
        plain.context_parallel_size = 1
        super().__init__(plain, *args, **kwargs)
        self.config = config

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(
                "the CPU context-parallel attention supports neither packed sequences nor attention bias"
            )
        group = parallel_state.get_context_parallel_group()
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        key = _GatherSequence.apply(key, group)
        value = _GatherSequence.apply(value, group)
        reps = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if reps > 1:
            key = key.repeat_interleave(reps, dim=2)
            value = value.repeat_interleave(reps, dim=2)
        s_full = key.shape[0]
        q_pos = cp_split(torch.arange(s_full, device=query.device), cp, rank, dim=0)
        k_pos = torch.arange(s_full, device=query.device)
        future = k_pos.unsqueeze(0) > q_pos.unsqueeze(1)  # [sq, sk]
        # [b, np, sq, hn] x [b, np, hn, sk]
        q = query.permute(1, 2, 0, 3)
        scale = self.softmax_scale
        if self.config.apply_query_key_layer_scaling:
            scale *= self.layer_number  # the parent's softmax multiplies its coefficient back
        if self.softmax_offset is not None:
            raise ValueError("the CPU context-parallel attention supports only softmax_type='vanilla'")
        scores = torch.matmul(q, key.permute(1, 2, 3, 0)) * scale
        scores = scores.float().masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        if not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.attention_dropout(probs)
        else:
            probs = self.attention_dropout(probs)
        context = torch.matmul(probs, value.permute(1, 2, 0, 3))  # [b, np, sq, hn]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), self.hidden_size_per_partition)
