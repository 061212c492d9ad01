"""CPU stand-in for SGLang's ``sgl_kernel`` (test infrastructure; see tests/sglang_cpu/README.md).

Only the two functions a text model's server calls on a CPU without AMX exist here; the
semantics follow the Triton kernels they replace in SGLang 0.5.23. Anything else is absent on
purpose, so a server path that needs a real kernel fails at import instead of running wrong.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+cpu-stand-in"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row: ``req_to_token[r, start:end] = slots``.

    ``out_cache_loc`` holds the slots of all requests back to back, in batch order.
    """
    del pool_len  # the row width; slicing already bounds the write
    pos = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = e - s
        req_to_token[r, s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """In every KV buffer (raw base pointer + bytes per token row), copy rows ``src_loc`` to ``tgt_loc``."""
    if tgt_loc.numel() == 0:
        return
    rows = int(max(tgt_loc.max().item(), src_loc.max().item())) + 1
    tgt, src = tgt_loc.long(), src_loc.long()
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buf[tgt] = buf[src].clone()


def _not_on_this_path(name: str):
    """A kernel that SGLang imports at start-up on a CPU but calls only on paths the tests do not
    take (speculative decoding); calling it raises instead of computing something wrong."""

    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not provided by the CPU stand-in (tests/sglang_cpu)")

    kernel.__name__ = name
    return kernel


# Imported at module level by SGLang 0.5.23 when it runs on a CPU; never called by a plain
# text model (speculative-decoding and other optional paths).
_IMPORTED_NOT_CALLED = (
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
)
for _name in _IMPORTED_NOT_CALLED:
    globals()[_name] = _not_on_this_path(_name)
del _name
