"""The batch the actor trains on: prompt+response token sequences with DAPO's per-sample data.

One :class:`ActorBatch` is a whole rollout step (every sample of every kept group). Per-token
quantities of the response are stored right-padded to the longest response, as ``[B, R]``
tensors; position ``j`` of row ``i`` is response token ``j`` of sample ``i``, i.e. token
``input_ids[i][prompt_lens[i] + j]``, whose log-prob is predicted by the logits at position
``prompt_lens[i] + j - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

# The [B, R] float log-prob fields, aligned to the response tokens; micro-batches carry each of
# them to token positions (actor/micro_batches.py).
RESPONSE_FLOAT_FIELDS = ("rollout_logprobs", "old_logprobs", "ref_logprobs")


class BatchError(ValueError):
    """An :class:`ActorBatch` field is missing, mis-shaped or inconsistent."""


@dataclass
class ActorBatch:
    """A rollout step's samples, as the actor needs them.

    Attributes:
        input_ids: one 1-D int64 tensor per sample, prompt tokens followed by response tokens.
        prompt_lens: ``[B]`` int64, prompt tokens of each sample (>= 1: the first response token
            is scored from the last prompt position).
        response_lens: ``[B]`` int64, response tokens of each sample (>= 1);
            ``len(input_ids[i]) == prompt_lens[i] + response_lens[i]``.
        response_mask: ``[B, R]`` bool, R = max response length; the tokens that enter the loss
            (False beyond a sample's length; overlong filtering clears whole rows).
        advantages: ``[B]`` float, one advantage per sample (the same for all its tokens).
        group_index: ``[B]`` int64, the prompt (group) of each sample; mini-batches are formed
            from whole groups.
        rollout_logprobs: ``[B, R]`` float log-probs reported by the rollout engine, or None.
        old_logprobs: ``[B, R]`` float pi_old log-probs, or None to let the actor compute them.
        ref_logprobs: ``[B, R]`` float log-probs under the reference policy (the run's initial
            weights), or None: the actor computes them when it holds a reference model.
        scores: ``[B]`` float, the reward each advantage was computed from (score plus overlong
            penalty, minus a KL penalty when one is in the reward), or None.
        metadata: one dict per sample (data source, uid, ...), carried along untouched.
        routed_experts: per sample an int ``[n, layers, k]`` tensor, the experts each MoE layer of
            the rollout engine chose for token positions ``0..n-1`` (``n`` is ``len(input_ids[i])``
            or one less: the engine never forwards the last sampled token), or None.
        sampled_mask: ``[B, R]`` bool, the response tokens the model sampled (multi-turn: False
            on the environment's tokens), before overlong filtering; None: every response token.
            What the KL in the reward and the advantages' whitening count; ``response_mask`` is
            within it.
    """

    input_ids: list[torch.Tensor]
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    group_index: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    metadata: list[dict[str, Any]] = field(default_factory=list)
    routed_experts: list[torch.Tensor] | None = None
    sampled_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.validate()

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def max_response_len(self) -> int:
        return int(self.response_mask.shape[1])

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[B]`` total tokens (prompt + response) of each sample."""
        return self.prompt_lens + self.response_lens

    def num_loss_tokens(self) -> int:
        return int(self.response_mask.sum())

    def sampled_tokens(self) -> torch.Tensor:
        """``[B, R]`` bool: the response tokens the model sampled (overlong-filtered ones included)."""
        if self.sampled_mask is not None:
            return self.sampled_mask
        return torch.arange(self.max_response_len).unsqueeze(0) < self.response_lens.unsqueeze(1)

    def validate(self) -> None:
        """Raise :class:`BatchError` naming the first inconsistent field and sample."""
        b = len(self.input_ids)
        if b == 0:
            raise BatchError("ActorBatch is empty (input_ids has no sample)")
        for name in ("prompt_lens", "response_lens", "advantages", "group_index"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.shape != (b,):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise BatchError(f"ActorBatch.{name} must be a tensor of shape ({b},), got {shape}")
        for name in ("prompt_lens", "response_lens", "group_index"):
            if getattr(self, name).dtype.is_floating_point:
                raise BatchError(f"ActorBatch.{name} must be an integer tensor")
        if self.scores is not None and (self.scores.shape != (b,) or not self.scores.dtype.is_floating_point):
            raise BatchError(
                f"ActorBatch.scores must be a float tensor of shape ({b},), got {self.scores.dtype} "
                f"{tuple(self.scores.shape)}"
            )
        if not self.advantages.dtype.is_floating_point:
            raise BatchError("ActorBatch.advantages must be a float tensor")
        if not torch.isfinite(self.advantages).all():
            i = int((~torch.isfinite(self.advantages)).nonzero()[0])
            raise BatchError(f"ActorBatch.advantages[{i}] is not finite ({float(self.advantages[i])})")
        if (self.prompt_lens < 1).any():
            raise BatchError(f"ActorBatch.prompt_lens[{_first(self.prompt_lens < 1)}] must be >= 1")
        if (self.response_lens < 1).any():
            raise BatchError(f"ActorBatch.response_lens[{_first(self.response_lens < 1)}] must be >= 1")
        for i, ids in enumerate(self.input_ids):
            if ids.dim() != 1 or ids.dtype.is_floating_point:
                raise BatchError(f"ActorBatch.input_ids[{i}] must be a 1-D integer tensor")
            want = int(self.prompt_lens[i] + self.response_lens[i])
            if ids.numel() != want:
                raise BatchError(
                    f"ActorBatch.input_ids[{i}] has {ids.numel()} tokens but prompt_lens + response_lens "
                    f"= {int(self.prompt_lens[i])} + {int(self.response_lens[i])} = {want}"
                )
        r = int(self.response_lens.max())
        if self.response_mask.dtype != torch.bool or self.response_mask.shape != (b, r):
            raise BatchError(
                f"ActorBatch.response_mask must be bool of shape ({b}, {r}) (samples, longest response), "
                f"got {self.response_mask.dtype} {tuple(self.response_mask.shape)}"
            )
        beyond = torch.arange(r).unsqueeze(0) >= self.response_lens.unsqueeze(1)
        if (self.response_mask & beyond).any():
            raise BatchError(
                f"ActorBatch.response_mask is set beyond the response length of sample "
                f"{_first((self.response_mask & beyond).any(dim=1))}"
            )
        if self.sampled_mask is not None:
            if self.sampled_mask.dtype != torch.bool or self.sampled_mask.shape != (b, r):
                raise BatchError(
                    f"ActorBatch.sampled_mask must be bool of shape ({b}, {r}), got "
                    f"{self.sampled_mask.dtype} {tuple(self.sampled_mask.shape)}"
                )
            if (self.sampled_mask & beyond).any() or (self.response_mask & ~self.sampled_mask).any():
                raise BatchError(
                    "ActorBatch.sampled_mask must lie within the response lengths and hold response_mask "
                    "(a loss token is a sampled token)"
                )
        for name in RESPONSE_FLOAT_FIELDS:
            t = getattr(self, name)
            if t is None:
                continue
            if t.shape != (b, r) or not t.dtype.is_floating_point:
                raise BatchError(
                    f"ActorBatch.{name} must be a float tensor of shape ({b}, {r}), got {t.dtype} "
                    f"{tuple(t.shape)}"
                )
            bad = self.response_mask & ~torch.isfinite(t)
            if bad.any():
                raise BatchError(
                    f"ActorBatch.{name} has non-finite values at sample {_first(bad.any(dim=1))}"
                )
        if self.metadata and len(self.metadata) != b:
            raise BatchError(f"ActorBatch.metadata has {len(self.metadata)} entries for {b} samples")
        if self.routed_experts is not None:
            self._validate_routed_experts()

    def _validate_routed_experts(self) -> None:
        experts = self.routed_experts
        if len(experts) != len(self.input_ids):
            raise BatchError(
                f"ActorBatch.routed_experts has {len(experts)} entries for {len(self.input_ids)} samples"
            )
        shape = None
        for i, (e, ids) in enumerate(zip(experts, self.input_ids)):
            if e.dim() != 3 or e.dtype.is_floating_point or e.shape[0] not in (ids.numel() - 1, ids.numel()):
                raise BatchError(
                    f"ActorBatch.routed_experts[{i}] must be an integer [tokens, layers, k] tensor with "
                    f"{ids.numel() - 1} or {ids.numel()} tokens, got {e.dtype} {tuple(e.shape)}"
                )
            if shape is not None and e.shape[1:] != shape:
                raise BatchError(
                    f"ActorBatch.routed_experts[{i}] has layers x k {tuple(e.shape[1:])}, sample 0 has {tuple(shape)}"
                )
            shape = e.shape[1:]

    def select(self, indices: torch.Tensor | list[int]) -> ActorBatch:
        """The samples at ``indices`` (in that order), response tensors cut to their longest."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        r = int(self.response_lens[idx].max())

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx, :r]

        return ActorBatch(
            input_ids=[self.input_ids[i] for i in idx.tolist()],
            prompt_lens=self.prompt_lens[idx],
            response_lens=self.response_lens[idx],
            response_mask=self.response_mask[idx, :r],
            advantages=self.advantages[idx],
            group_index=self.group_index[idx],
            rollout_logprobs=rows(self.rollout_logprobs),
            old_logprobs=rows(self.old_logprobs),
            ref_logprobs=rows(self.ref_logprobs),
            scores=None if self.scores is None else self.scores[idx],
            metadata=[self.metadata[i] for i in idx.tolist()] if self.metadata else [],
            routed_experts=None
            if self.routed_experts is None
            else [self.routed_experts[i] for i in idx.tolist()],
            sampled_mask=rows(self.sampled_mask),
        )

    def with_old_logprobs(self, old_logprobs: torch.Tensor) -> ActorBatch:
        """A copy carrying ``old_logprobs`` ([B, R])."""
        return replace(self, old_logprobs=old_logprobs)

    def with_ref_logprobs(self, ref_logprobs: torch.Tensor) -> ActorBatch:
        """A copy carrying ``ref_logprobs`` ([B, R])."""
        return replace(self, ref_logprobs=ref_logprobs)


def _first(flags: torch.Tensor) -> int:
    return int(flags.nonzero()[0])


def make_actor_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    advantages: list[float] | torch.Tensor,
    group_index: list[int] | torch.Tensor,
    *,
    rollout_logprobs: list[list[float]] | None = None,
    loss_mask: list[bool] | None = None,
    metadata: list[dict[str, Any]] | None = None,
    routed_experts: list[torch.Tensor] | None = None,
) -> ActorBatch:
    """Build an :class:`ActorBatch` from plain token lists (the rollout side's format).

    ``loss_mask[i] = False`` drops sample i from the loss (overlong filtering) while keeping it in
    the batch.
    """
    if not (len(prompts) == len(responses) == len(advantages) == len(group_index)):
        raise BatchError(
            f"prompts ({len(prompts)}), responses ({len(responses)}), advantages ({len(advantages)}) and "
            f"group_index ({len(group_index)}) must have one entry per sample"
        )
    resp_lens = torch.tensor([len(r) for r in responses], dtype=torch.long)
    r = int(resp_lens.max()) if len(responses) else 0
    mask = torch.arange(r).unsqueeze(0) < resp_lens.unsqueeze(1)
    if loss_mask is not None:
        mask &= torch.as_tensor(loss_mask, dtype=torch.bool).unsqueeze(1)
    rollout = None
    if rollout_logprobs is not None:
        rollout = torch.zeros(len(responses), r, dtype=torch.float32)
        for i, lp in enumerate(rollout_logprobs):
            if len(lp) != len(responses[i]):
                raise BatchError(
                    f"rollout_logprobs[{i}] has {len(lp)} values for {len(responses[i])} response tokens"
                )
            rollout[i, : len(lp)] = torch.as_tensor(lp, dtype=torch.float32)
    return ActorBatch(
        input_ids=[torch.tensor(list(p) + list(q), dtype=torch.long) for p, q in zip(prompts, responses)],
        prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.long),
        response_lens=resp_lens,
        response_mask=mask,
        advantages=torch.as_tensor(advantages, dtype=torch.float32),
        group_index=torch.as_tensor(group_index, dtype=torch.long),
        rollout_logprobs=rollout,
        metadata=list(metadata) if metadata else [],
        routed_experts=list(routed_experts) if routed_experts is not None else None,
    )
