"""Data types that leave the data package: one prompt sample, and the error for bad input rows."""

from __future__ import annotations

from dataclasses import dataclass, field


class DataError(ValueError):
    """A prompt file or row that cannot be used; the message names the file, row and field."""


@dataclass
class PromptSample:
    """One prompt, ready for rollout.

    Attributes:
        index: the row's position (0-based) in its source file; stable across shuffles, resumes
            and skipped rows, so it identifies the prompt in logs and dumps.
        data_source: selects the reward (see :mod:`megatron_dapo.rewards.registry`).
        messages: chat messages ``[{"role": ..., "content": ...}]`` after the prompt template.
        prompt_text: exactly the text that was tokenised (after the chat template, if used).
        prompt_ids: token ids of ``prompt_text``.
        ground_truth: reference answer given to the reward.
        extra_info: the row's ``extra_info`` dict, passed to the reward unchanged.
    """

    index: int
    data_source: str
    messages: list[dict]
    prompt_text: str
    prompt_ids: list[int]
    ground_truth: str
    extra_info: dict = field(default_factory=dict)
