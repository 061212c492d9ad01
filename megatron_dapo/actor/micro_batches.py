"""Split an optimizer mini-batch over data-parallel ranks and into micro-batches by a token budget.

Dynamic batch size: a micro-batch holds as many sequences as fit in ``max_tokens``, so a few long
responses get micro-batches of their own instead of blowing the memory of a fixed-size
micro-batch. Every function here is deterministic (ties broken by sample index), so all ranks
that see the same batch compute the same plan without talking to each other.

Two layouts:

- Packed (:func:`pack_by_real_tokens`, :func:`collate_packed`): one row holding the samples back
  to back, their boundaries in ``cu_seqlens``; the model runs it as THD (``PackedSeqParams``),
  every sample attending causally to itself only, so a sample's outputs are those of its own
  forward. The budget counts real tokens. Each sample is padded only to the multiple context
  parallelism cuts it by (``2 * CP``), and the row's end to the multiple sequence parallelism /
  FP8 need. The loss reads the row through :func:`row_view`, which puts each sample's positions
  in a row of its own: the padded layout the loss functions take.
- Padded (:func:`pack_by_token_budget`, :func:`collate`): a micro-batch holds as many sequences
  as fit in ``sequences * longest`` positions, right-padded. Under causal attention a real token
  never attends to a later position, so right padding changes no real token's output and no
  attention mask is needed; the padding positions are excluded from the loss by the loss mask.

Padding changes no real token's output in either layout: it only follows real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from megatron_dapo.actor.batch import RESPONSE_FLOAT_FIELDS, ActorBatch, BatchError
from megatron_dapo.actor.routing_replay import pad_value


def _longest_first(lengths: list[int], indices: list[int]) -> list[int]:
    return sorted(indices, key=lambda i: (-lengths[i], i))


def split_over_ranks(lengths: list[int], indices: list[int], num_ranks: int) -> list[list[int]]:
    """Assign samples to ``num_ranks`` data-parallel ranks, balancing their token counts.

    Longest-processing-time greedy: longest sample first, each to the rank with the fewest tokens
    so far (lowest rank on ties). Each rank's list keeps ascending sample order.
    """
    if len(indices) < num_ranks:
        raise BatchError(
            f"a mini-batch of {len(indices)} samples cannot feed {num_ranks} data-parallel ranks; "
            "use fewer DP ranks or a larger ppo_mini_batch_size"
        )
    loads = [0] * num_ranks
    parts: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in _longest_first(lengths, indices):
        r = min(range(num_ranks), key=lambda k: (loads[k], k))
        parts[r].append(i)
        loads[r] += lengths[i]
    for r in range(num_ranks):
        if not parts[r]:
            raise BatchError(f"data-parallel rank {r} got no sample")  # cannot happen: len >= ranks
        parts[r].sort()
    return parts


def pack_by_token_budget(
    lengths: list[int], indices: list[int], max_tokens: int, multiple_of: int = 1
) -> list[list[int]]:
    """Group samples into micro-batches whose padded size ``count * longest`` is <= ``max_tokens``.

    First-fit over samples sorted longest first: a micro-batch is closed when the next sample
    would push ``(count + 1) * longest`` over the budget. With ``multiple_of`` > 1 (megatron's
    interleaved pipeline needs a multiple of PP micro-batches) the largest micro-batches are
    halved until the count is a multiple. Raises :class:`BatchError` when one sample alone
    exceeds the budget.
    """
    if max_tokens < 1:
        raise BatchError(f"micro_batch_max_tokens must be >= 1, got {max_tokens}")
    order = _longest_first(lengths, indices)
    if order and lengths[order[0]] > max_tokens:
        i = order[0]
        raise BatchError(
            f"sample {i} has {lengths[i]} tokens, more than micro_batch_max_tokens={max_tokens}; set "
            "micro_batch_max_tokens >= max_prompt_length + max_response_length"
        )
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return _to_multiple(groups, multiple_of, len(indices))


def _to_multiple(groups: list[list[int]], multiple_of: int, samples: int) -> list[list[int]]:
    """Halve the largest groups until their count is a multiple of ``multiple_of`` (megatron's
    interleaved pipeline schedule needs one)."""
    while len(groups) % multiple_of:
        _halve_biggest(
            groups,
            f"{samples} samples cannot form a multiple of {multiple_of} micro-batches "
            "(the interleaved pipeline schedule needs one); give each DP rank more samples",
        )
    return groups


def _halve_biggest(groups: list[list[int]], error: str) -> None:
    """Split the largest group (the first of equals) in place into two halves next to each other;
    raise BatchError(error) when no group has two samples left to split."""
    biggest = max(range(len(groups)), key=lambda g: (len(groups[g]), -g))
    if len(groups[biggest]) < 2:
        raise BatchError(error)
    g = groups.pop(biggest)
    half = (len(g) + 1) // 2
    groups[biggest:biggest] = [g[:half], g[half:]]


def pack_by_real_tokens(
    lengths: list[int], indices: list[int], max_tokens: int, multiple_of: int = 1
) -> list[list[int]]:
    """Group samples into packed micro-batches of at most ``max_tokens`` real tokens.

    First-fit decreasing: samples longest first, each into the first micro-batch it fits in
    (fewer micro-batches than closing one at the first misfit). Each group lists its samples in
    ascending order. With ``multiple_of`` > 1 the largest groups are halved until the count is a
    multiple (megatron's interleaved pipeline schedule needs one). Raises :class:`BatchError`
    when one sample alone exceeds the budget."""
    if max_tokens < 1:
        raise BatchError(f"micro_batch_max_tokens must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in _longest_first(lengths, indices):
        if lengths[i] > max_tokens:
            raise BatchError(
                f"sample {i} has {lengths[i]} tokens, more than micro_batch_max_tokens={max_tokens}; set "
                "micro_batch_max_tokens >= max_prompt_length + max_response_length"
            )
        fit = next((g for g, load in enumerate(loads) if load + lengths[i] <= max_tokens), None)
        if fit is None:
            groups.append([i])
            loads.append(lengths[i])
        else:
            groups[fit].append(i)
            loads[fit] += lengths[i]
    groups = [sorted(g) for g in groups]
    return _to_multiple(groups, multiple_of, len(indices))


def packed_length(lengths: list[int], seq_multiple: int = 1, row_multiple: int = 1) -> int:
    """Positions of a packed row of samples of ``lengths``: each padded to ``seq_multiple``,
    the row to ``row_multiple``."""
    total = sum(-(-n // seq_multiple) * seq_multiple for n in lengths)
    return -(-total // row_multiple) * row_multiple


def split_to_count(groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` with the largest halved until there are ``count`` of them (expert parallelism:
    every rank of an EP group must run the same number of micro-batches, since each forward
    exchanges tokens all-to-all). Raises :class:`BatchError` when there are fewer samples."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        _halve_biggest(
            groups,
            f"{sum(map(len, groups))} samples cannot form {count} micro-batches (another expert-parallel "
            "rank has that many); give each data-parallel rank more samples",
        )
    return groups


def pack_fixed_shape(
    lengths: list[int], indices: list[int], max_tokens: int, multiple_of: int = 1, pad_multiple: int = 1
) -> tuple[list[list[int]], int, int]:
    """Micro-batches of one shape ``rows x length`` within ``max_tokens`` (megatron's interleaved
    pipeline schedule needs equal shapes). ``length`` is the longest sequence (padded to
    ``pad_multiple``) and ``rows = max_tokens // length``: packing by the budget first and padding
    afterwards would give every micro-batch the row count of the shortest samples' micro-batch
    and the length of the longest sample (one 22k-token response made every micro-batch 16 x 22k).
    Returns ``(groups, rows, length)``; the count of groups is a multiple of ``multiple_of``."""
    groups = pack_by_token_budget(lengths, indices, max_tokens, 1)  # validates the budget
    order = [i for g in groups for i in g]
    if not order:
        return [], 0, 0
    length = -(-max(lengths[i] for i in order) // pad_multiple) * pad_multiple
    rows = max(1, max_tokens // length)
    groups = [order[k : k + rows] for k in range(0, len(order), rows)]
    while len(groups) % multiple_of:
        biggest = max(range(len(groups)), key=lambda g: (len(groups[g]), -g))
        if len(groups[biggest]) < 2:
            raise BatchError(
                f"{len(indices)} samples cannot form a multiple of {multiple_of} micro-batches "
                "(the interleaved pipeline schedule needs one); give each DP rank more samples"
            )
        g = groups.pop(biggest)
        half = (len(g) + 1) // 2
        groups[biggest:biggest] = [g[:half], g[half:]]
    return groups, rows, length


@dataclass
class MicroBatch:
    """One micro-batch in token-position layout: padded (``b`` rows, one sample each) or packed
    (one row, ``cu_seqlens`` set, the per-sample fields one entry per sample).

    ``labels[:, t]`` is the token predicted at position ``t`` (``tokens[:, t + 1]``, within the
    same sample) and ``loss_mask[:, t]`` marks the positions whose prediction is a response
    token in the loss; ``old_logprobs`` / ``rollout_logprobs`` / ``ref_logprobs`` are aligned to
    those positions.
    """

    # the [b, L, ...] fields: cut along the sequence by context parallelism
    POSITION_FIELDS: ClassVar[tuple[str, ...]] = (
        "tokens",
        "position_ids",
        "labels",
        "loss_mask",
        "score_mask",
        "old_logprobs",
        "rollout_logprobs",
        "ref_logprobs",
        "routed_experts",
        "seq_ids",
    )

    sample_index: torch.Tensor  # [n] samples of the rollout-step batch (-1: a dummy row)
    tokens: torch.Tensor  # [b, L] int64
    position_ids: torch.Tensor  # [b, L] int64, within each sample
    labels: torch.Tensor  # [b, L] int64
    loss_mask: torch.Tensor  # [b, L] bool
    score_mask: torch.Tensor  # [b, L] bool: every response position (for log-prob output)
    advantages: torch.Tensor  # [n]
    old_logprobs: torch.Tensor | None  # [b, L]
    rollout_logprobs: torch.Tensor | None  # [b, L]
    # [b, L, layers, k] experts the rollout engine chose (actor/routing_replay.py), or None
    routed_experts: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None  # [b, L], with a reference model
    # [n] real tokens of each sample (0 for a dummy row)
    seq_lens: torch.Tensor | None = None
    # [b, L] int64: the sample (0..n-1) whose real token a position holds, -1 for padding
    seq_ids: torch.Tensor | None = None
    # packed: [n + 1] int64 sample boundaries in the row (padding included), else None
    cu_seqlens: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Positions the model computes (real tokens and padding)."""
        return int(self.tokens.numel())

    @property
    def num_real_tokens(self) -> int:
        return int(self.seq_lens.sum())


def _to_positions(values: torch.Tensor, prompt_len: int, resp_len: int, length: int) -> torch.Tensor:
    out = torch.zeros(length, dtype=values.dtype)
    out[prompt_len - 1 : prompt_len - 1 + resp_len] = values[:resp_len]
    return out


def _response_floats(batch: ActorBatch, rows: int, length: int) -> dict[str, torch.Tensor]:
    """A zeroed ``[rows, length]`` position-layout tensor for each response log-prob field the
    batch carries (``RESPONSE_FLOAT_FIELDS``)."""
    return {
        name: torch.zeros(rows, length, dtype=getattr(batch, name).dtype)
        for name in RESPONSE_FLOAT_FIELDS
        if getattr(batch, name) is not None
    }


def _all_response_floats(floats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    return {name: floats.get(name) for name in RESPONSE_FLOAT_FIELDS}


def collate(
    batch: ActorBatch,
    indices: list[int],
    pad_id: int = 0,
    pad_to_multiple_of: int = 1,
    *,
    rows: int | None = None,
    length: int | None = None,
) -> MicroBatch:
    """Right-pad the samples ``indices`` of ``batch`` into a :class:`MicroBatch`.

    ``rows`` / ``length`` pad further to a fixed shape (dummy rows have ``sample_index`` -1 and an
    empty loss mask): megatron's interleaved pipeline schedule needs every micro-batch of a call
    to have the same shape.
    """
    lens = [int(batch.seq_lens[i]) for i in indices]
    longest = max(max(lens), length or 0)
    length = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    b = max(len(indices), rows or 0)
    tokens = torch.full((b, length), pad_id, dtype=torch.long)
    labels = torch.full((b, length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(b, length, dtype=torch.bool)
    score_mask = torch.zeros(b, length, dtype=torch.bool)
    floats = _response_floats(batch, b, length)
    routed = None if batch.routed_experts is None else _routed_rows(batch.routed_experts, indices, b, length)
    for row, i in enumerate(indices):
        ids = batch.input_ids[i]
        n, p, r = ids.numel(), int(batch.prompt_lens[i]), int(batch.response_lens[i])
        tokens[row, :n] = ids
        labels[row, : n - 1] = ids[1:]
        loss_mask[row] = _to_positions(batch.response_mask[i], p, r, length)
        score_mask[row, p - 1 : p - 1 + r] = True
        for name, out in floats.items():
            out[row] = _to_positions(getattr(batch, name)[i], p, r, length)
    index = torch.full((b,), -1, dtype=torch.long)
    index[: len(indices)] = torch.tensor(indices, dtype=torch.long)
    advantages = torch.zeros(b, dtype=batch.advantages.dtype)
    advantages[: len(indices)] = batch.advantages[index[: len(indices)]]
    positions = torch.arange(length).unsqueeze(0).expand(b, length).contiguous()
    seq_lens = torch.tensor(lens + [0] * (b - len(lens)), dtype=torch.long)
    real = positions < seq_lens[:, None]
    seq_ids = torch.where(real, torch.arange(b)[:, None], torch.full_like(positions, -1))
    return MicroBatch(
        sample_index=index,
        tokens=tokens,
        position_ids=positions,
        labels=labels,
        loss_mask=loss_mask,
        score_mask=score_mask,
        advantages=advantages,
        **_all_response_floats(floats),
        routed_experts=routed,
        seq_lens=seq_lens,
        seq_ids=seq_ids,
    )


def collate_packed(
    batch: ActorBatch,
    indices: list[int],
    pad_id: int = 0,
    seq_multiple: int = 1,
    row_multiple: int = 1,
    *,
    length: int | None = None,
) -> MicroBatch:
    """Pack the samples ``indices`` of ``batch`` back to back into one row (a packed
    :class:`MicroBatch`). Each sample is padded to ``seq_multiple`` positions (context
    parallelism cuts every sample into ``2 * CP`` chunks), the row to ``row_multiple`` (sequence
    parallelism, FP8) or to ``length`` (the interleaved pipeline's one shape); the row's padding
    belongs to the last sample, after its real tokens."""
    lens = [int(batch.seq_lens[i]) for i in indices]
    spans = [-(-n // seq_multiple) * seq_multiple for n in lens]
    total = packed_length(lens, seq_multiple, row_multiple)
    if length is not None:
        if length < total or length % row_multiple:
            raise ValueError(f"a packed row of {total} positions cannot be padded to {length}")
        total = length
    spans[-1] += total - sum(spans)
    cu = torch.tensor([0, *spans], dtype=torch.long).cumsum(0)
    tokens = torch.full((1, total), pad_id, dtype=torch.long)
    labels = torch.full((1, total), pad_id, dtype=torch.long)
    positions = torch.zeros(1, total, dtype=torch.long)
    seq_ids = torch.full((1, total), -1, dtype=torch.long)
    loss_mask = torch.zeros(1, total, dtype=torch.bool)
    score_mask = torch.zeros(1, total, dtype=torch.bool)
    floats = _response_floats(batch, 1, total)
    routed = None
    if batch.routed_experts is not None:
        layers, k = batch.routed_experts[indices[0]].shape[1:]
        routed = pad_value(k).expand(1, total, layers, k).clone()
    for row, (i, start, span) in enumerate(zip(indices, cu[:-1].tolist(), spans)):
        ids = batch.input_ids[i]
        n, p, r = ids.numel(), int(batch.prompt_lens[i]), int(batch.response_lens[i])
        tokens[0, start : start + n] = ids
        labels[0, start : start + n - 1] = ids[1:]
        positions[0, start : start + span] = torch.arange(span)
        seq_ids[0, start : start + n] = row
        loss_mask[0, start : start + span] = _to_positions(batch.response_mask[i], p, r, span)
        score_mask[0, start + p - 1 : start + p - 1 + r] = True
        for name, out in floats.items():
            out[0, start : start + span] = _to_positions(getattr(batch, name)[i], p, r, span)
        if routed is not None:
            experts = batch.routed_experts[i]
            routed[0, start : start + experts.shape[0]] = experts
    index = torch.tensor(indices, dtype=torch.long)
    return MicroBatch(
        sample_index=index,
        tokens=tokens,
        position_ids=positions,
        labels=labels,
        loss_mask=loss_mask,
        score_mask=score_mask,
        advantages=batch.advantages[index].clone(),
        **_all_response_floats(floats),
        routed_experts=routed,
        seq_lens=torch.tensor(lens, dtype=torch.long),
        seq_ids=seq_ids,
        cu_seqlens=cu,
    )


@dataclass
class RowView:
    """Where each sample of a packed row (or of this context-parallel rank's share of it) lies:
    ``index[i, j]`` is the row position of the sample's ``j``-th position here, ``valid`` marks
    the ``j`` that exist. ``rows(values)`` turns ``[1, T, ...]`` per-position values into the
    padded ``[n, L, ...]`` layout the loss functions take (differentiable; invalid entries 0)."""

    index: torch.Tensor  # [n, L] int64
    valid: torch.Tensor  # [n, L] bool

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        picked = values[0][self.index]
        valid = self.valid.view(*self.valid.shape, *([1] * (picked.dim() - 2)))
        return torch.where(valid, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def row_view(micro: MicroBatch, cp: int = 1) -> RowView:
    """The :class:`RowView` of a packed micro-batch after its context-parallel cut over ``cp``
    ranks (a rank holds ``1/cp`` of every sample, back to back, in the order of ``cu_seqlens``)."""
    spans = (micro.cu_seqlens.diff() // cp).tolist()
    starts = torch.tensor([0, *spans[:-1]], dtype=torch.long).cumsum(0)
    width = max(spans)
    j = torch.arange(width)
    valid = j[None, :] < torch.tensor(spans)[:, None]
    index = torch.where(valid, starts[:, None] + j[None, :], torch.zeros((), dtype=torch.long))
    dev = micro.tokens.device
    return RowView(index.to(dev), valid.to(dev))


def as_rows(micro: MicroBatch, view: RowView) -> MicroBatch:
    """A packed micro-batch in the padded layout (one sample per row) for the loss: every
    per-position field through ``view`` (the experts are not needed there and dropped)."""
    fields = dict(micro.__dict__)
    for key in MicroBatch.POSITION_FIELDS:
        if key == "routed_experts":
            fields[key] = None
        elif fields[key] is not None:
            fields[key] = view.rows(fields[key])
    fields["seq_ids"] = torch.where(view.valid, micro.seq_ids[0][view.index], -1)
    fields["cu_seqlens"] = None
    return MicroBatch(**fields)


def _routed_rows(experts: list[torch.Tensor], indices: list[int], b: int, length: int) -> torch.Tensor:
    """The recorded experts of ``indices`` at their token positions; padding positions and a
    sequence's last token get fixed experts (they reach no scored log-prob)."""
    layers, k = experts[indices[0]].shape[1:]
    out = pad_value(k).expand(b, length, layers, k).clone()
    for row, i in enumerate(indices):
        out[row, : experts[i].shape[0]] = experts[i]
    return out


def positions_to_response(
    values: torch.Tensor, micro: MicroBatch, batch: ActorBatch, out: torch.Tensor
) -> None:
    """Write position-layout ``values`` ([b, L]) of ``micro`` into ``out`` ([B, R], response layout)."""
    starts = [0] * len(micro.sample_index) if micro.cu_seqlens is None else micro.cu_seqlens.tolist()
    for row, i in enumerate(micro.sample_index.tolist()):
        if i < 0:  # padding row
            continue
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        at, start = (row, 0) if micro.cu_seqlens is None else (0, starts[row])
        out[i, :r] = values[at, start + p - 1 : start + p - 1 + r].to(out.dtype)


def padding_positions(micros: list[MicroBatch]) -> tuple[int, int]:
    """``(padding positions, computed positions)`` of ``micros``."""
    total = sum(m.num_tokens for m in micros)
    return total - sum(m.num_real_tokens for m in micros), total
