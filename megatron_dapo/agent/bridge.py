"""The chat-template bridge between the turns of a multi-turn episode, as token ids.

An episode is never re-rendered from text. The model's turn is the token ids it sampled, ending
with the template's end-of-turn token (``<|im_end|>`` for Qwen), which stays. The environment's
answer is appended as a suffix the model's own chat template renders: the conversation
``[fixed user message, fixed assistant message, *environment messages]`` is rendered with the
generation prompt, and everything after the fixed assistant message's end-of-turn token is the
suffix (the template's separator, e.g. the ``\\n`` after ``<|im_end|>``, the tool turn, the next
assistant header and, for Qwen3 with thinking off, the empty think block). The suffix starts right
after a special token, so it tokenises the same on its own as after the episode's tokens.

Why not render the whole conversation again each turn: a template may rewrite earlier turns
(Qwen3 drops the reasoning of turns before the last user message, and the empty think block of
turns without reasoning), and text that went through decode and encode again need not give back
the sampled ids. Either way the trainer would score tokens the model never sampled, with the
engine's log-probs of other tokens. The bridge never looks at how the template renders an earlier
assistant turn.

``check_append_only`` builds an episode the way the runner does and sets it beside the one-shot
rendering of the same conversation: where the template does not rewrite earlier turns they are
equal; where they differ, the report says in which turn and on which side of the loss mask.
"""

from __future__ import annotations

import difflib
import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

# Contents no real conversation has, so that finding them in a rendering is unambiguous.
_PROBE_USER = "bridge-probe: fixed user message"
_PROBE_ASSISTANT = "bridge-probe: fixed assistant message"
_PROBE_TOOL_RESULT = "bridge-probe: tool result"
_PROBE_FUNCTION = "bridge_probe_function"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": _PROBE_FUNCTION,
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
TRUNCATE_SIDES = ("left", "right", "middle")
# The environment speaks as a tool or as a user; an assistant message here would be a turn the
# model did not sample.
_ENV_ROLES = ("tool", "user")


def truncation_marker(cut_tokens: int) -> str:
    """The text ``truncate(side="middle")`` puts where it elided ``cut_tokens`` tokens."""
    return f"\n...[{cut_tokens} tokens cut]...\n"


class ChatBridge:
    """Token ids for the prompt and the environment's turns of an episode, from a chat template.

    Args:
        tokenizer: an HF tokenizer (``apply_chat_template``, ``encode``, ``decode``,
            ``get_added_vocab``).
        chat_template: the template to use; default the tokenizer's own.
        template_kwargs: extra variables for the template, e.g. ``{"enable_thinking": False}``
            for Qwen3; the same ones every rendering gets.
        name: how errors name the template (default the tokenizer's ``name_or_path``).

    Raises ValueError when the template cannot serve multi-turn tool use: it has no tool role,
    an assistant message in it is not followed by a special end-of-turn token, or the fixed
    assistant message cannot be found in its rendering.

    ``end_of_turn_ids`` is what generation must stop on; ``turn_separator`` is the text the
    template puts after the end-of-turn token when the conversation ends there (``"\\n"`` for
    Qwen), which an episode does not contain.
    """

    def __init__(
        self,
        tokenizer,
        *,
        chat_template: str | None = None,
        template_kwargs: dict | None = None,
        name: str | None = None,
    ):
        self.tokenizer = tokenizer
        template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        label = name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        if not template:
            raise ValueError(
                f"tokenizer {label!r} has no chat template; multi-turn episodes render the environment's "
                "turns with the model's chat template: pass chat_template="
            )
        self.chat_template: str = template
        digest = hashlib.sha256(template.encode()).hexdigest()[:12]
        self.name = f"the chat template of {label!r} (sha256 {digest})"
        self.template_kwargs = dict(template_kwargs or {})
        reserved = {"tools", "add_generation_prompt", "chat_template", "tokenize"} & set(self.template_kwargs)
        if reserved:
            raise ValueError(f"template_kwargs may not set {sorted(reserved)}: the bridge sets them per call")
        self._added_tokens = {i: t for t, i in tokenizer.get_added_vocab().items()}
        # rerender's fixed first message, encoded once: the runner re-renders every episode
        self._probe_user_ids: list[int] | None = None
        # A fast tokenizer keeps split_special_tokens as state of its Rust tokenizer, set by each
        # encode call before it encodes; the engine calls' episodes run on threads of their own, and
        # a tool answer (special tokens split, so it cannot forge a turn boundary) encoded while
        # another thread encodes a rendering (special tokens whole) must not take its setting.
        self._encoding = threading.Lock()
        self._eot_text, self.end_of_turn_ids, self.turn_separator = self._find_end_of_turn()
        # Where the suffix starts in the probe rendering, by the environment messages' roles: the
        # text before it can depend on which roles follow (Qwen3's last user query), never on
        # their contents.
        self._suffix_start: dict[tuple, int] = {}
        self._check_tool_role()
        self.renders_tools = _PROBE_FUNCTION in self.render(
            [{"role": "user", "content": _PROBE_USER}], tools=_PROBE_TOOLS, add_generation_prompt=True
        )

    def render(self, messages: Sequence[dict], *, tools=None, add_generation_prompt: bool) -> str:
        """``messages`` through the template as text, with the bridge's template kwargs."""
        extra = dict(self.template_kwargs)
        if tools:
            extra["tools"] = list(tools)
        return self.tokenizer.apply_chat_template(
            list(messages),
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **extra,
        )

    def prompt_ids(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """The first request: ``messages`` rendered with the tool schemas (OpenAI function
        schemas), generation prompt on. Without tools and template kwargs these are the ids
        ``data.PromptDataset`` builds for the same messages."""
        if tools and not self.renders_tools:
            raise ValueError(
                f"{self.name} ignores tools= (a probe schema did not appear in its rendering): the model "
                "would never see the tool schemas; use a template that renders them"
            )
        return self._encode(self.render(messages, tools=tools, add_generation_prompt=True))

    def env_ids(self, messages: Sequence[dict], *, ended_with_eot: bool = True) -> list[int]:
        """The environment's turn after a model turn, as the template renders it after an
        assistant message: separator, ``messages`` (``{"role": "tool", "content": ...}`` or
        ``"user"``), the next generation prompt.

        ``ended_with_eot=False``: the model's turn stopped on another stop token, so the
        end-of-turn token the template expects is not in the episode yet; it comes first here,
        as an environment token (the model did not sample it)."""
        if not messages:
            raise ValueError("env_ids needs the environment's messages (a tool result or a user message)")
        for m in messages:
            if m.get("role") not in _ENV_ROLES:
                raise ValueError(
                    f"an environment message has role {m.get('role')!r}; the environment speaks as "
                    f"{' or '.join(_ENV_ROLES)}"
                )
        suffix = self._suffix_ids(messages)
        return suffix if ended_with_eot else list(self.end_of_turn_ids) + suffix

    def rerender(self, turns: Sequence[tuple[str, Sequence]]) -> tuple[list[int], list[int]]:
        """The template's rendering of an episode's whole conversation at once, for the runner's
        token check: ``turns`` are ``("assistant", sampled ids)`` and ``("tool", [contents])``
        from the response's start. The conversation starts with the fixed user message (the real
        prompt is the dataset's, rendered once); each model turn is decoded (special tokens
        kept) into an assistant message, its end-of-turn token left to the template. Returns
        (the ids of the fixed user message's rendering with the generation prompt, the ids of
        the whole conversation's rendering), the second encoded as one text; an episode that
        ends with a model turn has no separator after it, and none after an unfinished turn's
        text either (no end-of-turn token)."""
        if not turns:
            raise ValueError("rerender needs at least one turn")
        user = {"role": "user", "content": _PROBE_USER}
        messages: list[dict] = [user]
        eot, closed = list(self.end_of_turn_ids), True
        for role, value in turns:
            if role == "assistant":
                ids = list(value)
                closed = ids[len(ids) - len(eot) :] == eot
                messages.append(
                    {
                        "role": "assistant",
                        "content": self._decode(ids[: len(ids) - len(eot)] if closed else ids),
                    }
                )
            else:
                messages += [{"role": "tool", "content": c} for c in value]
        ends_with_env = turns[-1][0] != "assistant"
        text = self.render(messages, add_generation_prompt=ends_with_env)
        tail = self._eot_text + self.turn_separator
        if not ends_with_env and text.endswith(tail):
            text = text[: len(text) - len(tail)] + (self._eot_text if closed else "")
        if self._probe_user_ids is None:
            self._probe_user_ids = self._encode(self.render([user], add_generation_prompt=True))
        return list(self._probe_user_ids), self._encode(text)

    def truncate(self, text: str, max_tokens: int, side: str) -> str:
        """``text`` cut to ``max_tokens`` tokens of this tokenizer (not characters): ``left`` keeps
        its start, ``right`` its end, ``middle`` both ends with ``truncation_marker`` between. The
        result never takes more than ``max_tokens`` tokens, the marker's included (the cap is what
        the episode's budget reserves for an answer); a cap too small for the marker and a token of
        each end keeps the start alone. Text that fits comes back unchanged."""
        if side not in TRUNCATE_SIDES:
            raise ValueError(f"side must be one of {TRUNCATE_SIDES}, got {side!r}")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        ids = self._encode(text)
        if len(ids) <= max_tokens:
            return text
        if side == "left":
            return self._head(ids, max_tokens)
        if side == "right":
            return self._tail(ids, max_tokens)
        # The marker's own tokens come out of the cap; its count is largest when least is kept.
        keep = max_tokens - len(self._encode(truncation_marker(len(ids))))
        # The two halves re-encode as one text, whose token boundaries at the seams can differ
        # from the halves' own; shrink until the whole fits.
        while keep >= 2:
            head_n = (keep + 1) // 2
            out = (
                self._head(ids, head_n) + truncation_marker(len(ids) - keep) + self._tail(ids, keep - head_n)
            )
            if len(self._encode(out)) <= max_tokens:
                return out
            keep -= 1
        return self._head(ids, max_tokens)

    # -- internals --------------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        # The template writes the special tokens itself; the tokenizer must not add a BOS. A tool's
        # answer is encoded whole before it is cut, often past the model's length: no warning.
        with self._encoding:
            return list(self.tokenizer.encode(text, add_special_tokens=False, verbose=False))

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _head(self, ids: list[int], n: int) -> str:
        # A cut inside a multi-byte character decodes to U+FFFD, and a decoded prefix need not
        # re-encode to as few tokens: step back until the text is whole and fits.
        for k in range(n, -1, -1):
            text = self._decode(ids[:k])
            if (not text.endswith("\ufffd") or k == 0) and len(self._encode(text)) <= n:
                return text
        return ""

    def _tail(self, ids: list[int], n: int) -> str:
        for k in range(n, -1, -1):
            text = self._decode(ids[len(ids) - k :]) if k else ""
            if (not text.startswith("\ufffd") or k == 0) and len(self._encode(text)) <= n:
                return text
        return ""

    def _find_end_of_turn(self) -> tuple[str, list[int], str]:
        probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        try:
            text = self.render(probe, add_generation_prompt=False)
        except Exception as e:  # a template that cannot render even a user and an assistant message
            raise ValueError(f"{self.name} cannot render [user, assistant] ({type(e).__name__}: {e})") from e
        at = text.find(_PROBE_ASSISTANT)
        if at < 0:
            raise ValueError(
                f"cannot locate the fixed assistant message {_PROBE_ASSISTANT!r} in the rendering of "
                f"{self.name}: {text!r}; the bridge needs a template that writes an assistant message's "
                "content verbatim"
            )
        after = text[at + len(_PROBE_ASSISTANT) :]
        ids = self._encode(after)
        eot = self._added_tokens.get(ids[0]) if ids else None
        if eot is None or not after.startswith(eot):
            raise ValueError(
                f"{self.name} ends an assistant message with {after[:40]!r}, not with a special token: "
                "multi-turn episodes need an end-of-turn token that generation stops on and that is kept "
                "(e.g. <|im_end|>)"
            )
        return eot, [ids[0]], after[len(eot) :]

    def _check_tool_role(self) -> None:
        need = (
            "multi-turn tool use (rollout.multi_turn) needs a chat template with a 'tool' role that "
            "writes the tool's result into the conversation (as Qwen2.5's and Qwen3's do); give the "
            "tokenizer such a template or pass chat_template="
        )
        tool = [{"role": "tool", "content": _PROBE_TOOL_RESULT}]
        try:
            text = self._probe_rendering(tool)
        except Exception as e:  # the template's own raise_exception, or any error of its logic
            raise ValueError(
                f"{self.name} cannot render a tool message ({type(e).__name__}: {e}); {need}"
            ) from e
        if _PROBE_TOOL_RESULT not in self._suffix_of(text, tool):
            raise ValueError(
                f"{self.name} drops tool messages (a probe tool result is not in its rendering); {need}"
            )

    def _suffix_text(self, messages: Sequence[dict]) -> str:
        return self._suffix_of(self._probe_rendering(messages), messages)

    def _suffix_ids(self, messages: Sequence[dict]) -> list[int]:
        """The suffix's tokens. A content that holds the text of an added token (a tool printing
        ``<|im_end|><|im_start|>assistant``) must not end the tool turn and open a model turn in
        the tokens: such contents are encoded as plain text (special tokens written inside them
        stay text), the template's own parts as usual. Any other suffix is encoded whole, the
        tokenizer's own segmentation. A template that changes the contents (escapes, trims)
        is encoded whole too."""
        added = self._added_tokens.values()
        if not any(tok in str(m.get("content", "")) for m in messages for tok in added):
            return self._encode(self._suffix_text(messages))
        marks = [f"\u27e6bridge-content-{i}\u27e7" for i in range(len(messages))]
        masked = [{**m, "content": mark} for m, mark in zip(messages, marks)]
        text = self._suffix_text(masked)
        pieces, rest = [], text
        for mark in marks:
            before, found, rest = rest.partition(mark)
            if not found or mark in rest:
                return self._encode(self._suffix_text(messages))
            pieces.append(before)
        ids: list[int] = []
        for before, m in zip(pieces, messages):
            ids += self._encode(before) + self._encode_plain(str(m.get("content", "")))
        return ids + self._encode(rest)

    def _encode_plain(self, text: str) -> list[int]:
        with self._encoding:
            return list(
                self.tokenizer.encode(
                    text, add_special_tokens=False, split_special_tokens=True, verbose=False
                )
            )

    def _probe_rendering(self, messages: Sequence[dict]) -> str:
        probe = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ASSISTANT},
            *messages,
        ]
        return self.render(probe, add_generation_prompt=True)

    def _suffix_of(self, text: str, messages: Sequence[dict]) -> str:
        anchor = _PROBE_ASSISTANT + self._eot_text
        key = tuple(m.get("role") for m in messages)
        start = self._suffix_start.get(key)
        if start is None or text[start - len(anchor) : start] != anchor:
            # The first occurrence: the environment's contents come after it and may repeat it.
            at = text.find(anchor)
            if at < 0:
                raise ValueError(
                    f"cannot locate the fixed assistant message followed by its end-of-turn token "
                    f"({anchor!r}) in the rendering of {self.name} with environment messages of roles "
                    f"{list(key)}: {text!r}"
                )
            start = at + len(anchor)
            self._suffix_start[key] = start
        return text[start:]


@dataclass(frozen=True)
class Turn:
    """One model turn of an episode for ``check_append_only``.

    ``sampled``: the turn's text as the model sampled it, without the end-of-turn token;
    ``message``: the same turn as a chat message (``content``, ``tool_calls``,
    ``reasoning_content``) for the one-shot rendering; ``env``: the environment's messages after
    it (empty: the episode ends with this turn)."""

    sampled: str
    message: dict
    env: Sequence[dict] = ()


@dataclass(frozen=True)
class Difference:
    """Where the episode and the one-shot rendering disagree, in tokens of each.

    ``where`` names the episode's piece (``prompt``, ``turn K`` for a sampled turn, ``environment
    after turn K``); ``sampled`` is True when those episode tokens are the model's (loss mask 1),
    False when they are the environment's (mask 0), None when the span crosses both."""

    episode_span: tuple[int, int]
    oneshot_span: tuple[int, int]
    episode_text: str
    oneshot_text: str
    where: str
    sampled: bool | None


@dataclass
class AppendOnlyReport:
    """An episode built turn by turn beside the one-shot rendering of its conversation.

    ``episode_ids`` = prompt + response; ``loss_mask`` covers the response (1: sampled, 0:
    environment); ``oneshot_ids`` is the template's rendering of the whole conversation, less the
    ``oneshot_tail`` (the separator after the last end-of-turn token, which no episode holds)."""

    episode_ids: list[int]
    prompt_len: int
    loss_mask: list[int]
    oneshot_ids: list[int]
    oneshot_tail: str
    pieces: list[tuple[str, int, int]] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.differences

    def describe(self) -> str:
        if self.equal:
            return f"episode ({len(self.episode_ids)} tokens) equals the one-shot rendering"
        lines = [f"episode and one-shot rendering differ in {len(self.differences)} place(s):"]
        for d in self.differences:
            side = {True: "sampled", False: "environment", None: "sampled and environment"}[d.sampled]
            lines.append(
                f"  {d.where} ({side}), episode tokens {d.episode_span[0]}:{d.episode_span[1]} "
                f"{d.episode_text!r} vs one-shot tokens {d.oneshot_span[0]}:{d.oneshot_span[1]} "
                f"{d.oneshot_text!r}"
            )
        return "\n".join(lines)


def check_append_only(
    bridge: ChatBridge,
    messages: Sequence[dict],
    turns: Sequence[Turn],
    *,
    tools: Sequence[dict] | None = None,
) -> AppendOnlyReport:
    """Build an episode as the runner does (``prompt_ids``; each turn's sampled tokens plus the
    end-of-turn token; ``env_ids``) and compare it with the one-shot rendering of the same
    conversation (``messages``, then each turn's message and environment messages).

    Each sampled turn is taken to be the tokenizer's encoding of ``Turn.sampled``. The report's
    differences are token spans, each one-sided span slid to start at an added token
    (``<think>``) where the alignment allows, so a dropped think block shows as itself. A
    difference with text on both sides at a turn's start is a re-tokenization: the generation
    prompt's last piece (e.g. ``"\n\n"``) split otherwise when the sampled text follows it in one
    string, with a tokenizer whose pre-tokenizer does that (Qwen's does not)."""
    if not turns:
        raise ValueError("check_append_only needs at least one turn")
    for i, turn in enumerate(turns[:-1]):
        if not turn.env:
            raise ValueError(f"turn {i} has no environment messages; only the last turn may end the episode")
    prompt = bridge.prompt_ids(messages, tools)
    episode = list(prompt)
    mask: list[int] = []
    pieces = [("prompt", 0, len(prompt))]
    conversation = list(messages)
    for i, turn in enumerate(turns):
        ids = bridge._encode(turn.sampled) + list(bridge.end_of_turn_ids)
        pieces.append((f"turn {i}", len(episode), len(episode) + len(ids)))
        episode += ids
        mask += [1] * len(ids)
        conversation.append(turn.message)
        if turn.env:
            env = bridge.env_ids(turn.env)
            pieces.append((f"environment after turn {i}", len(episode), len(episode) + len(env)))
            episode += env
            mask += [0] * len(env)
            conversation += list(turn.env)
    ends_with_env = bool(turns[-1].env)
    text = bridge.render(conversation, tools=tools, add_generation_prompt=ends_with_env)
    tail = ""
    if not ends_with_env and bridge.turn_separator and text.endswith(bridge.turn_separator):
        tail = bridge.turn_separator
        text = text[: -len(tail)]
    oneshot = bridge._encode(text)
    report = AppendOnlyReport(episode, len(prompt), mask, oneshot, tail, pieces)
    added = set(bridge._added_tokens)
    matcher = difflib.SequenceMatcher(None, episode, oneshot, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        i1, i2, j1, j2 = _slide_to_added_token(episode, oneshot, i1, i2, j1, j2, added)
        report.differences.append(
            Difference(
                episode_span=(i1, i2),
                oneshot_span=(j1, j2),
                episode_text=bridge._decode(episode[i1:i2]),
                oneshot_text=bridge._decode(oneshot[j1:j2]),
                where=_piece_of(pieces, i1, i2),
                sampled=_sampled(mask, len(prompt), i1, i2),
            )
        )
    return report


def _slide_to_added_token(a, b, i1, i2, j1, j2, added):
    # A span only one side has can often sit a few tokens earlier or later with the same result
    # ("\n<think>...</think>" or "<think>...</think>\n"); prefer the position where it starts at
    # an added token, which is where the template or the model wrote it.
    if (i1 == i2) == (j1 == j2):
        return i1, i2, j1, j2
    seq, lo, hi = (a, i1, i2) if j1 == j2 else (b, j1, j2)
    positions = [lo]
    s, e = lo, hi
    while s > 0 and seq[s - 1] == seq[e - 1]:
        s, e = s - 1, e - 1
        positions.append(s)
    s, e = lo, hi
    while e < len(seq) and seq[s] == seq[e]:
        s, e = s + 1, e + 1
        positions.append(s)
    best = next((p for p in sorted(positions) if seq[p] in added), lo)
    shift = best - lo
    return i1 + shift, i2 + shift, j1 + shift, j2 + shift


def _piece_of(pieces, i1: int, i2: int) -> str:
    names = [name for name, start, end in pieces if start < max(i2, i1 + 1) and i1 < end]
    return " + ".join(names) if names else "end of episode"


def _sampled(mask: list[int], prompt_len: int, i1: int, i2: int) -> bool | None:
    if i1 < prompt_len:
        return False if i2 <= prompt_len else None
    values = set(mask[i1 - prompt_len : max(i2, i1 + 1) - prompt_len])
    if values == {1}:
        return True
    if values == {0}:
        return False
    return None
