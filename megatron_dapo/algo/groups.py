"""Map arbitrary per-sample group keys to contiguous integer ids."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_ids(group_index: Sequence | torch.Tensor, batch_size: int, device) -> tuple[torch.Tensor, int]:
    """Return ``(ids, num_groups)``: a (B,) int64 tensor of ids in ``[0, num_groups)``.

    Keys may be ints, strings (verl uses uuid strings) or a tensor; equal keys share an id, in
    order of first appearance, so groups need not be contiguous in the batch.
    """
    keys = group_index.tolist() if isinstance(group_index, torch.Tensor) else list(group_index)
    if len(keys) != batch_size:
        raise ValueError(f"group_index has {len(keys)} entries but the batch has {batch_size} samples")
    first_seen: dict = {}
    try:
        ids = [first_seen.setdefault(k, len(first_seen)) for k in keys]
    except TypeError as e:
        raise TypeError(f"group_index entries must be hashable (int or str), got {type(keys[0])}") from e
    return torch.tensor(ids, dtype=torch.long, device=device), len(first_seen)
