"""Data that crosses the rollout boundary: requests to engines, their results, and the train batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_dapo.data.types import PromptSample

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class SamplingParams:
    """Per-request sampling settings (the subset of SGLang's ``sampling_params`` that RL uses).

    Attributes:
        temperature: 0 means greedy.
        top_p: nucleus mass in (0, 1]; 1.0 disables it.
        top_k: -1 disables it, else >= 1.
        max_new_tokens: response budget (L_max).
        stop_token_ids: extra ids that end a response (the model's EOS ids always do unless
            ``ignore_eos``). The stop token is kept in the response, as SGLang's token output does.
        seed: per-request sampling seed; None draws from the engine's global generator.
        ignore_eos: do not stop on the model's EOS ids.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"sampling temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"sampling top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenerationRequest:
    """One prompt to sample one response for. ``request_id`` must be unique among in-flight requests."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams


@dataclass
class GenerationResult:
    """What an engine returns for one request.

    ``logprobs[i]`` is the log-probability of ``output_ids[i]`` under the temperature-scaled
    distribution ``log_softmax(logits / T)`` over the whole vocabulary, before top-p/top-k
    truncation (SGLang's ``output_token_logprobs``). An aborted request returns what it had
    generated so far with ``finish_reason="abort"``.

    ``token_versions[i]`` is the weight version that generated ``output_ids[i]``; an engine that
    generates a request under one version leaves it None and it is filled with
    ``weight_version`` (None when the engine's version is unknown, e.g. mid-load).
    """

    request_id: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int | None = None
    token_versions: list[int] | None = None
    # MoE routing replay: int [prompt + output - 1, layers, k], the experts each MoE layer chose
    # for every token the engine forwarded (prompt and output; the last output token is never
    # forwarded), or None when the engine does not record them.
    routed_experts: Any = None

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if len(self.output_ids) != len(self.logprobs):
            raise ValueError(
                f"request {self.request_id}: {len(self.output_ids)} output ids but {len(self.logprobs)} logprobs"
            )
        if self.token_versions is None and self.weight_version is not None:
            self.token_versions = [self.weight_version] * len(self.output_ids)
        if self.token_versions is not None and len(self.token_versions) != len(self.output_ids):
            raise ValueError(
                f"request {self.request_id}: {len(self.output_ids)} output ids but "
                f"{len(self.token_versions)} token versions"
            )


@dataclass
class RolloutSample:
    """One scored response of one group (one prompt).

    ``final_reward = score + overlong_penalty`` (the penalty is 0 when overlong shaping is off).
    ``truncated`` is True when the response hit ``max_new_tokens`` (finish_reason "length").
    """

    group_id: int
    prompt: PromptSample
    response_ids: list[int]
    rollout_logprobs: list[float]
    response_text: str
    finish_reason: FinishReason
    score: float
    acc: bool
    pred: str
    overlong_penalty: float
    final_reward: float
    weight_version: int | None
    truncated: bool
    reward_error: str | None = None
    # The weight version that generated each response token (None: unknown).
    token_versions: list[int] | None = None
    # MoE routing replay: GenerationResult.routed_experts of this response, or None.
    routed_experts: Any = None
    # rollout.partial: how many times the generation was stopped (tail abort) and continued
    # later, possibly with newer weights (0: generated in one go)
    interrupted: int = 0

    @property
    def response_length(self) -> int:
        return len(self.response_ids)


@dataclass
class RolloutBatch:
    """The train batch of one step: groups of n samples, contiguous and ordered by group.

    ``group_index[i]`` is the group id of ``samples[i]`` (a list ready for ``torch.tensor``);
    ``metrics`` holds the step's ``rollout/...`` numbers.
    """

    samples: list[RolloutSample]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def group_index(self) -> list[int]:
        return [s.group_id for s in self.samples]

    @property
    def num_groups(self) -> int:
        return len(dict.fromkeys(self.group_index))

    @property
    def rewards(self) -> list[float]:
        return [s.final_reward for s in self.samples]

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [s.prompt.prompt_ids for s in self.samples]

    @property
    def response_ids(self) -> list[list[int]]:
        return [s.response_ids for s in self.samples]

    @property
    def rollout_logprobs(self) -> list[list[float]]:
        return [s.rollout_logprobs for s in self.samples]

    @property
    def truncated(self) -> list[bool]:
        return [s.truncated for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)
