"""Scores from a classifier reward model served by SGLang (``--is-embedding``, ``POST /classify``).

The conversation (prompt messages, then the response as the assistant's turn) is rendered with
the reward model's own chat template and tokenised here, and the token ids are sent
(``EmbeddingReqInput.input_ids``): the ids are then exactly the ones transformers would see, with
no second tokenisation on the server. SGLang answers ``{"embedding": [...], "meta_info": ...}``,
the score head's output at the last token: ``num_labels`` logits, not normalised. With one label
that logit is the score; a ``reward.model.transform`` (``"path.py:fn"``) maps it (or, with several
labels, the list) to the reward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from megatron_dapo.hf_tokenizer import load_tokenizer as load_saved_tokenizer
from megatron_dapo.rewards.registry import load_custom_fn
from megatron_dapo.rewards.served.outcome import RewardModelError, RewardSample, ScoreOutcome
from megatron_dapo.rewards.served.transport import Answer, ServerPool


def load_tokenizer(path: str, what: str):
    """The HF tokenizer at ``path``, as it was saved (``hf_tokenizer``: a custom tokenizer.json
    next to a Qwen2 config stays itself); one line naming ``what`` when it cannot be loaded."""
    try:
        return load_saved_tokenizer(path)
    except (OSError, ValueError) as e:
        raise RewardModelError(
            f"{what}: cannot load the tokenizer at {path} ({' '.join(str(e).split())[:300]})"
        ) from e


def render_ids(tokenizer, messages: Sequence[dict], response: str, what: str) -> list[int]:
    """Prompt and response as the reward model's chat template renders them, as token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise RewardModelError(
            f"{what}: the reward model's tokenizer has no chat template, so prompt and response cannot be "
            "rendered as it was trained on them; add its chat_template to tokenizer_config.json"
        )
    conversation = [*messages, {"role": "assistant", "content": response}]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
    # the template writes the special tokens itself
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def parse_classify_answer(body: Any) -> list[float] | None:
    """The logits of one ``/classify`` answer, or None when it holds none."""
    if not isinstance(body, dict):
        return None
    values = body.get("embedding")
    if not isinstance(values, list) or not values:
        return None
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        return None
    return out if all(math.isfinite(v) for v in out) else None


class ClassifierClient:
    """Async scoring by a classifier reward model behind ``pool``.

    Args:
        pool: the servers (one model).
        tokenizer: the reward model's HF tokenizer (its chat template renders the conversation).
        transform: ``reward.model.transform``: ``"path.py:fn"``, a callable, or None. It gets the
            logit (a float; with several labels, the list) and returns the reward.
    """

    def __init__(self, pool: ServerPool, tokenizer, transform: str | Callable | None = None):
        self.pool = pool
        self.tokenizer = tokenizer
        self.transform_spec = (
            transform if isinstance(transform, str) else getattr(transform, "__name__", None)
        )
        self.transform = load_custom_fn(transform) if isinstance(transform, str) else transform

    def payload(self, sample: RewardSample) -> dict:
        """``EmbeddingReqInput`` of one sample."""
        return {"input_ids": render_ids(self.tokenizer, sample.messages, sample.response, self.pool.what)}

    async def score(self, sample: RewardSample) -> ScoreOutcome:
        start = time.monotonic()
        result = await self.pool.post("/classify", self.payload(sample), str(sample.sample_id))
        elapsed = time.monotonic() - start
        if not isinstance(result, Answer):
            return ScoreOutcome(
                sample.sample_id,
                None,
                result.reason,
                result.detail,
                server=result.server,
                attempts=result.attempts,
                throttled=result.throttled,
                elapsed_s=elapsed,
            )
        raw = parse_classify_answer(result.body)
        if raw is None:
            return ScoreOutcome(
                sample.sample_id,
                None,
                "unparseable",
                f"/classify answer has no finite 'embedding' list: {str(result.body)[:200]}",
                server=result.server,
                attempts=result.attempts,
                throttled=result.throttled,
                elapsed_s=elapsed,
            )
        score = self._reward(raw, sample)
        return ScoreOutcome(
            sample.sample_id,
            score,
            raw=raw,
            server=result.server,
            attempts=result.attempts,
            throttled=result.throttled,
            elapsed_s=elapsed,
        )

    def _reward(self, raw: list[float], sample: RewardSample) -> float:
        value: Any = raw[0] if len(raw) == 1 else raw
        if self.transform is None:
            if len(raw) != 1:
                raise RewardModelError(
                    f"{self.pool.what}: the model returns {len(raw)} logits per sample, not one; set "
                    "reward.model.transform to a 'path.py:fn' that maps the list to a reward"
                )
            return raw[0]
        try:
            out = float(self.transform(value))
        except Exception as e:  # a user function's bug: name it, not a traceback from its depths
            raise RewardModelError(
                f"reward.model.transform={self.transform_spec} raised {type(e).__name__}: {e} "
                f"for sample {sample.sample_id} (raw score {value})"
            ) from e
        if not math.isfinite(out):
            raise RewardModelError(
                f"reward.model.transform={self.transform_spec} returned {out} for sample {sample.sample_id} "
                f"(raw score {value}); a reward must be finite"
            )
        return out
