"""Tokenised prompt dataset with length filtering, seeded per-epoch shuffling and a resumable cursor."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from megatron_dapo.data.types import DataError, PromptSample

logger = logging.getLogger(__name__)

_ROW_KEYS = ("index", "data_source", "messages", "ground_truth", "extra_info")


class PromptDataset:
    """Prompts for rollout, drawn in batches by a cursor that survives restarts.

    Args:
        rows: dicts as returned by :func:`~megatron_dapo.data.loading.load_prompt_rows`.
        tokenizer: HF-style tokenizer (``__call__`` or ``encode``; ``apply_chat_template``
            when ``apply_chat_template`` is set).
        max_prompt_length: prompts with more tokens are dropped (counted in ``stats``).
        apply_chat_template: render ``messages`` with the tokenizer's chat template (with the
            generation prompt) and tokenise without adding special tokens, since the template
            holds them; otherwise the message contents joined by blank lines are tokenised with
            the tokenizer's default special tokens.
        seed: shuffling seed; epoch ``e`` uses the permutation of ``seed + e``.
        shuffle: False keeps file order in every epoch.
        tools: OpenAI function schemas the chat template renders into the prompt (multi-turn tool
            use: the template's ``tools=`` argument); None for none.

    The order of epoch ``e`` is ``numpy.random.RandomState(seed + e).permutation(len(self))``;
    RandomState's stream is frozen by NumPy, so a run resumed on another machine or NumPy
    version draws the same prompts. ``stats`` holds ``rows``, ``kept``, ``too_long`` and
    ``longest_prompt_tokens``.
    """

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer,
        *,
        max_prompt_length: int,
        apply_chat_template: bool,
        seed: int,
        shuffle: bool = True,
        tools: list[dict] | None = None,
    ):
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be > 0, got {max_prompt_length}")
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {seed}")
        for i, row in enumerate(rows):
            missing = [k for k in _ROW_KEYS if k not in row]
            if missing:
                raise DataError(f"row {i} lacks {missing}; build rows with load_prompt_rows")
        if tools and not apply_chat_template:
            raise DataError(
                "tool schemas need the chat template to reach the prompt; set data.apply_chat_template=true"
            )
        texts = [_render(row["messages"], tokenizer, apply_chat_template, tools) for row in rows]
        ids = _tokenize(tokenizer, texts, add_special_tokens=not apply_chat_template)

        self.samples: list[PromptSample] = []
        too_long = 0
        for row, text, row_ids in zip(rows, texts, ids):
            if len(row_ids) > max_prompt_length:
                too_long += 1
                continue
            self.samples.append(
                PromptSample(
                    index=row["index"],
                    data_source=row["data_source"],
                    messages=row["messages"],
                    prompt_text=text,
                    prompt_ids=list(row_ids),
                    ground_truth=row["ground_truth"],
                    extra_info=row["extra_info"],
                )
            )
        longest = max((len(x) for x in ids), default=0)
        self.stats = {
            "rows": len(rows),
            "kept": len(self.samples),
            "too_long": too_long,
            "longest_prompt_tokens": longest,
        }
        if too_long:
            logger.warning(
                "dropped %d of %d prompts longer than max_prompt_length=%d tokens (longest: %d)",
                too_long,
                len(rows),
                max_prompt_length,
                longest,
            )
        if not self.samples:
            raise DataError(
                f"no prompts left: all {len(rows)} rows are empty or longer than max_prompt_length="
                f"{max_prompt_length} (longest prompt: {longest} tokens); raise data.max_prompt_length"
            )
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._index = 0
        self._order = self._order_of(0)
        self._positions: dict[tuple, int] | None = None  # position_of's lookup, built on first use

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> PromptSample:
        return self.samples[i]

    def position_of(self, sample: PromptSample) -> int:
        """The position of ``sample`` in this dataset (``self[pos]`` is the same prompt), found by
        content, so a copy read back from a checkpoint is found too. ``sample.index`` alone cannot
        be the key: it is the row within its source file, so two train files both have a row 0.
        Identical rows (same file row, source, text and answer) are one prompt: the first wins."""
        if self._positions is None:
            positions: dict[tuple, int] = {}
            for i, s in enumerate(self.samples):
                positions.setdefault(_identity(s), i)
            self._positions = positions
        try:
            return self._positions[_identity(sample)]
        except KeyError:
            raise DataError(
                f"prompt (row {sample.index} of its file, data_source {sample.data_source!r}) is not in this "
                "dataset; resume with the same data.train_files, max_prompt_length and tokenizer"
            ) from None

    @property
    def epoch(self) -> int:
        """Epochs completed by the cursor (the epoch the next sample comes from)."""
        return self._epoch

    def next_batch(self, n: int) -> list[PromptSample]:
        """The next ``n`` samples; crossing the end of an epoch continues in the next one."""
        if n <= 0:
            raise ValueError(f"batch size must be > 0, got {n}")
        batch = []
        while len(batch) < n:
            take = min(n - len(batch), len(self) - self._index)
            batch.extend(self.samples[i] for i in self._order[self._index : self._index + take])
            self._index += take
            if self._index == len(self):
                self._epoch += 1
                self._index = 0
                self._order = self._order_of(self._epoch)
        return batch

    def state_dict(self) -> dict:
        """The cursor: ``{"epoch", "index", "num_samples"}`` (num_samples guards against a changed dataset)."""
        return {"epoch": self._epoch, "index": self._index, "num_samples": len(self)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a cursor from :meth:`state_dict`; the next batch is the one the saved run would draw."""
        try:
            epoch, index = int(state["epoch"]), int(state["index"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"dataset state needs integer 'epoch' and 'index', got {state!r}") from e
        expected = state.get("num_samples", len(self))
        if expected != len(self):
            raise DataError(
                f"the saved data cursor is for {expected} prompts but this dataset has {len(self)}; resume "
                "with the same files, max_prompt_length and tokenizer, or start the data cursor afresh"
            )
        if epoch < 0 or not 0 <= index < len(self):
            raise ValueError(
                f"dataset state out of range: epoch={epoch}, index={index} for {len(self)} prompts"
            )
        self._epoch, self._index = epoch, index
        self._order = self._order_of(epoch)

    def _order_of(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self))
        return np.random.RandomState((self.seed + epoch) % 2**32).permutation(len(self))


def _identity(sample: PromptSample) -> tuple:
    """What tells one prompt from another across train files (a PromptSample has no file name)."""
    return (sample.index, sample.data_source, sample.prompt_text, sample.ground_truth)


def _render(
    messages: list[dict], tokenizer, apply_chat_template: bool, tools: list[dict] | None = None
) -> str:
    if not apply_chat_template:
        return "\n\n".join(m["content"] for m in messages)
    if not hasattr(tokenizer, "apply_chat_template"):
        raise DataError("apply_chat_template is set but the tokenizer has no apply_chat_template method")
    try:
        kwargs = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    except ValueError as e:  # transformers raises ValueError when no chat template is set
        raise DataError(
            f"the tokenizer cannot apply a chat template ({e}); set data.apply_chat_template=false for a "
            "base model, or use a tokenizer that has one"
        ) from e


def _tokenize(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    if not texts:
        return []
    if callable(tokenizer):
        return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
