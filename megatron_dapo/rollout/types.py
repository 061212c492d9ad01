"""Data that crosses the rollout boundary: requests to engines, their results, and the train batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_dapo.data.types import PromptSample

# "turns": a multi-turn episode still calling tools at rollout.multi_turn.max_assistant_turns
FinishReason = Literal["stop", "length", "abort", "turns"]
FINISH_REASONS = ("stop", "length", "abort", "turns")


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
        seed_offset: draws of the seeded generator already spent on this response's tokens (a
            continuation after an abort): an engine that can skip them (the HF engine) samples
            what the uninterrupted request would have; SGLang cannot and ignores it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    seed_offset: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"sampling temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"sampling top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed_offset < 0:
            raise ValueError(f"sampling seed_offset must be >= 0, got {self.seed_offset}")


@dataclass
class EpisodeTurn:
    """One turn of a multi-turn response: its response tokens ``[start, end)``.

    ``role`` "assistant": tokens the model sampled (loss mask 1); ``finish_reason`` is how the turn
    ended ("stop", "length"), None while it is unfinished (aborted mid-turn, to be continued), and
    ``calls`` the tool calls it made. ``role`` "tool": the environment's answer to those calls
    (loss mask 0), with how many of them were answered by an error or a time-out; every call is
    counted there, and a tool turn of no tokens (``start == end``) holds the calls whose answers
    were not appended (they did not fit the budget, or the episode broke).
    """

    role: str
    start: int
    end: int
    finish_reason: str | None = None
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    # a tool turn's messages as appended (their contents, cut to the token cap): what the
    # re-render of the conversation (rollout.multi_turn.tokenization_sanity_check_mode) renders;
    # kept while the episode is unfinished (a continuation is checked whole), None once it ends
    contents: list[str] | None = None


@dataclass
class EpisodeInfo:
    """What a multi-turn response is made of, beyond its tokens and loss mask.

    ``end``: why the episode ended ("stop": a turn without a tool call; "length": the response
    budget or the context ran out; "turns": max_assistant_turns reached; "prefix_break": a turn's
    request was not the episode's ids, or did not extend the previous request's ids plus what the
    engine returned), None while it runs. ``prefix_breaks`` counts those breaks (0 or 1: an
    episode stops at its first); ``rerender_mismatches`` is 1 when the finished episode's ids
    differ from the chat template's rendering of its whole conversation (in a way
    ``rollout.multi_turn.tokenization_sanity_check_mode`` does not tolerate). Either makes the
    episode ``broken``: every token of it is masked, the carried ones included, and it leaves its
    group unscored.
    """

    turns: list[EpisodeTurn] = field(default_factory=list)
    end: str | None = None
    prefix_breaks: int = 0
    # the tools' per-episode instance key (verl class tools keep state per episode), kept across
    # continuations of the episode
    key: str | None = None
    rerender_mismatches: int = 0
    # the response's ids when the runner handed it over (a digest): a continuation's request must
    # end with exactly these
    digest: str | None = None

    @property
    def broken(self) -> bool:
        return bool(self.prefix_breaks or self.rerender_mismatches)

    @property
    def length(self) -> int:
        return self.turns[-1].end if self.turns else 0

    def assistant_turns(self) -> list[EpisodeTurn]:
        return [t for t in self.turns if t.role == "assistant"]

    def as_dict(self) -> dict[str, Any]:
        """The JSON form samples and checkpoints hold. Written out rather than ``asdict``: every
        episode of a step is converted, and ``asdict``'s recursive deep copy took a tenth of the
        driver's CPU in the calculator demo's rollouts."""
        return {
            "turns": [
                {
                    "role": t.role,
                    "start": t.start,
                    "end": t.end,
                    "finish_reason": t.finish_reason,
                    "calls": t.calls,
                    "errors": t.errors,
                    "timeouts": t.timeouts,
                    "contents": None if t.contents is None else list(t.contents),
                }
                for t in self.turns
            ],
            "end": self.end,
            "prefix_breaks": self.prefix_breaks,
            "key": self.key,
            "rerender_mismatches": self.rerender_mismatches,
            "digest": self.digest,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpisodeInfo:
        return cls(
            turns=[EpisodeTurn(**t) for t in d.get("turns", [])],
            end=d.get("end"),
            prefix_breaks=int(d.get("prefix_breaks", 0)),
            key=d.get("key"),
            rerender_mismatches=int(d.get("rerender_mismatches", 0)),
            digest=d.get("digest"),
        )


@dataclass
class GenerationRequest:
    """One prompt to sample one response for. ``request_id`` must be unique among in-flight requests.

    ``episode``: a multi-turn episode continued after an abort (``prompt_ids`` then ends with its
    response so far); engines ignore it, the episode runner resumes from it. ``tools_kwargs``:
    verl's per-sample tool arguments (the dataset row's ``extra_info.tools_kwargs``: ``{tool name:
    {"create_kwargs": {...}, "execute_kwargs": {...}}}``), which the episode runner hands to the
    tools; engines ignore it. ``prefix_lengths``: set on an episode's turn, the lengths of its
    earlier turns' prompts (each a prefix of ``prompt_ids``; empty on its first turn). The HF
    engine computes such a prompt in segments split there and keeps its keys and values for the
    next turn, which then prefills only what it adds; SGLang's radix cache finds prefixes itself
    and ignores it. None: nothing to keep."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    episode: EpisodeInfo | None = None
    tools_kwargs: dict[str, Any] | None = None
    prefix_lengths: tuple[int, ...] | None = None


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
    # Multi-turn: 1 for each output token the model sampled, 0 for the environment's (their
    # logprobs are 0.0); None when every token was sampled (every engine's own answer).
    loss_mask: list[int] | None = None
    # Multi-turn: the episode's turns from the start of its response (a continuation's include the
    # turns before the abort), or None for a single-turn response.
    episode: EpisodeInfo | None = None

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if len(self.output_ids) != len(self.logprobs):
            raise ValueError(
                f"request {self.request_id}: {len(self.output_ids)} output ids but {len(self.logprobs)} logprobs"
            )
        if self.loss_mask is not None and len(self.loss_mask) != len(self.output_ids):
            raise ValueError(
                f"request {self.request_id}: {len(self.output_ids)} output ids but {len(self.loss_mask)} loss-mask entries"
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
    # Multi-turn: 1 per response token the model sampled, 0 per environment token; None when
    # every token was sampled. The episode (EpisodeInfo.as_dict()), None for a single turn.
    loss_mask: list[int] | None = None
    episode: dict[str, Any] | None = None
    # reward.model: why the served reward model gave no score (rewards/served: timeout,
    # server_error, unparseable, down), None when scored. An unscored sample leaves its group: it
    # is trained on by no one and takes no part in the group's advantages (never scored 0).
    unscored: str | None = None
    # the reward's components: the rule reward's score and the reward model's (None where the
    # run does not compute it; rollout metrics reward/rule_mean, reward/model_mean)
    rule_score: float | None = None
    model_score: float | None = None

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def sampled_length(self) -> int:
        """Response tokens the model sampled (all of them for a single turn)."""
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)


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
