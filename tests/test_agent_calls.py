"""Tool-call parsing by format name (megatron_dapo/agent/calls.py)."""

from __future__ import annotations

import pytest

from megatron_dapo.agent.calls import (
    CallFormat,
    HermesFormat,
    ToolCall,
    get_call_format,
    outside_think,
    register_call_format,
)

hermes = get_call_format("hermes")


def test_hermes_is_registered_under_its_name():
    assert isinstance(hermes, HermesFormat)
    assert isinstance(hermes, CallFormat)


def test_one_call_as_qwen_writes_it():
    text = (
        "I will compute it.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "347*28"}}\n'
        "</tool_call><|im_end|>"
    )
    assert hermes.parse(text) == [ToolCall("calculator", {"expression": "347*28"})]


def test_several_calls_in_order_whatever_the_whitespace():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and then '
        '<tool_call>\n\n   {"name": "b",\n "arguments": {"y": [1, 2]}}  \n\t</tool_call>\n'
        '<tool_call>{"name": "c"}</tool_call>'
    )
    assert hermes.parse(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [1, 2]}), ToolCall("c", {})]


def test_arguments_given_as_a_json_string_are_decoded_once():
    text = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    assert hermes.parse(text) == [ToolCall("python", {"code": "print(1)"})]


@pytest.mark.parametrize(
    ("body", "name", "says"),
    [
        ('{"name": "calc", "arguments": {"expression": "1+1"}', "", "not valid JSON"),
        ("[1, 2]", "", "a JSON array, not an object"),
        ('{"arguments": {}}', "", 'no "name"'),
        ('{"name": 3, "arguments": {}}', "", 'no "name"'),
        ('{"name": "calc", "arguments": [1]}', "calc", '"arguments" is a JSON array'),
        ('{"name": "calc", "arguments": "not json"}', "calc", "string that is not valid JSON"),
        ('{"name": "calc", "arguments": "[1]"}', "calc", '"arguments" is a JSON array'),
    ],
)
def test_a_malformed_call_is_kept_with_its_error(body, name, says):
    calls = hermes.parse(f"text <tool_call>{body}</tool_call> more text")
    assert len(calls) == 1
    assert calls[0].name == name and calls[0].arguments == {}
    assert says in calls[0].error and "\n" not in calls[0].error


def test_unclosed_tag_is_an_error_call_and_does_not_swallow_the_next_call():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}\n'
        '<tool_call>{"name": "b", "arguments": {"k": 1}}</tool_call>\n'
        '<tool_call>{"name": "c", "arguments": {}'
    )
    a, b, c = hermes.parse(text)
    assert (a.name, b, c.name) == ("a", ToolCall("b", {"k": 1}), "")
    assert "without </tool_call>" in a.error and "without </tool_call>" in c.error


def test_no_call():
    assert hermes.parse("The answer is \\boxed{42}.") == []
    assert hermes.parse("") == []
    assert hermes.parse("a stray </tool_call> closes nothing") == []


def test_registering_a_custom_format():
    class Bracket:
        name = "test-bracket"

        def parse(self, text: str) -> list[ToolCall]:
            return [ToolCall(text[1 : text.index("]")], {})] if text.startswith("[") else []

    fmt = Bracket()
    register_call_format(fmt)
    register_call_format(fmt)  # the same object again: a module imported twice
    assert get_call_format("test-bracket").parse("[calc] go") == [ToolCall("calc", {})]
    with pytest.raises(ValueError, match="already registered"):
        register_call_format(Bracket())
    with pytest.raises(ValueError, match="already registered"):
        register_call_format(HermesFormat())


def test_a_format_without_a_name_or_parse_is_refused():
    class NoParse:
        name = "test-noparse"

    with pytest.raises(ValueError, match="parse"):
        register_call_format(NoParse())
    with pytest.raises(ValueError, match="name"):
        register_call_format(object())


def test_unknown_format_lists_the_registered_names():
    with pytest.raises(ValueError, match=r"unknown tool-call format 'qwen_xml'.*registered: .*hermes"):
        get_call_format("qwen_xml")


# -- as Qwen2.5 and Qwen3 write calls -----------------------------------------------------------------
# Turns in the shape these models produce with their own chat templates (hermes tags on their own
# lines, two calls of one turn one after the other; Qwen3 reasoning first).

QWEN25_TWO_CALLS = (
    "<tool_call>\n"
    '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n'
    "</tool_call><|im_end|>"
)

# ReTool-style code whose string holds the closing tag (a model writing a parser of its own calls)
QWEN25_CODE_WITH_THE_TAG = (
    "Let me check the length.\n<tool_call>\n"
    '{"name": "code_interpreter", "arguments": {"code": "s = \'<tool_call>x</tool_call>\'\\nprint(len(s))"}}\n'
    "</tool_call><|im_end|>"
)

QWEN3_THINKING = (
    "<think>\nThe user wants the weather in Paris. I could write\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
    "but Rome is wrong; Paris it is.\n</think>\n\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call><|im_end|>"
)


def test_two_calls_of_a_qwen25_turn():
    assert hermes.parse(QWEN25_TWO_CALLS) == [
        ToolCall("get_current_temperature", {"location": "San Francisco, CA, USA"}),
        ToolCall("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
    ]


def test_a_closing_tag_inside_a_json_string_does_not_end_the_call():
    assert hermes.parse(QWEN25_CODE_WITH_THE_TAG) == [
        ToolCall("code_interpreter", {"code": "s = '<tool_call>x</tool_call>'\nprint(len(s))"})
    ]
    # and the call after it is still found
    (first, second) = hermes.parse(QWEN25_CODE_WITH_THE_TAG + QWEN25_TWO_CALLS)[:2]
    assert first.name == "code_interpreter" and second.name == "get_current_temperature"


@pytest.mark.parametrize("arguments", ['"arguments": null', '"arguments":null', ""])
def test_null_or_missing_arguments_are_an_empty_object(arguments):
    body = '{"name": "get_time"' + (", " + arguments if arguments else "") + "}"
    assert hermes.parse(f"<tool_call>\n{body}\n</tool_call>") == [ToolCall("get_time", {})]


def test_a_call_written_while_thinking_is_not_a_call():
    assert hermes.parse(outside_think(QWEN3_THINKING)) == [ToolCall("get_weather", {"city": "Paris"})]
    assert [c.arguments["city"] for c in hermes.parse(QWEN3_THINKING)] == ["Rome", "Paris"]
    # the think block opened by the generation prompt (Qwen3 thinking templates): only "</think>"
    opened = QWEN3_THINKING.removeprefix("<think>")
    assert hermes.parse(outside_think(opened)) == [ToolCall("get_weather", {"city": "Paris"})]
    # a turn cut while thinking holds no call
    assert hermes.parse(outside_think(QWEN3_THINKING[:90])) == []
    assert outside_think("no reasoning here") == "no reasoning here"


def test_malformed_json_of_a_qwen_turn_is_an_error_call_and_the_good_one_stands():
    text = QWEN25_TWO_CALLS.replace('"date": "2024-10-01"}}', '"date": 2024-10-01}}')
    good, bad = hermes.parse(text)
    assert good == ToolCall("get_current_temperature", {"location": "San Francisco, CA, USA"})
    assert bad.error is not None and "not valid JSON" in bad.error
