"""A reasoning model's thinking split from its answer (router/reasoning.py): each parser's
outputs, whole and streamed cut anywhere, and chat_template_kwargs reaching the chat template
(Qwen3's enable_thinking). Over HTTP, with tool calls: test_http."""

import pytest

from common.chat import ChatTemplate, check_template_kwargs
from common.errors import InvalidArgument
from common.tokenizer import ByteTokenizer
from router.reasoning import PARSERS, thinking_end

CASES = {  # parser: [(output, reasoning, content)]
    "qwen3": [
        ("<think>\nI think.\n\nMore.\n</think>\n\nThe answer.\n", "I think.\n\nMore.", "The answer.\n"),
        ("\n\nNo thinking here.", None, "\n\nNo thinking here."),  # an answer alone, as written
        ("<think>\nCut off", "Cut off", None),
        ("<think></think>\n\nA", None, "A"),
        ("<thin", None, "<thin"),
        ("Use <think> tags.", None, "Use <think> tags."),
        ("", None, None),
    ],
    "deepseek_r1": [
        ("Reason.\n</think>\n\nAnswer", "Reason.", "Answer"),
        ("<think>\nR\n</think>A", "R", "A"),
        ("Still thinking\n", "Still thinking", None),
        ("</think>Answer", None, "Answer"),
    ],
}


@pytest.mark.parametrize("parser", list(CASES))
def test_an_output_is_split_into_reasoning_and_content(parser):
    for text, reasoning, content in CASES[parser]:
        assert PARSERS[parser].split(text) == (reasoning, content), text


@pytest.mark.parametrize("parser", list(CASES))
def test_a_stream_cut_anywhere_shows_what_the_whole_output_shows(parser):
    for text, reasoning, content in CASES[parser]:
        for cuts in [[i] for i in range(len(text) + 1)] + [list(range(len(text) + 1))]:
            stream, bounds = PARSERS[parser].stream(), [0, *cuts, len(text)]
            pieces = [stream.feed(text[a:b], False) for a, b in zip(bounds, bounds[1:])] + [stream.feed("", True)]
            assert "".join(r for r, _ in pieces) == (reasoning or ""), (text, cuts)
            assert "".join(c for _, c in pieces) == (content or ""), (text, cuts)


def test_reasoning_is_sent_as_it_comes_and_a_possible_end_tag_held_back():
    stream = PARSERS["qwen3"].stream()
    assert stream.feed("<thi", False) == ("", "")
    assert stream.feed("nk>\nStep one.\n", False) == ("Step one.", "")
    assert stream.feed("Step two. </th", False) == ("\nStep two. ", "")
    assert stream.feed("ink>\n\nDone", False) == ("", "Done")


def test_a_response_held_to_json_thinks_first():
    """response_format and forced tool calls think first, their JSON after it; a grammar of the
    request's own holds the output from its first token (it may spell out <think>)."""
    from router.openai_api import OutputParsers, parse_chat

    parsers, base = OutputParsers(reasoning="deepseek_r1"), {"messages": [{"role": "user", "content": "x"}]}
    tool = {"type": "function", "function": {"name": "f"}}
    job = parse_chat(base, "m", 64, parsers)
    assert job.reasoning is PARSERS["deepseek_r1"] and not job.think_first
    for free in ({"structured_outputs": {"regex": "a"}}, {"response_format": {"type": "text"}}):
        job = parse_chat({**base, **free}, "m", 64, parsers)
        assert job.reasoning is not None and not job.think_first, free
    for held in ({"response_format": {"type": "json_object"}}, {"tools": [tool], "tool_choice": "required"},
                 {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}):
        job = parse_chat({**base, **held}, "m", 64, parsers)
        assert job.reasoning is not None and job.think_first, held
        assert not parse_chat({**base, **held}, "m", 64).think_first  # no parser: nothing to think


def test_chat_template_kwargs_reach_the_template_by_name():
    template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>{% endif %}")
    tok = ByteTokenizer()
    tok.chat_template = template
    messages = [{"role": "user", "content": "Hi"}]
    assert bytes(tok.encode_chat(messages)) == b"Hi"
    off = tok.encode_chat(messages, template_kwargs=check_template_kwargs({"enable_thinking": False}))
    assert bytes(off) == b"Hi<think>\n\n</think>"
    for bad, message in [([1], "allowed: an object"), ({"tools": []}, "sets ['tools']"),
                         ({"bos_token": "x"}, "sets ['bos_token']"), ({"x": {1, 2}}, "chat_template_kwargs")]:
        with pytest.raises(InvalidArgument, match=message.replace("[", r"\[")):
            check_template_kwargs(bad)


def test_json_begins_where_the_thinking_ends_unless_the_prompt_closed_it():
    """thinking_end: the run a response_format's JSON begins after, or None (from the first token)."""
    tok, end = ByteTokenizer(), list(b"</think>")
    for prompt, want in ((b"<|assistant|>\n", end), (b"<think>\n", end), (b"<think>a</think>\n<think>", end),
                         (b"<think>\n\n</think>\n\n", None), (b"</thi", end),
                         # an earlier turn's thinking, closed long before this turn's answer (a tool loop)
                         (b"<think>a</think>\n\ncall<|tool|>\nsunny\n<|assistant|>\n", end)):
        assert thinking_end(tok, list(prompt)) == want, prompt

    class Spelled(ByteTokenizer):  # a tag of more tokens than a request may carry
        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text * 3]

    class Pieces(ByteTokenizer):  # a tag of several tokens, which other text may spell otherwise
        one_spelling = False
    assert thinking_end(Spelled(), []) is None and thinking_end(Pieces(), []) is None
