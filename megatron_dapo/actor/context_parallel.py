"""The pure pieces of context parallelism (CP): how a sequence is cut across CP ranks and how the
per-token reductions are normalised. The actor's CP path is built on these: ``train_step`` runs
each micro-batch's :func:`cp_split_micro` share and gathers per-token outputs with
:func:`cp_gather`; attention is TE's with megatron's CP group on GPU and
``cpu_cp_attention.CpuContextParallelAttention`` on CPU (see ``compat``).

Megatron-core's CP attention (Transformer Engine's ring attention) expects each sequence cut into
``2 * cp`` equal chunks, rank ``r`` holding chunks ``r`` and ``2 * cp - 1 - r``: with a causal
mask, early chunks attend to little and late chunks to much, so pairing chunk ``r`` with its
mirror gives every rank the same attention work. RoPE positions and the next-token labels are
taken from the full sequence before the cut, so a chunk boundary loses no target.

Reductions: a rank holds a subset of a sequence's tokens, so a token-mean over the mini-batch
divides the CP-summed numerator by the token count of the whole sequences (summed over CP and DP),
never by a rank's own count; a per-sequence mean (seq-mean-token-mean) divides each rank's part of
a row's sum by the row's whole token count (:func:`cp_row_sum`), so the parts add up over CP, and
the sequence/geometric rollout-correction weights and GSPO's sequence ratio sum each row's
log-ratio over CP the same way.
"""

from __future__ import annotations

import torch

from megatron_dapo.actor.gpu_settings import seq_pad_multiple


def cp_pad_multiple(
    cp: int, tp: int = 1, sequence_parallel: bool = False, fp8: str | None = None, fp8_recipe: str = "delayed"
) -> int:
    """The multiple every row length is padded to: ``2 * cp`` chunks per row, each chunk a
    multiple of :func:`~megatron_dapo.actor.gpu_settings.seq_pad_multiple` (a CP rank's share is
    what sequence parallelism splits over TP and what the FP8 GEMMs see: with FP8, ``2 * cp`` x
    ``16 * tp``, ``32 * tp`` for MXFP8)."""
    if cp < 1 or tp < 1:
        raise ValueError(f"cp={cp} and tp={tp} must be >= 1")
    base = seq_pad_multiple(tp, sequence_parallel, fp8, fp8_recipe)
    return 2 * cp * base if cp > 1 else base


def cp_chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two of the ``2 * cp`` chunks rank ``rank`` holds: ``rank`` and its mirror."""
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} outside [0, {cp})")
    return rank, 2 * cp - 1 - rank


def cp_split(x: torch.Tensor, cp: int, rank: int, dim: int = -1) -> torch.Tensor:
    """This rank's share of ``x`` along ``dim`` (length divisible by ``2 * cp``)."""
    if cp == 1:
        return x
    n = x.shape[dim]
    if n % (2 * cp):
        raise ValueError(f"sequence length {n} is not a multiple of 2*cp={2 * cp}; pad it first")
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = cp_chunk_ids(cp, rank)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def cp_unsplit(shares: list[torch.Tensor], dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`cp_split`: the full tensor from every rank's share, in rank order."""
    cp = len(shares)
    if cp == 1:
        return shares[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, share in enumerate(shares):
        first, second = share.chunk(2, dim=dim)
        a, b = cp_chunk_ids(cp, rank)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)


def cp_positions(cp: int, rank: int, length: int, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """The positions of a row of ``length`` that rank ``rank`` holds, in its order. Packed
    (``cu_seqlens``: the samples' boundaries in the row, each a multiple of ``2 * cp`` long)
    every sample is cut on its own, as Transformer Engine's THD context parallelism does, so a
    rank's share of the pack is its share of each sample, back to back."""
    if cu_seqlens is None:
        return cp_split(torch.arange(length), cp, rank, dim=0)
    if cu_seqlens[-1] != length:
        raise ValueError(f"cu_seqlens ends at {cu_seqlens[-1]}, the row has {length} positions")
    return torch.cat(
        [cp_split(torch.arange(lo, hi), cp, rank, dim=0) for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    )


def cp_split_inputs(tokens: torch.Tensor, cp: int, rank: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """``tokens`` ``[b, s]`` (s a multiple of ``2 * cp``) -> this rank's ``input_ids``, ``labels``
    (the next token, from the full row; the last position gets ``pad_id``) and ``position_ids``
    (positions in the full row, for RoPE)."""
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], pad_id)], dim=1)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return {
        "input_ids": cp_split(tokens, cp, rank, dim=1),
        "labels": cp_split(labels, cp, rank, dim=1),
        "position_ids": cp_split(positions, cp, rank, dim=1),
    }


def cp_token_mean(local_sums: list[torch.Tensor], local_counts: list[torch.Tensor]) -> torch.Tensor:
    """Token-mean over all CP ranks' tokens: sum of the ranks' numerators over the sum of their
    counts (what the all-reduces over the CP group compute); a rank's own mean is wrong whenever
    the loss tokens are not spread evenly across ranks."""
    return torch.stack(local_sums).sum(0) / torch.stack(local_counts).sum(0).clamp(min=1)


def cp_gather(local: torch.Tensor, group, dim: int = -1, cu_seqlens: list[int] | None = None) -> torch.Tensor:
    """Every CP rank's share of a per-token tensor gathered back into sequence order (the driver
    and the rollout log-prob check need whole rows); ``cu_seqlens``: a packed row's samples,
    each cut on its own (:func:`cp_positions`)."""
    import torch.distributed as dist

    shares = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shares, local.contiguous(), group=group)
    if cu_seqlens is None:
        return cp_unsplit(shares, dim=dim)
    return cp_unsplit_packed(shares, cu_seqlens, dim=dim)


def cp_unsplit_packed(shares: list[torch.Tensor], cu_seqlens: list[int], dim: int = -1) -> torch.Tensor:
    """Inverse of the packed cut (:func:`cp_positions`): the whole packed row from every rank's
    share, in rank order."""
    cp = len(shares)
    dim = dim % shares[0].dim()
    length = shares[0].shape[dim] * cp
    out = shares[0].new_empty(*shares[0].shape[:dim], length, *shares[0].shape[dim + 1 :])
    for rank, share in enumerate(shares):
        out.index_copy_(dim, cp_positions(cp, rank, length, cu_seqlens).to(share.device), share)
    return out


def cp_reduce_token_mean(local_sum: torch.Tensor, local_count: torch.Tensor, group) -> torch.Tensor:
    """The exact global token-mean: numerator and token count summed over ``group`` (DP x CP)
    before dividing, so uneven loss tokens per rank do not bias it."""
    import torch.distributed as dist

    both = torch.stack([local_sum.detach().to(torch.float64), local_count.to(torch.float64)])
    dist.all_reduce(both, group=group)
    return both[0] / both[1].clamp(min=1)


def cp_split_micro(micro, cp: int, rank: int):
    """This CP rank's share of a :class:`~megatron_dapo.actor.micro_batches.MicroBatch`: every
    per-position tensor cut along the sequence with :func:`cp_split` (labels and positions were
    taken from the whole row when it was collated, so no target is lost at a chunk boundary);
    per-row fields (``sample_index``, ``advantages``) are kept whole. A packed micro-batch
    (``cu_seqlens``) is cut sample by sample (:func:`cp_positions`); its ``cu_seqlens`` stay
    those of the whole row, as megatron's THD RoPE and TE's attention take them."""
    if cp == 1:
        return micro
    fields = dict(micro.__dict__)
    packed = micro.cu_seqlens
    mine = None if packed is None else cp_positions(cp, rank, micro.tokens.shape[1], packed.tolist())
    for key in micro.POSITION_FIELDS:
        if fields[key] is not None:
            if mine is None:
                fields[key] = cp_split(fields[key], cp, rank, dim=1)
            else:
                fields[key] = fields[key].index_select(1, mine)
    return type(micro)(**fields)


def cp_row_sum(group):
    """A ``row_sum`` for :func:`megatron_dapo.algo.policy_loss`: sums a per-row tensor (no
    gradient: counts, log-ratio sums) over the CP ranks, which hold the pieces of the same rows.
    Every CP rank computes the loss of the same micro-batches in the same order, so the
    collectives line up."""
    import torch.distributed as dist

    def row_sum(x: torch.Tensor) -> torch.Tensor:
        total = x.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    return row_sum
