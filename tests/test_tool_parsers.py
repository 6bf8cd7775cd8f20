"""Tool calls found in free text (router/tool_parsers.py), for tool_choice "auto": each parser
finds its family's calls and the content before them, leaves text that does not parse as content,
and streams, cut anywhere, what it shows whole. Over HTTP: test_http."""

import json

import pytest

from router.tool_calls import parse
from router.tool_parsers import PARSERS

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TOOLS = [WEATHER] + [{"type": "function", "function": {"name": name}} for name in ("a", "b", "f")]

CASES = {  # parser: [(text, content, [(name, arguments)])]
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
         [("get_weather", {"city": "Paris"})]),
        ('Let me look. <tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
         '{"n": [1, 2]}}</tool_call>', "Let me look. ", [("a", {}), ("b", {"n": [1, 2]})]),
        ('<tool_call>{"name": "a", "arguments": {"x": "é"}}', None, [("a", {"x": "é"})]),  # its end cut off
        ("No calls <tool here, < or <tool_cal.", "No calls <tool here, < or <tool_cal.", []),
        ('<tool_call>{"name": "a", "argu', '<tool_call>{"name": "a", "argu', []),  # cut by max_tokens: text
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
        ("<tool_call>", "<tool_call>", []),
        ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("a", {"x": 1})]),  # as a string
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
         '<tool_call>{"name": "a", "arguments": [1]}</tool_call>', []),
        ('<tool_call>{"name": "a"}</tool_call>', '<tool_call>{"name": "a"}</tool_call>', []),  # no arguments
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
        ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": 1}}', None,
         [("a", {}), ("b", {"k": 1})]),
        ('  \n{"name": "a", "parameters": {}}', None, [("a", {})]),
        ("The weather is fine.", "The weather is fine.", []),
        ('{"name": "a", "parameters": {"x": 1', '{"name": "a", "parameters": {"x": 1', []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call
        ("<|python", "<|python", []),
        ('{"name": "a", "parameters": null}', None, [("a", {})]),
        ('{"name": "Bob", "age": 30}', '{"name": "Bob", "age": 30}', []),  # a JSON answer, not a call
    ],
}


def auto(parser, parallel=True):
    return parse({"tools": TOOLS, "tool_choice": "auto"}, parallel, parser)


def shown(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser", list(CASES))
def test_a_whole_output_is_split_into_content_and_calls(parser):
    for text, content, calls in CASES[parser]:
        got_content, got_calls = PARSERS[parser].parse(text)
        assert (got_content, shown(got_calls)) == (content, calls), text
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)


@pytest.mark.parametrize("parser", list(CASES))
def test_a_stream_cut_anywhere_shows_what_the_whole_output_shows(parser):
    for text, content, calls in CASES[parser]:
        for cuts in [[i] for i in range(len(text) + 1)] + [list(range(len(text) + 1))]:  # one cut, or every character
            stream, bounds = auto(parser).stream(), [0, *cuts, len(text)]
            deltas = [stream.delta(text[a:b], False) for a, b in zip(bounds, bounds[1:])]
            deltas.append(stream.delta("", True))  # a stream's last chunk: the output is whole
            streamed = "".join(d.get("content", "") for d in deltas)
            assert streamed == (content or "") if calls else streamed == text, (text, cuts)
            got = [c for d in deltas for c in d.get("tool_calls", [])]
            assert shown(got) == calls and [c["index"] for c in got] == list(range(len(calls)))


def test_content_is_sent_as_it_comes_and_a_possible_call_is_held_back():
    stream = auto("hermes").stream()
    assert stream.delta("Sure, <", False) == {"content": "Sure, "}
    assert stream.delta("b> ok <tool", False) == {"content": "<b> ok "}
    assert stream.delta('_call>{"name": "f", "arguments": {}}', False) == {}
    last = stream.delta("</tool_call>", True)
    assert list(last) == ["tool_calls"] and shown(last["tool_calls"]) == [("f", {})]


def test_auto_needs_a_parser_and_keeps_one_call_without_parallel_calls():
    body = {"tools": TOOLS, "tool_choice": "auto"}
    tools = parse(body, parallel=False, parser="hermes")
    assert tools.choice == "auto" and not tools.calls and tools.structured_outputs() is None
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c["function"]["name"] for c in tools.message(text)["tool_calls"]] == ["a"]
    assert [c["function"]["name"] for c in auto("hermes", parallel=False).stream().delta(text, True)["tool_calls"]] \
        == ["a"]  # streamed alike
    assert tools.message("plain") == {"role": "assistant", "content": "plain"}
    unoffered = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}'
    assert parse({"tools": TOOLS[:2], "tool_choice": "auto"}, parser="hermes").message(unoffered) == {
        "role": "assistant", "content": unoffered}  # a call to a function not offered: text
    assert parse({"tools": [WEATHER]}, parser="llama3_json").choice == "auto"  # auto: the default with tools
