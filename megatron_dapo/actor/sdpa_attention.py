"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` for the local (non-TE)
layer spec: memory linear in sequence length on CUDA (flash / memory-efficient kernels), torch's
math or CPU flash kernel on CPU.

Drop-in for megatron-core's ``DotProductAttention`` (same constructor, ``[sq, b, np, hn]`` query
and ``[sk, b, ng, hn]`` key/value in, ``[sq, b, np * hn]`` out). That module materialises fp32
``[b, heads, s, s]`` scores for every layer (out of memory at 16k-token micro-batches of a 1.5B
model on a 140 GiB GPU); this one never does on CUDA. Grouped-query attention is SDPA's
``enable_gqa`` (no repeated K/V), tensor parallelism is the per-partition head counts, as in
megatron's module.

Packed sequences (``PackedSeqParams`` with ``qkv_format="thd"``): query ``[t, np, hn]``, key and
value ``[t, ng, hn]``, samples back to back with boundaries ``cu_seqlens_q``; every sample
attends causally to itself only. How, by device:

- CUDA with fp16/bf16 and torch's ``varlen_attn`` (flash attention over ``cu_seqlens``): one
  kernel for the whole pack.
- Otherwise, per-sample causal SDPA calls, or one call over the samples right-padded to the
  longest inside the attention when padding costs less than the calls' fixed cost
  (:func:`_one_padded_call`); the rest of the model never sees that padding.
  ``tools/bench_packed_attention.py`` measured the CPU choices (forward+backward, fp32, one
  thread, best of 15, quiet machine), against one call over the samples padded to the longest:
  8 samples of 12-256 tokens, 8 heads x 64: per-sample calls 0.36x and 0.48x, one call with a
  block-diagonal causal (document) mask 1.28x and 1.64x (it computes all of ``t x t`` and holds
  a ``t x t`` mask), torch's math kernel forced 1.33-1.85x; 64 samples of 14-56 tokens (the
  demo's), 2 heads x 16: per-sample 0.78x and 0.82x, document mask 3.05x and 3.26x. Per-sample
  calls win on attention alone there, but their 64 autograd nodes per layer cost more than
  that in the whole update: the demo-shaped actor update (512 samples, one rank) took 1.06x
  the time of today's padded update with per-sample calls and 0.82-0.85x with the padded call.
  The document mask is not used.

Not covered (megatron's ``DotProductAttention`` stays for them, see ``model.layer_spec``):
softmax offsets (``softmax_type`` other than ``vanilla``) and sliding-window layers.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide


def sdpa_supports(config, layer_number: int = 1) -> str | None:
    """Why :class:`SDPAttention` cannot stand in for megatron's attention under ``config``, or
    None when it can."""
    if config.softmax_type != "vanilla":
        return f"softmax_type={config.softmax_type!r} (SDPA has no softmax offset)"
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return f"window_size={config.window_size} (sliding-window attention)"
    return None


@functools.lru_cache(maxsize=1)
def _varlen_attn():
    """torch's flash-attention varlen entry point and how it asks for a causal mask, or None
    (torch < 2.10 has none; 2.10 asks ``is_causal``, later ``window_size``; 2.10 also has no
    ``scale`` and no ``enable_gqa``)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params, "scale" in params


# A call's fixed cost on CPU, as the work of attention over this many tokens (see _one_padded_call).
_CALL_COST_TOKENS = 64


def _one_padded_call(lengths: list[int]) -> bool:
    """Whether one call over the samples padded to the longest costs less than a call per
    sample: ``n * longest^2`` against ``sum(L^2)`` plus each call's fixed cost. Many short samples
    (the CPU demo: 64 of 14-56 tokens per micro-batch) go in one call; ragged long ones (where
    padding would multiply the work) one call each."""
    if len(lengths) < 2:
        return False
    per_sample = sum(n * n + _CALL_COST_TOKENS**2 for n in lengths)
    return len(lengths) * max(lengths) ** 2 + _CALL_COST_TOKENS**2 <= per_sample


def _is_default_scale(scale: float, head_dim: int) -> bool:
    """Whether ``scale`` is 1/sqrt(head_dim), the only scale torch 2.10's varlen kernel takes. A
    scale that went through float32 (a config, a checkpoint, ``1/math.sqrt`` in float32) is off by
    up to half a float32 ulp, 6e-8 relative; 1e-6 accepts that and refuses any scale that is
    meant to differ (layer scaling, a model's own query scalar), which are percents apart."""
    return math.isclose(scale, head_dim**-0.5, rel_tol=1e-6, abs_tol=0.0)


class SDPAttention(MegatronModule):
    """Causal self-attention with ``scaled_dot_product_attention`` (see the module docstring)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        self.config = config
        if config.context_parallel_size != 1 and type(self) is SDPAttention:
            raise ValueError(
                "SDPAttention has no context parallelism: CP > 1 needs Transformer Engine's attention "
                "(GPU) or the CPU stand-in (cpu_cp_attention)"
            )
        problem = sdpa_supports(config, layer_number)
        if problem:
            raise ValueError(f"SDPAttention does not support {problem}; use megatron's DotProductAttention")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        world = pg_collection.tp.size()
        projection = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection, world)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world)
        head_dim = divide(projection, config.num_attention_heads)
        # megatron divides its scale by layer_number under apply_query_key_layer_scaling and its
        # softmax multiplies it back: the product is this.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    # ------------------------------------------------------------------ kernels
    def _sdpa(self, q, k, v, *, mask=None, causal=False):
        """SDPA of ``[b, heads, s, hn]`` tensors; dropout under megatron's RNG tracker as
        ``DotProductAttention`` does."""
        p = self.dropout_p if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]

        def run():
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=p,
                is_causal=causal,
                scale=self.softmax_scale,
                enable_gqa=gqa,
            )

        if p > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return run()
        return run()

    def _causal(self) -> bool:
        return self.attn_mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)

    def _packed(self, query, key, value, params):
        """``[t, np, hn]`` x ``[t, ng, hn]`` packed samples -> ``[t, np, hn]``."""
        cu = params.cu_seqlens_q
        kv = params.cu_seqlens_kv
        if kv is not None and kv is not cu and not torch.equal(kv, cu):
            raise ValueError("SDPAttention: packed self-attention needs cu_seqlens_kv == cu_seqlens_q")
        varlen = _varlen_attn() if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else None
        if (
            varlen is not None
            and not varlen[3]
            and not _is_default_scale(self.softmax_scale, query.shape[-1])
        ):
            varlen = None  # its fixed scale is 1/sqrt(head_dim)
        if varlen is not None and (self.dropout_p == 0 or not self.training):
            fn, causal, has_gqa, has_scale = varlen
            if not self._causal():
                causal = {}
            reps = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            extra = dict(causal, scale=self.softmax_scale) if has_scale else dict(causal)
            if reps > 1:
                if has_gqa:
                    extra["enable_gqa"] = True
                else:
                    key, value = key.repeat_interleave(reps, 1), value.repeat_interleave(reps, 1)
            max_len = int(params.max_seqlen_q)
            cu32 = cu.to(torch.int32)
            return fn(query, key, value, cu32, cu32, max_len, max_len, **extra)
        bounds = cu.tolist()
        lengths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
        if _one_padded_call(lengths):
            return self._padded_call(query, key, value, bounds, lengths)
        out = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if hi == lo:
                continue
            q, k, v = (x[lo:hi].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            out.append(self._sdpa(q, k, v, causal=self._causal()).squeeze(0).transpose(0, 1))
        return torch.cat(out, dim=0)

    def _padded_call(self, query, key, value, bounds, lengths):
        """One SDPA call over the samples right-padded to the longest, inside the attention only.
        Causal: a real query sees only real keys before it, so the padding (copies of position
        0) changes no real output, and gets no gradient from one."""
        width = max(lengths)
        j = torch.arange(width, device=query.device)
        starts = torch.tensor(bounds[:-1], device=query.device)
        valid = j[None, :] < torch.tensor(lengths, device=query.device)[:, None]
        index = torch.where(
            valid, starts[:, None] + j[None, :], torch.zeros((), dtype=torch.long, device=j.device)
        )
        q, k, v = (x[index].permute(0, 2, 1, 3) for x in (query, key, value))  # [n, heads, width, hn]
        out = self._sdpa(q, k, v, causal=self._causal()).permute(0, 2, 1, 3)  # [n, width, heads, hn]
        return out[valid]

    # ------------------------------------------------------------------ forward
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
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if attention_mask is not None:
                raise ValueError("SDPAttention: packed sequences take no attention_mask")
            context = self._packed(query, key, value, packed_seq_params)
            return context.reshape(context.shape[0], self.hidden_size_per_partition)
        if packed_seq_params is not None:
            raise ValueError(f"SDPAttention: qkv_format={packed_seq_params.qkv_format!r}; only 'thd' packs")
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if attention_mask is not None:
            # megatron's masks are True where attention is not allowed
            context = self._sdpa(q, k, v, mask=~attention_mask.bool())
        else:
            context = self._sdpa(q, k, v, causal=self._causal())
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), self.hidden_size_per_partition)
