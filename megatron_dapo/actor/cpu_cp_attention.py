"""CPU stand-in for Transformer Engine's context-parallel attention (CPU path only).

megatron-core 0.16's local attention has no context parallelism; only TE's attention (ring
attention over the CP group) takes a CP group, and TE needs a GPU. So that the actor's CP path
(load-balanced chunks, CP-aware RoPE, loss and log-prob reductions over CP) can be tested on CPU,
:class:`CpuContextParallelAttention` computes the same attention exactly, not fast: it
all-gathers K and V over the CP group (gloo), puts the chunks back in sequence order and masks
by the global positions of this rank's query chunks. Packed micro-batches (THD
``PackedSeqParams``) are cut sample by sample (``context_parallel.cp_positions``) and a query
sees only the earlier positions of its own sample. Its backward sums the full-sequence K/V
gradients over CP and keeps this rank's share, which is the exact gradient of the gather.
Memory is ``[b, heads, s/cp, s]``: a test tool, never the GPU path (``model.layer_spec``
installs it only when there is no CUDA).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dapo.actor.context_parallel import cp_positions
from megatron_dapo.actor.sdpa_attention import SDPAttention


class _GatherSequence(torch.autograd.Function):
    """``[s_local, ...]`` shares of every CP rank -> the whole sequence ``[s, ...]`` in order;
    ``positions[r]`` are the positions rank ``r`` holds."""

    @staticmethod
    def forward(ctx, local, group, positions):
        ctx.group, ctx.mine = group, positions[dist.get_rank(group)]
        shares = [torch.empty_like(local) for _ in positions]
        dist.all_gather(shares, local.contiguous(), group=group)
        out = local.new_empty(local.shape[0] * len(positions), *local.shape[1:])
        for share, where in zip(shares, positions):
            out.index_copy_(0, where, share)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Every rank's queries read the whole K/V, so a share's gradient is the CP sum.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.index_select(0, ctx.mine), None, None


class CpuContextParallelAttention(SDPAttention):
    """Drop-in for the local spec's core attention (same constructor and inputs) with context
    parallelism: causal self-attention of this rank's load-balanced chunks over the whole
    sequence, or over each packed sample."""

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
        if attention_bias is not None or attention_mask is not None:
            raise ValueError("the CPU context-parallel attention takes neither an attention mask nor a bias")
        group = parallel_state.get_context_parallel_group()
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed:
            # [t, heads, hn] -> [t, 1, heads, hn]: one row, as the unpacked layout
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        s_full = query.shape[0] * cp
        cu = packed_seq_params.cu_seqlens_q.tolist() if packed else None
        positions = [cp_positions(cp, r, s_full, cu).to(query.device) for r in range(cp)]
        key = _GatherSequence.apply(key, group, positions)
        value = _GatherSequence.apply(value, group, positions)
        # sample of every position (0 for all when not packed)
        sample = torch.zeros(s_full, dtype=torch.long, device=query.device)
        if packed:
            lengths = torch.tensor(cu, device=query.device).diff()
            sample = torch.repeat_interleave(torch.arange(len(lengths), device=query.device), lengths)
        q_pos, k_pos = positions[rank], torch.arange(s_full, device=query.device)
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (sample[None, :] == sample[q_pos][:, None])
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        context = self._sdpa(q, k, v, mask=allowed)
        context = context.permute(2, 0, 1, 3).contiguous()  # [sq, b, heads, hn]
        if packed:
            return context.view(context.size(0), self.hidden_size_per_partition)
        return context.view(context.size(0), context.size(1), self.hidden_size_per_partition)
