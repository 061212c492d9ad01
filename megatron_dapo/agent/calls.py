"""Tool-call parsers by format name (``rollout.multi_turn.format``).

A format turns one model turn's decoded text into the tool calls it makes. A call the model got
wrong is not dropped: it comes back as a :class:`ToolCall` with ``error`` set, so that the episode
runner can show the model what was wrong (as that call's tool answer) instead of nothing, and the
model learns to write calls that parse.

Built in: ``hermes``, the format Qwen2.5 and Qwen3 are trained on::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "347*28"}}
    </tool_call>

The registry (``register_call_format`` / ``get_call_format``) is the module's one piece of mutable
global state: a process-wide table of names, filled at import (``hermes``) and by user code that
registers its own format before the run starts. It is never cleared; registering a name twice
with different objects is refused, so that two plugins cannot silently replace each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "CallFormat",
    "HermesFormat",
    "ToolCall",
    "get_call_format",
    "outside_think",
    "register_call_format",
]


@dataclass
class ToolCall:
    """One tool call of a model turn.

    ``error``: set for a malformed call, one line saying what is wrong; the model is shown it as
    the call's answer. ``name`` is ``""`` when the call's name could not be read.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@runtime_checkable
class CallFormat(Protocol):
    """A tool-call syntax: ``parse`` returns the calls in one turn's text, in order ([] for none)."""

    name: str

    def parse(self, text: str) -> list[ToolCall]: ...


# How much of a malformed call the error quotes: enough to recognise it, short enough for one line.
_QUOTE_CHARS = 80


class HermesFormat:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn.

    Whitespace around the JSON may vary; text outside the tags is ignored. The JSON object is read
    first, so a ``</tool_call>`` inside one of its strings (code that prints the tag) does not end
    the call. ``arguments`` missing or ``null`` is a call without arguments (``{}``), and a JSON
    string holding an object is decoded once (some models double-encode it). Malformed JSON, a
    missing or non-string name, arguments that are not an object, and a ``<tool_call>`` without
    its ``</tool_call>`` give calls with ``error`` set. Calls written inside ``<think>`` are the
    runner's to drop (``outside_think``), not the format's.
    """

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> list[ToolCall]:
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                return calls
            body_start = start + len(self.open_tag)
            end = self._object_end(text, body_start)
            if end < 0:  # not a whole object then the tag: the first close tag ends the body
                end = text.find(self.close_tag, body_start)
                reopened = text.find(self.open_tag, body_start)
                # a second <tool_call> before this one's close means this one was never closed
                if end < 0 or 0 <= reopened < end:
                    body = text[body_start : reopened if reopened >= 0 else len(text)]
                    calls.append(self._unclosed(body))
                    if reopened < 0:
                        return calls
                    pos = reopened
                    continue
            calls.append(self._call(text[body_start:end]))
            pos = end + len(self.close_tag)

    def _object_end(self, text: str, at: int) -> int:
        """Where ``</tool_call>`` starts when a JSON object and only whitespace come before it
        from ``at``; -1 otherwise (the caller falls back to the first ``</tool_call>``)."""
        i = _skip_space(text, at)
        if not text.startswith("{", i):
            return -1
        try:
            _, j = _DECODER.raw_decode(text, i)
        except ValueError:
            return -1
        j = _skip_space(text, j)
        return j if text.startswith(self.close_tag, j) else -1

    def _unclosed(self, body: str) -> ToolCall:
        name = ""
        try:  # the name still helps the model see which call it broke
            obj = json.loads(body.strip())
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                name = obj["name"]
        except ValueError:
            pass
        return ToolCall(
            name,
            {},
            f"{self.open_tag} without {self.close_tag}: close each call with {self.close_tag}",
        )

    def _call(self, body: str) -> ToolCall:
        body = body.strip()
        expected = '{"name": <tool name>, "arguments": {...}}'
        try:
            obj = json.loads(body)
        except ValueError as e:
            return ToolCall("", {}, f"tool call is not valid JSON ({e}): {_quote(body)}; expected {expected}")
        if not isinstance(obj, dict):
            return ToolCall(
                "", {}, f"tool call is a JSON {_json_type(obj)}, not an object; expected {expected}"
            )
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return ToolCall("", {}, f'tool call has no "name" string; expected {expected}')
        arguments = obj.get("arguments")
        if arguments is None:  # missing or null: a call without arguments
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                return ToolCall(
                    name, {}, f'"arguments" is a string that is not valid JSON ({e}); give an object'
                )
        if not isinstance(arguments, dict):
            return ToolCall(name, {}, f'"arguments" is a JSON {_json_type(arguments)}, not an object')
        return ToolCall(name, arguments)


_DECODER = json.JSONDecoder()
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def outside_think(text: str) -> str:
    """``text`` without its reasoning: every ``<think>...</think>`` span, the text before a
    ``</think>`` that no ``<think>`` opened (the generation prompt opened it, as Qwen3 thinking
    templates do), and an unclosed ``<think>``'s rest (a turn cut while thinking). What a model
    writes while thinking about a call is not the call (``rollout.multi_turn.calls_in_think``)."""
    first_close = text.find(THINK_CLOSE)
    first_open = text.find(THINK_OPEN)
    if first_close >= 0 and (first_open < 0 or first_close < first_open):
        text = text[first_close + len(THINK_CLOSE) :]
    out, pos = [], 0
    while True:
        start = text.find(THINK_OPEN, pos)
        if start < 0:
            out.append(text[pos:])
            return "".join(out)
        out.append(text[pos:start])
        end = text.find(THINK_CLOSE, start + len(THINK_OPEN))
        if end < 0:
            return "".join(out)
        pos = end + len(THINK_CLOSE)


def _quote(text: str) -> str:
    one_line = " ".join(text.split())
    return repr(one_line if len(one_line) <= _QUOTE_CHARS else one_line[:_QUOTE_CHARS] + "...")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}.get(
        type(value), type(value).__name__
    )


_FORMATS: dict[str, CallFormat] = {}


def register_call_format(fmt: CallFormat) -> None:
    """Make ``fmt`` available as ``rollout.multi_turn.format: <fmt.name>``.

    Registering the same object again is a no-op (a module imported twice); another object under
    a taken name is a ValueError."""
    name = getattr(fmt, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"a call format needs a non-empty string attribute 'name'; got {name!r}")
    if not callable(getattr(fmt, "parse", None)):
        raise ValueError(f"call format {name!r} has no parse(text) -> list[ToolCall] method")
    existing = _FORMATS.get(name)
    if existing is not None and existing is not fmt:
        raise ValueError(
            f"call format {name!r} is already registered ({existing!r}); pick another name for {fmt!r}"
        )
    _FORMATS[name] = fmt


def get_call_format(name: str) -> CallFormat:
    """The registered format called ``name``; ValueError listing the registered names."""
    try:
        return _FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown tool-call format {name!r} (rollout.multi_turn.format); registered: "
            f"{', '.join(sorted(_FORMATS))}. Register another with "
            "megatron_dapo.agent.calls.register_call_format"
        ) from None


register_call_format(HermesFormat())
