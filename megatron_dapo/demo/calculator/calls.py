"""The calculator demo's compact tool-call format, ``demo_calc``, registered beside ``hermes``.

A call is ``[EXPRESSION]``, a call of the ``calculator`` tool with ``expression=EXPRESSION``
(``[347 * 48]``: ten tokens of the character tokenizer, where hermes' JSON would take sixty), or
``[NAME:{JSON}]``, a call of any tool with JSON arguments. It is what
``demo.tokenizer.CALCULATOR_CHAT_TEMPLATE`` writes for an assistant message's ``tool_calls``, so
the warm start's episodes (rendered by the template) and the parser agree.

Importing this module registers the format; a run names it as
``rollout.multi_turn.format: megatron_dapo.demo.calculator.calls:demo_calc``, which imports the
module where the episodes run (``agent.from_config``).
"""

from __future__ import annotations

import json
import re

from megatron_dapo.agent.calls import ToolCall, register_call_format

NAME = "demo_calc"
FORMAT = f"{__name__}:{NAME}"
CALCULATOR = "calculator"
_NAMED = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*):(?=\{)")


class CompactCalls:
    """The calls in a model turn's text, in order; a malformed one is a call with ``error`` set,
    so the model is told what was wrong (the episode goes on with the error as the tool's answer)."""

    name = NAME

    def parse(self, text: str) -> list[ToolCall]:
        calls, at = [], text.find("[")
        while at >= 0:
            call, end = _one(text, at + 1)
            calls.append(call)
            if end < 0:
                break
            at = text.find("[", end)
        return calls


def _one(text: str, start: int) -> tuple[ToolCall, int]:
    """The call whose body starts at ``start`` (after its ``[``) and where the text goes on after
    its ``]`` (-1: the call is not closed)."""
    named = _NAMED.match(text, start)
    if named:
        try:
            args, end = json.JSONDecoder().raw_decode(text, named.end())
        except json.JSONDecodeError as e:
            return ToolCall(
                named.group(1), {}, f"the arguments of [{named.group(1)}:...] are not JSON ({e})"
            ), -1
        if not isinstance(args, dict) or not text.startswith("]", end):
            return ToolCall(
                named.group(1), {}, "a call is [NAME:{JSON object}] with ']' right after the object"
            ), -1
        return ToolCall(named.group(1), args), end + 1
    end = text.find("]", start)
    if end < 0:
        return ToolCall(CALCULATOR, {}, "a call opened with '[' is not closed with ']'"), -1
    return ToolCall(CALCULATOR, {"expression": text[start:end]}), end + 1


FORMAT_PARSER = CompactCalls()
register_call_format(FORMAT_PARSER)
