"""Partial rollouts (``rollout.partial``): responses stopped before they finished, kept and continued.

When the rollout manager aborts the over-sampling tail of dynamic sampling (the batch is full,
the weights change next), the requests still generating return the tokens they have so far
(the HF engine between decode steps, SGLang in its aborted ``/generate`` reply). With partial
rollouts on, those tokens are not thrown away: each sample keeps its tokens, their rollout
log-probs and the weight version of every token, and the next rollout continues it with
whatever weights the engines then hold, sending prompt + partial response as the input and the
remaining token budget. The finished sample is the concatenation; ``token_versions`` records the
version of each token, so staleness (oldest token) and rollout correction (per token) see the mix.

Everything here is plain data: what a group carries between rollouts, how a continuation
request is built, how its answer joins what came before, and the JSON form a checkpoint holds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from megatron_dapo.data.types import PromptSample
from megatron_dapo.rollout.types import EpisodeInfo, GenerationRequest, GenerationResult, SamplingParams


@dataclass
class PartialSample:
    """One response of a carried group: its tokens so far, and whether it already finished.

    ``finish_reason`` is None while unfinished ("stop"/"length" once done: a finished response is
    carried whole and not sent again). ``token_versions`` is None when an engine did not know its
    weight version for some piece (then the whole response's versions are unknown).
    ``interrupted`` counts the aborts this response went through (a continuation follows each).
    """

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] | None = field(default_factory=list)
    finish_reason: str | None = None
    weight_version: int | None = None
    routed_experts: Any = None
    interrupted: int = 0
    # multi-turn: the tokens' loss mask (None: all sampled) and the episode so far
    # (EpisodeInfo.as_dict(); its last turn tells where it stopped: mid-turn or after a tool answer)
    loss_mask: list[int] | None = None
    episode: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def oldest_version(self) -> int | None:
        """The version of the oldest token (None: no tokens, or versions unknown)."""
        return min(self.token_versions) if self.token_versions else None


@dataclass
class CarriedGroup:
    """A prompt group past the cut of a rollout: ``n`` partial samples, in sample order."""

    prompt: PromptSample
    samples: list[PartialSample]

    def tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.samples)

    def oldest_version(self) -> int | None:
        versions = [v for s in self.samples if (v := s.oldest_version()) is not None]
        return min(versions) if versions else None


def join(prefix: PartialSample | None, result: GenerationResult) -> GenerationResult:
    """The continuation's answer after the tokens already generated: one result for the whole
    response (versions per token; unknown when either piece's are; the routed experts of the
    last call, which forwarded prompt + every earlier token)."""
    if prefix is None or not prefix.output_ids:
        return result
    versions = (
        prefix.token_versions + result.token_versions
        if prefix.token_versions is not None and result.token_versions is not None
        else None
    )
    mask = None
    if prefix.loss_mask is not None or result.loss_mask is not None:
        mask = _mask(prefix.loss_mask, len(prefix.output_ids)) + _mask(
            result.loss_mask, len(result.output_ids)
        )
    if result.episode is not None and result.episode.broken:
        # a broken episode is trained on nowhere, the tokens carried from before the abort included
        mask = [0] * (len(prefix.output_ids) + len(result.output_ids))
    return GenerationResult(
        result.request_id,
        prefix.output_ids + result.output_ids,
        prefix.logprobs + result.logprobs,
        result.finish_reason,
        result.weight_version,
        token_versions=versions,
        routed_experts=result.routed_experts,
        loss_mask=mask,
        # the runner's episode covers every turn since the response began
        episode=result.episode,
    )


def _mask(mask: list[int] | None, n: int) -> list[int]:
    return [1] * n if mask is None else list(mask)


def from_result(result: GenerationResult, prefix: PartialSample | None) -> PartialSample:
    """What a sample carries after ``result`` (already joined with ``prefix``) came back."""
    aborted = result.finish_reason == "abort"
    before = prefix.interrupted if prefix is not None else 0
    return PartialSample(
        output_ids=list(result.output_ids),
        logprobs=list(result.logprobs),
        token_versions=None if result.token_versions is None else list(result.token_versions),
        finish_reason=None if aborted else result.finish_reason,
        weight_version=result.weight_version,
        routed_experts=None if aborted else result.routed_experts,
        interrupted=before + aborted,
        loss_mask=None if result.loss_mask is None else list(result.loss_mask),
        episode=None if result.episode is None else result.episode.as_dict(),
    )


def as_result(request_id: str, sample: PartialSample) -> GenerationResult:
    """A finished carried sample as the result of its (unsent) request."""
    return GenerationResult(
        request_id,
        list(sample.output_ids),
        list(sample.logprobs),
        sample.finish_reason,
        sample.weight_version,
        token_versions=None if sample.token_versions is None else list(sample.token_versions),
        routed_experts=sample.routed_experts,
        loss_mask=None if sample.loss_mask is None else list(sample.loss_mask),
        episode=None if sample.episode is None else EpisodeInfo.from_dict(sample.episode),
    )


def continuation(
    request_id: str,
    prompt_ids: list[int],
    sample: PartialSample,
    sampling: SamplingParams,
    tools_kwargs: dict[str, Any] | None = None,
) -> GenerationRequest:
    """The request that continues ``sample``: prompt + its tokens as the input, the rest of the
    response budget as ``max_new_tokens`` (same stop tokens and sampling settings), and the
    seeded draws already spent skipped (``seed_offset``: with the same seed and weights, an engine
    that honours it continues exactly as the uninterrupted request). A multi-turn episode carries
    its turns, so the runner resumes it mid-turn or after its last tool answer, and its
    ``tools_kwargs`` (the sample's), so its tools get what they got before the abort."""
    done = len(sample.output_ids)
    if done >= sampling.max_new_tokens:  # cannot happen: such a response finished with "length"
        raise ValueError(
            f"request {request_id}: partial response of {done} tokens has no budget left "
            f"(max_new_tokens={sampling.max_new_tokens})"
        )
    episode = None if sample.episode is None else EpisodeInfo.from_dict(sample.episode)
    # the draws of the turn being continued: a turn's seed starts fresh (agent/runner.py)
    drawn = done
    if episode is not None:
        last = episode.turns[-1] if episode.turns else None
        mid_turn = last is not None and last.role == "assistant" and last.finish_reason is None
        drawn = last.end - last.start if mid_turn else 0
    params = SamplingParams(
        **{**asdict(sampling), "max_new_tokens": sampling.max_new_tokens - done, "seed_offset": drawn}
    )
    return GenerationRequest(
        request_id,
        list(prompt_ids) + list(sample.output_ids),
        params,
        episode=episode,
        tools_kwargs=tools_kwargs,
    )


# ---------------------------------------------------------------- checkpoint form
def carry_to_state(groups: list[CarriedGroup]) -> dict[str, Any]:
    """JSON-able form for the checkpoint (``TrainerState.partial_rollouts``); {} when none."""
    if not groups:
        return {}
    out = []
    for g in groups:
        rows = []
        for s in g.samples:
            row = asdict(s)
            if isinstance(s.routed_experts, torch.Tensor):
                row["routed_experts"] = s.routed_experts.tolist()
            rows.append(row)
        out.append({"prompt": asdict(g.prompt), "samples": rows})
    return {"groups": out}


def carry_from_state(state: dict[str, Any]) -> list[CarriedGroup]:
    """The groups :func:`carry_to_state` stored (the JSON form checkpoints held before the carried
    file; also what :meth:`RolloutManager.partial_state_dict` gives)."""
    groups = []
    for g in (state or {}).get("groups", []):
        samples = []
        for row in g["samples"]:
            row = dict(row)
            if row.get("routed_experts") is not None:
                row["routed_experts"] = torch.tensor(row["routed_experts"], dtype=torch.int16)
            samples.append(PartialSample(**row))
        groups.append(CarriedGroup(PromptSample(**g["prompt"]), samples))
    return groups


# ---------------------------------------------------------------- the carried file's form
def carry_to_items(groups: list[CarriedGroup]) -> tuple[list[Any], dict[str, Any]]:
    """The groups as flat items for the checkpoint's carried file (driver/run_state.py: one
    PromptSample per group, then every group's PartialSample rows, so token ids, log-probs and
    versions become flat tensors, not JSON) and the small index the trainer state keeps:
    ``{"groups": G, "samples": [responses per group]}``; ({}, []) when none."""
    if not groups:
        return [], {}
    items: list[Any] = [g.prompt for g in groups]
    for g in groups:
        items.extend(g.samples)
    return items, {"groups": len(groups), "samples": [len(g.samples) for g in groups]}


def carry_from_items(items: list[Any], index: dict[str, Any]) -> list[CarriedGroup]:
    """The groups :func:`carry_to_items` flattened, from the items read back and its index."""
    sizes = [int(n) for n in index.get("samples", [])]
    prompts, rows = items[: len(sizes)], items[len(sizes) :]
    if (
        len(prompts) != len(sizes)
        or len(rows) != sum(sizes)
        or not all(isinstance(p, PromptSample) for p in prompts)
        or not all(isinstance(r, PartialSample) for r in rows)
    ):
        raise ValueError(
            f"the carried file holds {len(prompts)} prompts and {len(rows)} partial responses where its "
            f"index says {len(sizes)} groups of {sum(sizes)} responses"
        )
    groups, at = [], 0
    for prompt, n in zip(prompts, sizes):
        groups.append(CarriedGroup(prompt, rows[at : at + n]))
        at += n
    return groups
