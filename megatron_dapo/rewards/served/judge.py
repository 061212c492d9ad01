"""Scores from a generative judge: a chat model asked about the response with a prompt template,
its verdict turned into a score by a parser.

Two ways to ask: a judge the run serves (``reward.model.path``) gets SGLang's ``POST /generate``
with the prompt rendered by the judge's own chat template and tokenised here (the ids the judge
was trained to read, with the generation prompt); a judge given by ``reward.model.url`` gets the
OpenAI-compatible ``POST /v1/chat/completions`` (SGLang, vLLM and hosted APIs serve it, and the
server applies the chat template). Sampling is the judge's own (``reward.model.temperature``, 0 =
greedy; ``reward.model.max_new_tokens``), never the policy's.

Parsers (``reward.model.parser``) map the verdict text to a score, or to None: an *unparseable*
verdict, which leaves the sample unscored rather than scoring it as wrong.

- ``yes_no``: the verdict as judges write it, first: in the final answer (below), the first line
  that opens with "yes" or "no" (after markup such as ``**``, or a label such as ``Verdict:`` /
  ``Final answer:``), else the first standalone "yes" or "no" anywhere in it (any case) -> +1.0 /
  -1.0. So "Yes.\n\nNo further comment." is +1: what follows the verdict is commentary. The
  same two values as the DAPO math rule (``math_dapo``), so a judge can replace the rule without
  changing the reward's scale, and ``acc`` (score > 0) keeps its meaning.
- ``boxed_score``: the number in the last ``\\boxed{...}`` (``7``, ``0.5``, ``-2``, ``3/4``,
  ``\\frac{3}{4}``, ``\\dfrac``/``\\tfrac``, a sign before the fraction).
- ``"path.py:fn"``: ``fn(verdict: str) -> float | None``; None or an exception is unparseable.

The final answer, which both built-in parsers read: what follows the last ``</think>`` (a
reasoning judge may think in several blocks, or open its thinking in the prompt and write only
the closing tag), up to any ``<think>`` opened after it and never closed (cut off while thinking
again). A verdict whose thinking never closed, or with nothing after it but more thinking, is
unparseable, so a reasoning judge's musings ("yes, but...") never count as its verdict; text
between two thinking blocks counts only when nothing follows the last one.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from megatron_dapo.rewards.math_dapo import last_boxed_content
from megatron_dapo.rewards.registry import load_custom_fn
from megatron_dapo.rewards.served.outcome import RewardModelError, RewardSample, ScoreOutcome
from megatron_dapo.rewards.served.transport import Answer, ServerPool

# Why this wording: it names the one thing to judge (the final answer against the reference,
# not the reasoning or its format, which the policy's style may change during training), and
# asks for one word last, which yes_no reads. The placeholders are replaced literally, so a
# template may hold other braces (\boxed{} for boxed_score).
DEFAULT_PROMPT_TEMPLATE = (
    "You are grading a response to a question against a reference answer.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer:\n{ground_truth}\n\n"
    "Response:\n{response}\n\n"
    "Is the final answer of the response equivalent to the reference answer? Judge only the final "
    "answer, not the reasoning or the formatting. Reply with one word: yes or no."
)
PLACEHOLDERS = ("{question}", "{response}", "{ground_truth}")
# what stands for the beginning of a response cut to fit the judge's context (JudgeClient.fit)
_CUT_MARK = "[...] "
YES, NO = 1.0, -1.0

_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
# a line that opens with the verdict: "Yes.", "**No**", "Verdict: yes", "Final answer: **NO**"
_VERDICT_LINE = re.compile(
    r"^[\W_]*(?:(?:final\s+)?(?:answer|verdict|judg(?:e)?ment|decision)\W*)?(yes|no)\b",
    re.IGNORECASE | re.MULTILINE,
)
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_FRACTION = re.compile(r"^(?P<sign>[+-]?)(?P<top>\d+)\s*/\s*(?P<bottom>\d+)$")
_LATEX_FRACTION = re.compile(
    r"^(?P<sign>[+-]?)\s*\\[dt]?frac\s*\{\s*(?P<top>\d+(?:\.\d*)?)\s*\}\s*\{\s*(?P<bottom>\d+(?:\.\d*)?)\s*\}$"
)


def _final_text(verdict: str) -> str | None:
    """The judge's final answer (see the module), or None when it is all thinking."""
    text = verdict.rsplit("</think>", 1)[1] if "</think>" in verdict else verdict
    text = text.split("<think>", 1)[0]  # thinking opened again and never closed
    if not text.strip() and "</think>" in verdict:
        # nothing after the last block: the answer between blocks, if any
        text = _THINK_BLOCK.sub(" ", verdict).split("<think>", 1)[0]
        text = text.rsplit("</think>", 1)[-1]
    return text if text.strip() else None


def parse_yes_no(verdict: str) -> float | None:
    """+1.0 for a "yes" verdict, -1.0 for a "no", None when there is neither (see the module)."""
    text = _final_text(verdict)
    if text is None:
        return None
    m = _VERDICT_LINE.search(text) or _YES_NO.search(text)
    if m is None:
        return None
    return YES if m.group(1).lower() == "yes" else NO


def parse_boxed_score(verdict: str) -> float | None:
    """The number in the last ``\\boxed{}`` (a decimal, ``a/b`` or ``\\frac{a}{b}``), None when
    there is none."""
    text = _final_text(verdict)
    content = last_boxed_content(text) if text is not None else None
    if content is None:
        return None
    content = content.strip().strip("$").strip()
    if _NUMBER.match(content):
        value = float(content)
    elif m := (_FRACTION.match(content) or _LATEX_FRACTION.match(content)):
        sign, top, bottom = m.group("sign") or "", m.group("top"), m.group("bottom")
        if float(bottom) == 0:
            return None
        value = float(sign + top) / float(bottom)
    else:
        return None
    return value if math.isfinite(value) else None


BUILTIN_PARSERS: dict[str, Callable[[str], float | None]] = {
    "yes_no": parse_yes_no,
    "boxed_score": parse_boxed_score,
}


def load_parser(spec: str | Callable) -> tuple[str, Callable[[str], Any]]:
    """``(name, parser)`` for ``reward.model.parser``: a built-in name, a ``"path.py:fn"``, or a callable."""
    if callable(spec):
        return getattr(spec, "__name__", "parser"), spec
    if spec in BUILTIN_PARSERS:
        return spec, BUILTIN_PARSERS[spec]
    if ".py:" in spec:
        return spec, load_custom_fn(spec)
    raise RewardModelError(
        f"reward.model.parser={spec!r} is not one of {', '.join(BUILTIN_PARSERS)} or 'path/to/file.py:function'"
    )


def judge_prompt_ids(tokenizer: Any, template: str, sample: RewardSample) -> list[int]:
    """The ids a served judge is sent for ``sample``: the filled template as the user's message,
    rendered by the judge's chat template with the generation prompt (what it was trained to
    read; the demo's judge is trained on exactly these)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": render_prompt(template, sample)}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt(template: str, sample: RewardSample) -> str:
    """The template with ``{question}`` (the last user message), ``{response}`` and
    ``{ground_truth}`` replaced; any other text, braces included, is kept."""
    question = next(
        (str(m.get("content", "")) for m in reversed(sample.messages) if m.get("role") == "user"), ""
    )
    values = {
        "{question}": question,
        "{response}": sample.response,
        "{ground_truth}": str(sample.ground_truth),
    }
    # one pass, so a response that itself contains "{ground_truth}" is not filled in
    pattern = re.compile("|".join(re.escape(p) for p in PLACEHOLDERS))
    return pattern.sub(lambda m: values[m.group(0)], template)


class JudgeClient:
    """Async scoring by a judge behind ``pool``.

    Args:
        pool: the judge servers (one model).
        api: ``"sglang"`` (``/generate``, needs ``tokenizer``) or ``"openai"`` (``/v1/chat/completions``).
        tokenizer: the judge's HF tokenizer (``api="sglang"``): its chat template renders the prompt.
        prompt_template: None for :data:`DEFAULT_PROMPT_TEMPLATE`.
        parser: ``reward.model.parser`` (see the module's docstring).
        temperature / max_new_tokens: the judge's sampling.
        model_name: the ``model`` of an OpenAI request; None asks the server (``GET /v1/models``).
        too_long / context_len: ``reward.model.too_long``, and the judge's context (None: asked
            from the server, ``GET /v1/models``'s ``max_model_len``; see :meth:`fit`).
    """

    def __init__(
        self,
        pool: ServerPool,
        *,
        api: str,
        tokenizer=None,
        prompt_template: str | None = None,
        parser: str | Callable = "yes_no",
        temperature: float = 0.0,
        max_new_tokens: int = 1024,
        model_name: str | None = None,
        too_long: str = "cut",
        context_len: int | None = None,
    ):
        if api not in ("sglang", "openai"):
            raise ValueError(f"api={api!r} must be 'sglang' or 'openai'")
        if api == "sglang" and tokenizer is None:
            raise ValueError("api='sglang' sends token ids and needs the judge's tokenizer")
        self.pool = pool
        self.api = api
        self.tokenizer = tokenizer
        self.prompt_template = prompt_template or DEFAULT_PROMPT_TEMPLATE
        if "{response}" not in self.prompt_template:
            raise RewardModelError(
                "reward.model.prompt_template has no {response}: the judge would never see the response"
            )
        self.parser_name, self.parser = load_parser(parser)
        self.temperature = float(temperature)
        self.max_new_tokens = int(max_new_tokens)
        self.model_name = model_name
        if too_long not in ("cut", "unscored"):
            raise ValueError(f"too_long={too_long!r} must be 'cut' or 'unscored'")
        self.too_long = too_long
        self.context_len = context_len  # the judge's context in tokens (the server's max_model_len)
        self._resolved = False

    def messages(self, sample: RewardSample) -> list[dict]:
        return [{"role": "user", "content": render_prompt(self.prompt_template, sample)}]

    def prompt_ids(self, sample: RewardSample) -> list[int]:
        """The judge's prompt as its chat template renders it, generation prompt on."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RewardModelError(
                f"{self.pool.what}: the judge's tokenizer has no chat template; a judge is a chat model "
                "(add its chat_template to tokenizer_config.json)"
            )
        return judge_prompt_ids(self.tokenizer, self.prompt_template, sample)

    def room(self) -> tuple[int | None, int]:
        """``(the longest prompt, the verdict's tokens)``: a prompt and its verdict must fit the
        judge's context (SGLang refuses a request whose input plus ``max_new_tokens`` does not),
        so the verdict keeps ``max_new_tokens`` of it, at most a quarter; the prompt the rest.
        ``(None, max_new_tokens)`` while the context is unknown."""
        if not self.context_len:
            return None, self.max_new_tokens
        verdict = max(1, min(self.max_new_tokens, self.context_len // 4))
        return self.context_len - verdict, verdict

    def fit(self, sample: RewardSample) -> tuple[list[int] | None, int, str]:
        """The judge's prompt ids within :meth:`room`: ``(ids, response tokens cut, "")``, or
        ``(None, 0, why)`` when it cannot fit (``too_long="unscored"``, or a prompt too long
        without any of the response).

        The rule for a prompt that is too long (``too_long="cut"``): the response's beginning is
        dropped and its last tokens kept, after a ``[...]`` mark, as many as fit: a judge reads
        the final answer, which is at the end (as the DAPO rule reads the last 300 characters)."""
        ids = self.prompt_ids(sample)
        limit, _ = self.room()
        if limit is None or len(ids) <= limit:
            return ids, 0, ""
        why = f"the judge's prompt is {len(ids)} tokens, its context {self.context_len} leaves {limit} beside the verdict"
        if self.too_long == "unscored":
            return None, 0, why + " (reward.model.too_long=unscored)"
        response = list(self.tokenizer(sample.response, add_special_tokens=False)["input_ids"])
        keep = len(response) - (len(ids) - limit)
        for _ in range(4):  # re-tokenising the cut text may shift a few tokens
            if keep <= 0:
                break
            cut = replace(sample, response=_CUT_MARK + self.tokenizer.decode(response[-keep:]))
            ids = self.prompt_ids(cut)
            if len(ids) <= limit:
                return ids, len(response) - keep, ""
            keep -= len(ids) - limit
        return None, 0, why + ", even with the response cut away: shorten the prompt template or the question"

    def payload(self, sample: RewardSample, ids: list[int] | None = None) -> dict:
        _, verdict = self.room()
        if self.api == "sglang":
            return {
                "input_ids": self.prompt_ids(sample) if ids is None else ids,
                "sampling_params": {
                    "temperature": self.temperature,
                    "max_new_tokens": verdict,
                    "skip_special_tokens": True,
                },
            }
        return {
            "model": self.model_name or "default",
            "messages": self.messages(sample),
            "temperature": self.temperature,
            "max_completion_tokens": verdict,
        }

    async def resolve_server(self) -> None:
        """What the judge's server says of itself (``GET /v1/models``, SGLang and vLLM alike):
        the model's name an OpenAI request wants (the first listed), and its context
        (``max_model_len``), which sizes the prompt (:meth:`fit`). Asked once."""
        if self._resolved:
            return
        self._resolved = True
        try:
            card = (await self.pool.get("/v1/models"))["data"][0]
        except Exception:  # noqa: BLE001 - servers that list nothing take any name (SGLang does)
            card = {}
        if self.api == "openai" and self.model_name is None:
            self.model_name = str(card.get("id") or "default")
        length = card.get("max_model_len") if isinstance(card, dict) else None
        if self.context_len is None and isinstance(length, int) and length > 0:
            self.context_len = length

    def check_template_fits(self) -> None:
        """Refuse at start-up a judge whose context cannot hold the prompt template itself (an
        empty question, response and reference): no sample could ever be scored, each would be
        left "too_long", and the run would stop at its first step having generated it for
        nothing. Raises :class:`RewardModelError` in one line naming the sizes and the fixes."""
        limit, verdict = self.room()
        if limit is None or self.api != "sglang":
            return
        empty = len(self.prompt_ids(RewardSample("template", [{"role": "user", "content": ""}], "", "")))
        if empty > limit:
            raise RewardModelError(
                f"reward.model.prompt_template: the judge's prompt with an empty question, response and "
                f"reference is {empty} tokens, and its context of {self.context_len} tokens leaves {limit} "
                f"beside the verdict's {verdict} (reward.model.max_new_tokens={self.max_new_tokens}, at most "
                "a quarter of the context), so no sample could be scored: shorten reward.model.prompt_template "
                "or serve a judge with a longer context"
            )

    async def score(self, sample: RewardSample) -> ScoreOutcome:
        start = time.monotonic()
        await self.resolve_server()
        path = "/generate" if self.api == "sglang" else "/v1/chat/completions"
        ids, cut = None, 0
        if self.api == "sglang":
            ids, cut, why = self.fit(sample)
            if ids is None:
                return ScoreOutcome(
                    sample.sample_id, None, "too_long", why, elapsed_s=time.monotonic() - start
                )
        result = await self.pool.post(path, self.payload(sample, ids), str(sample.sample_id))
        elapsed = time.monotonic() - start
        common = {
            "attempts": result.attempts,
            "server": result.server,
            "elapsed_s": elapsed,
            "throttled": result.throttled,
            "cut_tokens": cut,
        }
        if not isinstance(result, Answer):
            return ScoreOutcome(sample.sample_id, None, result.reason, result.detail, **common)
        verdict, cut_short = self._verdict(result.body)
        if verdict is None:
            detail = f"{path} answer has no text: {str(result.body)[:200]}"
            return ScoreOutcome(sample.sample_id, None, "unparseable", detail, **common)
        score, why = self._parse(verdict)
        if score is None:
            if cut_short:
                why += f"; the verdict was cut at {self.room()[1]} tokens (reward.model.max_new_tokens)"
            return ScoreOutcome(sample.sample_id, None, "unparseable", why, verdict=verdict, **common)
        return ScoreOutcome(sample.sample_id, score, verdict=verdict, **common)

    def _verdict(self, body: Any) -> tuple[str | None, bool]:
        """``(text, cut at the token limit)`` of a ``/generate`` or chat-completions answer."""
        try:
            if self.api == "sglang":
                reason = body["meta_info"].get("finish_reason") or {}
                kind = reason.get("type") if isinstance(reason, dict) else reason
                return str(body["text"]), kind == "length"
            choice = body["choices"][0]
            content = choice["message"]["content"]
            # None when the server put everything elsewhere (a reasoning field, a tool call)
            return (None if content is None else str(content)), choice.get("finish_reason") == "length"
        except (KeyError, IndexError, TypeError, AttributeError):
            return None, False

    def _parse(self, verdict: str) -> tuple[float | None, str]:
        shown = " ".join(verdict.split())[-160:]
        try:
            value = self.parser(verdict)
        except Exception as e:  # noqa: BLE001 - a parser that cannot read a verdict: unparseable
            return None, f"parser {self.parser_name} raised {type(e).__name__}: {e} on verdict ...{shown!r}"
        if value is None:
            return None, f"parser {self.parser_name} found no score in verdict ...{shown!r}"
        number = None
        if not isinstance(value, (str, bool)) and hasattr(value, "__float__"):
            number = float(value)
        if number is None or not math.isfinite(number):
            return (
                None,
                f"parser {self.parser_name} returned {value!r:.40}, not a finite number, for ...{shown!r}",
            )
        return number, ""


def judge_api(url: str | None) -> str:
    """Which API a judge is asked through: SGLang's own for a server the run starts, the
    OpenAI-compatible one for a server given by URL (any vendor)."""
    return "openai" if url else "sglang"
