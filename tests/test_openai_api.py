"""Without a cluster: OpenAI request bodies checked field by field (router/openai_api.py), the n
choices' seeds, and the router's incremental text with stop strings (common/text.py) against a
byte tokenizer and a real BPE tokenizer.json whose tokens span several characters."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.chat import TemplateArgs
from common.errors import InvalidArgument
from common.sampling_params import SamplingParams, choice_seed
from common.tokenizer import ByteTokenizer, HFTokenizer
from router.openai_api import CHAT_FIELDS, COMPLETION_FIELDS, ApiError, parse_chat, parse_completion
from router.openai_responses import token_text
from common.text import TextStream
from tests.checkpoints import VOCAB, write_tokenizer

MODEL = "dummy:nanogpt"


def test_completion_body_becomes_a_job():
    job = parse_completion({"model": MODEL, "prompt": ["a", [1, 2]], "max_tokens": 5, "temperature": 0.5, "top_k": 3,
                            "seed": 9, "n": 2, "stop": "xy", "logprobs": 2, "echo": True, "user": "u",
                            "presence_penalty": 0, "logit_bias": {}, "best_of": 2, "stream": True,
                            "stream_options": {"include_usage": True}}, MODEL)
    assert job.prompts == ["a", [1, 2]] and job.n == 2 and job.stream and job.include_usage and job.echo
    p = job.params
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop, p.logprobs, p.prompt_logprobs) == (5, 0.5, 3, 9, ["xy"], 2, 2)
    assert [job.choice_params(i).seed for i in range(4)] == [9, 10, 9, 10]  # prompt-major: seed + choice index
    assert choice_seed(2**63 - 1, 1) == 0  # wraps within the allowed range
    assert parse_completion({"prompt": "x"}, MODEL).params.max_tokens == 16  # OpenAI's default
    unseeded = parse_completion({"prompt": "x", "n": 3}, MODEL)
    assert {unseeded.choice_params(i).seed for i in range(3)} == {None}  # each draws its own at admission


def test_openais_other_fields_are_taken_where_they_ask_nothing_of_the_output():
    """Fields OpenAI documents that change nothing here: null (or a cache key, an identifier), and a
    negative seed (its low 63 bits)."""
    quiet = {"reasoning_effort": None, "verbosity": None, "prediction": None, "audio": None,
             "web_search_options": None, "prompt_cache_key": "k", "safety_identifier": "u1", "seed": -1}
    job = parse_completion({"prompt": "x", **quiet}, MODEL)
    assert job.params.seed == 2**63 - 1
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True,
                       "stream_options": {"include_usage": True, "include_obfuscation": True}, **quiet}, MODEL, 1024)
    assert chat.include_usage and chat.params.seed == 2**63 - 1
    # the rest of vLLM's request, as a client that fills all of it in sends it: at its defaults
    vllms = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "truncate_prompt_tokens": None,
             "prompt_logprobs": None, "allowed_token_ids": None, "bad_words": [], "include_reasoning": True,
             "cache_salt": None, "return_token_ids": False, "kv_transfer_params": None, "vllm_xargs": None,
             "logits_processors": None, "mm_processor_kwargs": None, "thinking_token_budget": None, "request_id": "r-1"}
    assert parse_completion({"prompt": "x", **vllms}, MODEL).params.max_tokens == 16
    parse_chat({"messages": [{"role": "user", "content": "x"}], **vllms}, MODEL, 1024)
    for body, param in (({"reasoning_effort": "high"}, "reasoning_effort"), ({"prompt_cache_key": 5}, "prompt_cache_key"),
                        ({"use_beam_search": True}, "use_beam_search"), ({"bad_words": ["no"]}, "bad_words"),
                        ({"prompt_logprobs": 1}, "prompt_logprobs"), ({"priority": 1}, "priority"),
                        ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options")):
        with pytest.raises(InvalidArgument) as e:
            parse_chat({"messages": [{"role": "user", "content": "x"}], **body}, MODEL, 1024)
        assert e.value.param == param, str(e.value)


def test_a_chats_documents_reach_its_template_as_vllm_passes_them():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    docs = [{"title": "Paris", "text": "The capital of France."}]
    job = parse_chat({**chat, "documents": docs, "chat_template_kwargs": {"enable_thinking": False}}, MODEL, 1024)
    assert job.template.kwargs == {"enable_thinking": False, "documents": docs}
    assert parse_chat(chat, MODEL, 1024).template.kwargs is None
    for bad in ([{"title": 1}], {"text": "x"}, ["x"]):
        with pytest.raises(InvalidArgument, match="documents=.* is invalid; allowed: a list of objects of strings"):
            parse_chat({**chat, "documents": bad}, MODEL, 1024)


def test_vllms_add_special_tokens_and_continuous_usage_stats_are_taken_either_way():
    """add_special_tokens: None is each endpoint's own (a text gets them, a chat's template writes
    them), either value is the caller's; continuous usage only with include_usage, as vLLM."""
    from router.openai_api import Tokenize, parse_tokenize

    chat = [{"role": "user", "content": "x"}]
    assert parse_completion({"prompt": "x"}, MODEL).add_special_tokens is None
    for value in (True, False):
        assert parse_completion({"prompt": "x", "add_special_tokens": value}, MODEL).add_special_tokens is value
        assert parse_chat({"messages": chat, "add_special_tokens": value}, MODEL, 1024).add_special_tokens is value
        assert parse_tokenize({"prompt": "x", "add_special_tokens": value}, MODEL) == Tokenize("x", None,
                                                                                           TemplateArgs(), value)
    assert parse_tokenize({"messages": chat, "add_generation_prompt": False, "return_token_strs": True}, MODEL) == (
        Tokenize(None, chat, TemplateArgs(add_generation_prompt=False), return_token_strs=True))
    for body, param in (({"messages": chat, "add_generation_prompt": "no"}, "add_generation_prompt"),
                        ({"messages": chat, "continue_final_message": 1}, "continue_final_message"),
                        ({"messages": chat, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                        ({"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
                        ({"prompt": "x", "return_token_strs": 1}, "return_token_strs")):
        with pytest.raises(InvalidArgument) as e:
            parse_tokenize(body, MODEL)
        assert e.value.param == param
    with pytest.raises(InvalidArgument, match="add_special_tokens='yes' is invalid; allowed: true or false"):
        parse_chat({"messages": chat, "add_special_tokens": "yes"}, MODEL, 1024)
    streamed = {"prompt": "x", "stream": True}
    both = parse_completion({**streamed, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                            MODEL)
    assert both.include_usage and both.continuous_usage
    alone = parse_completion({**streamed, "stream_options": {"continuous_usage_stats": True}}, MODEL)
    assert alone.include_usage and alone.continuous_usage  # include_usage is true by default, as vLLM's
    assert parse_completion({**streamed, "stream_options": {}}, MODEL).include_usage
    off = parse_completion({**streamed, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
                           MODEL)
    assert not off.include_usage and not off.continuous_usage
    assert not parse_completion(streamed, MODEL).include_usage  # no stream_options: none, as OpenAI's
    assert not parse_completion({"prompt": "x", "stream_options": {}}, MODEL).stream  # asks nothing: taken, as vLLM


def test_penalties_bias_and_min_p_reach_the_sampling():
    job = parse_completion({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
                            "min_p": 0.1, "min_tokens": 3, "logit_bias": {"7": -100, "12": 2.5}}, MODEL)
    p = job.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.min_tokens) == (0.5, -1, 1.2, 0.1, 3)
    assert p.logit_bias == {7: -100.0, 12: 2.5} and p.adjusts_logits
    assert SamplingParams.from_dict(p.to_dict()) == p  # the wire's form: [token, bias] pairs
    assert not parse_completion({"prompt": "x", "presence_penalty": 0, "logit_bias": {}}, MODEL).params.adjusts_logits


def test_chat_body_becomes_a_job():
    messages = [{"role": "user", "content": "hi"}]
    job = parse_chat({"messages": messages, "max_tokens": 3, "max_completion_tokens": 7, "logprobs": True,
                      "top_logprobs": 4, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}},
                     MODEL, context=1024)
    assert job.chat and job.messages == messages and job.params.max_tokens == 7 and job.logprobs == 4
    assert parse_chat({"messages": messages}, MODEL, context=1024).params.max_tokens == 1024  # to the context's end
    assert parse_chat({"messages": messages, "logprobs": True}, MODEL, 1024).params.logprobs == 0
    for off in ({"top_logprobs": 0}, {"logprobs": False, "top_logprobs": 0}):  # some clients' defaults, as vLLM
        assert parse_chat({"messages": messages} | off, MODEL, 1024).params.logprobs is None


TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}


def test_tool_choices_hold_the_output_to_calls():
    messages = [{"role": "user", "content": "hi"}]
    g = {"type": "function", "function": {"name": "g"}}  # no parameters: an empty object
    named = parse_chat({"messages": messages, "tools": [TOOL, g], "tool_choice": {"type": "function", "function":
                                                                                    {"name": "f"}}}, MODEL, 64)
    assert named.params.structured_outputs == {"json": TOOL["function"]["parameters"]}
    assert named.tools.tool_calls('{"x": 3}')[0]["function"] == {"name": "f", "arguments": '{"x": 3}'}
    required = parse_chat({"messages": messages, "tools": [TOOL, g], "tool_choice": "required",
                           "parallel_tool_calls": False}, MODEL, 64)
    schema = required.params.structured_outputs["json"]
    assert schema["maxItems"] == 1 and [s["properties"]["name"] for s in schema["items"]["anyOf"]] == [
        {"const": "f"}, {"const": "g"}]
    calls = required.tools.tool_calls('[{"name": "g", "parameters": {}}]')
    assert [c["function"] for c in calls] == [{"name": "g", "arguments": "{}"}] and calls[0]["id"].startswith("call_")
    assert required.tools.tool_calls('[{"name": "g", "param') is None  # cut by max_tokens: shown as text
    none = parse_chat({"messages": messages, "tools": [TOOL], "tool_choice": "none"}, MODEL, 64)
    assert none.tools.tools == [TOOL] and not none.tools.calls and none.params.structured_outputs is None
    assert parse_chat({"messages": messages, "tools": [], "tool_choice": "auto"}, MODEL, 64).tools is None


def test_response_formats_become_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "hi"}]
    assert parse_chat({"messages": messages, "response_format": fmt}, MODEL, 64).params.structured_outputs == {"json": schema}
    job = parse_completion({"prompt": "x", "response_format": {"type": "json_object"}}, MODEL)
    assert job.params.structured_outputs == {"json_object": True} and job.params.adjusts_logits
    assert parse_completion({"prompt": "x", "response_format": {"type": "text"}}, MODEL).params.structured_outputs is None
    job = parse_completion({"prompt": "x", "structured_outputs": {"json": '{"type": "string"}'}}, MODEL)
    assert job.params.structured_outputs == {"json": {"type": "string"}}  # a schema's text, parsed
    assert SamplingParams.from_dict(job.params.to_dict()) == job.params  # as the wire carries it


def test_integer_fields_take_floats_that_are_integers_as_vllm_does():
    job = parse_completion({"prompt": "x", "max_tokens": 10.0, "n": 2.0, "best_of": 2.0, "seed": 3.0, "logprobs": 1.0,
                            "top_k": 5.0, "min_tokens": 1.0}, MODEL)
    assert (job.params.max_tokens, job.n, job.params.seed, job.logprobs, job.params.top_k, job.params.min_tokens) == \
        (10, 2, 3, 1, 5, 1)
    assert all(type(v) is int for v in (job.params.max_tokens, job.n, job.params.seed, job.logprobs))
    assert parse_completion({"prompt": "x", "echo": True, "max_tokens": 0.0}, MODEL).echo_only
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 7.0, "logprobs": True,
                       "top_logprobs": 2.0}, MODEL, 64)
    assert (chat.params.max_tokens, chat.logprobs) == (7, 2)


@pytest.mark.parametrize("body, param, text", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", "max_tokens=-1 is invalid; allowed: an integer in [1, 2**31 - 1]"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "max_tokens=True"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature", "allowed: a finite number >= 0"),
    ({"prompt": "x", "n": 0}, "n", "allowed: an integer >= 1"),
    ({"prompt": "x", "stop": [""]}, "stop", "a non-empty string"),
    ({"prompt": "x", "stop": ["a"] * 17}, "stop", "at most 16"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "[0, 20]"),
    ({"prompt": "x", "echo": "yes"}, "echo", "true or false"),
    ({"prompt": "x", "stream": 1}, "stream", "true or false"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options", "include_usage"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options={'include_usage': True} with stream=false; allowed: stream_options only with stream=true"),
    ({"prompt": "x", "seed": 2**63}, "seed", "an integer in [-2**63, 2**63 - 1]"),
    ({"prompt": "x", "user": 5}, "user", "a string"),
    ({"prompt": "x", "best_of": 3}, "best_of", "no best-of"),
    ({"prompt": "x", "best_of": True}, "best_of", "no best-of"),  # True == 1, as n=True is refused
    ({"prompt": "x", "n": 2, "best_of": 2.5}, "best_of", "no best-of"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens", "max_tokens=2.5 is invalid; allowed: an integer"),
    ({"prompt": "x", "max_tokens": "2"}, "max_tokens", "max_tokens='2' is invalid; allowed: an integer"),
    ({"prompt": "x", "n": float("inf")}, "n", "n=inf is invalid; allowed: an integer >= 1"),
    ({"prompt": "x", "frequency_penalty": 3}, "frequency_penalty", "frequency_penalty=3 is invalid; allowed: a number in [-2, 2]"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "a number in (0, 10000]"),
    ({"prompt": "x", "min_p": -0.1}, "min_p", "a number in [0, 1]"),
    ({"prompt": "x", "min_tokens": 17}, "min_tokens", "an integer in [0, max_tokens=16]"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "logit_bias entry 'a': 1 is invalid"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "biases in [-100, 100]"),
    ({"prompt": "x", "logit_bias": [5]}, "logit_bias", "logit_bias=[5] is invalid"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format", "response_format={'type': 'xml'} is invalid"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format",
     '{"type": "json_schema", "json_schema": {"name": 1-64 letters, digits, _ or -, "schema": {...}}}'),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "bogus"}}}},
     "response_format", "response_format.json_schema.schema does not compile: Invalid type: bogus"),
    ({"prompt": "x", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "both given"),
    ({"prompt": "x", "structured_outputs": {"regex": "a("}}, "structured_outputs",
     "structured_outputs.regex does not compile"),
    ({"prompt": "x", "structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs", "2 kinds given"),
    ({"prompt": "x", "structured_outputs": {"guided_json": {}}}, "structured_outputs", "unknown key 'guided_json'"),
    ({"prompt": "x", "suffix": "end"}, "suffix", "not supported"),
    ({"prompt": "x", "nonsense": 1}, "nonsense", "unknown field 'nonsense'"),
    ({"prompt": []}, "prompt", "a string, a list of token ids"),
    ({"prompt": [1, "a"]}, "prompt", "a string, a list of token ids"),
    ({"prompt": None}, "prompt", "a string, a list of token ids"),
    ({"prompt": "x", "top_k": -2}, "top_k", "an integer in [0, 2**31 - 1]"),
    ({"prompt": "x", "max_tokens": 2**70}, "max_tokens", "[1, 2**31 - 1]"),
    ({"prompt": "x", "stop_token_ids": [2**64]}, "stop_token_ids", "token ids in [0, 2**31 - 1]"),
])
def test_bad_completion_fields_are_named(body, param, text):
    with pytest.raises(InvalidArgument) as e:
        parse_completion(body, MODEL)
    assert e.value.param == param and text in str(e.value), str(e.value)


@pytest.mark.parametrize("body, param, text", [
    ({"messages": "hi"}, "messages", "non-empty list"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "top_logprobs=2 with logprobs=false; allowed: top_logprobs only with logprobs=true (or top_logprobs=0)"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens=0"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools",
     "tools[0]={'type': 'function'} is invalid; allowed: {\"type\": \"function\", \"function\""),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL]}, "tool_choice",
     'tool_choice "auto" (the default with tools) lets the model choose between text and calls, which needs a '
     "parser for its call format: start the server with --tool-call-parser (hermes, llama3_json)"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "auto"}, "tool_choice",
     'allowed without one: "none", "required" or {"type": "function", "function": {"name": ...}}'),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL, TOOL], "tool_choice": "none"}, "tools",
     "unique among the tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
      "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice", "naming one of the tools (f)"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]}, "tools",
     "tools[0].function.parameters.type='bogus' is invalid; allowed: \"object\""),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "none", "tools": [TOOL, {"type": "function",
      "function": {"name": "g", "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}]},
     "tools", "tools[1].function.parameters does not compile: Invalid type: bogus"),  # under "none" too
    ({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "tools[0].function.parameters.type='string' is invalid; allowed: \"object\""),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}}, "response_format", '"json_schema": {"name": 1-64 letters'),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "and response_format both say what the output is"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "none",
      "parallel_tool_calls": 1}, "parallel_tool_calls", "true or false"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo", "echo=True is not supported; allowed: false (in chat)"),
])
def test_bad_chat_fields_are_named(body, param, text):
    with pytest.raises(InvalidArgument) as e:
        parse_chat(body, MODEL, 1024)
    assert e.value.param == param and text in str(e.value), str(e.value)


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                                      st.text(max_size=8)),
                            lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                    st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                            max_leaves=10)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.booleans(), st.dictionaries(st.sampled_from(sorted(CHAT_FIELDS | COMPLETION_FIELDS | {"x"})), json_values,
                                      max_size=8))
def test_any_json_body_is_a_job_or_a_named_refusal(chat, body):
    """Whatever a client sends, parsing ends in a Job or a coded refusal, never another exception."""
    try:
        job = parse_chat(body, MODEL, 1024) if chat else parse_completion(body, MODEL)
    except (InvalidArgument, ApiError):
        return
    assert job.n >= 1 and job.params.max_tokens >= 1 and job.prompts


def test_unknown_model_is_not_found():
    with pytest.raises(ApiError) as e:
        parse_completion({"model": "other", "prompt": "x"}, MODEL)
    assert (e.value.status, e.value.param) == (404, "model")
    assert e.value.body()["error"]["type"] == "not_found_error"
    assert ApiError("OVERLOADED", "m").status == 429 and ApiError("UNAVAILABLE", "m").status == 503


# ----------------------------------------------------------------------------- text


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return HFTokenizer.from_file(path / "tokenizer.json")


def test_special_tokens_show_their_text_in_logprobs_and_on_request(bpe):
    """As vLLM's: a special token's logprob entry is its text (two of them would otherwise share
    the key "" in top_logprobs), and decode keeps them when asked (/detokenize asks)."""
    from router.openai_responses import token_shown

    bos, eos = bpe.encode("x")[0], 1
    assert [token_shown(bpe, t, False) for t in (bos, eos)] == [("<s>", b"<s>"), ("</s>", b"</s>")]
    ids = bpe.encode("the quick")
    assert bpe.decode(ids + [eos], skip_special_tokens=False) == "<s>" + bpe.decode(ids) + "</s>"
    assert bpe.decode(ids + [eos]) == bpe.decode(ids)
    byte = ByteTokenizer()  # the dummy models' alike
    assert [token_shown(byte, t, False)[0] for t in (256, 257, 300)] == ["<s>", "</s>", ""]
    assert byte.decode([256, 104, 105, 257], skip_special_tokens=False) == "<s>hi</s>"
    assert byte.decode([256, 104, 105, 257]) == "hi"


@pytest.mark.parametrize("which", ["byte", "bpe"])
def test_logprobs_show_each_tokens_own_bytes_even_inside_a_character(which, bpe):
    """OpenAI's logprobs carry each token's bytes, so that a client can rebuild characters split
    between tokens; decoded alone, such a token is U+FFFD, and several of them collided as one
    top_logprobs key. Now each shows as OpenAI's "bytes:\\xNN" with its own bytes."""
    tok = ByteTokenizer() if which == "byte" else bpe
    text = "héllo wörld €"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()

    def whole(raw):
        try:
            return raw.decode("utf-8") is not None
        except UnicodeDecodeError:
            return False
    partial = sorted({i for i in ids if not whole(tok.token_bytes(i))})
    assert partial  # some tokens end or begin inside a character
    shown = [token_text(tok, i, False) for i in partial]
    assert shown == ["bytes:" + "".join(f"\\x{b:02x}" for b in tok.token_bytes(i)) for i in partial]
    assert len(set(shown)) == len(partial)  # distinct keys
    assert token_text(tok, tok.encode("h", add_special_tokens=False)[0], False) == "h"


@pytest.mark.parametrize("stream", [False, True])
def test_text_offsets_index_the_text_across_multibyte_characters(stream):
    """Each token's text_offset is where its text starts in the choice's text (echoed prompt
    included): a byte inside a character starts where the character does. Counting each token's
    own decoded length (1 for a lone byte's U+FFFD) ran past the end of the text."""
    from common import protocol as P
    from router.openai_responses import Choice

    tok = ByteTokenizer()
    prompt, completion = "Café 日本", "語 ok"
    job = parse_completion({"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 0}, MODEL)
    choice = Choice(0, job, tok, tok.encode(prompt), prompt)
    ids = tok.encode(completion)
    entries = [(-1.0, [], []) for _ in ids]
    if stream:
        offsets = []
        for i, t in enumerate(ids):  # one token a message, the prompt with the first
            token = P.Token("r", i, [t], "", logprobs=[entries[i]], prompt_logprobs=[None] * len(tok.encode(prompt)))
            (chunk,) = choice.chunks(token)
            offsets += chunk["logprobs"]["text_offset"]
    else:
        offsets = choice.final(P.Done("r", "length", ids, completion, logprobs=entries))["logprobs"]["text_offset"]
    text = prompt + completion
    starts = [i for i, ch in enumerate(text) for _ in ch.encode()]  # each byte's character
    assert offsets == starts, offsets  # e.g. 日's three bytes all at 5; 語 at 7; max below len(text)


def stream_all(tokenizer, ids, stop=(), include=False):

    """(streamed deltas joined, final text, tokens taken) of one TextStream."""
    ts, streamed, taken = TextStream(tokenizer, stop, include), [], 0
    for t in ids:
        taken += 1
        stopped = ts.add(t)
        streamed.append(ts.delta())
        if stopped:
            break
    final = ts.final()
    streamed.append(final[len("".join(streamed)):])
    return "".join(streamed), final, taken, ts.stop_reason


@pytest.mark.parametrize("which", ["byte", "bpe"])
def test_incremental_text_equals_decoding_everything(which, bpe):
    tok = ByteTokenizer() if which == "byte" else bpe
    rng = random.Random(0)
    vocab = 258 if which == "byte" else VOCAB
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        if which == "byte" and rng.random() < 0.5:
            ids = list("héllo wörld €".encode()) + ids  # multi-byte characters split across tokens
        streamed, final, _, _ = stream_all(tok, ids)
        assert streamed == final == tok.decode(ids).rstrip("\ufffd"), ids  # (less a last partial character)


def test_stop_string_spanning_bpe_tokens(bpe):
    ids = bpe.encode("the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    pieces = [bpe.decode([t]) for t in ids]
    assert any(len(p) > 2 for p in pieces)  # multi-character tokens
    # "k bro" starts inside one token ("quick") and ends inside another ("brown")
    streamed, final, taken, reason = stream_all(bpe, ids, stop=["k bro", "zzz"])
    assert (streamed, final, reason) == ("the quic", "the quic", "k bro")
    assert "brown" in bpe.decode(ids[:taken]) and "brown" not in bpe.decode(ids[:taken - 1])
    assert stream_all(bpe, ids, stop=["k bro"], include=True)[1] == "the quick bro"
    # The earliest match wins, whichever stop string it is.
    assert stream_all(bpe, ids, stop=["lazy", "fox"])[1] == "the quick brown "


def test_held_back_text_never_shows_a_stop_string():
    """The last len("abc") - 1 characters wait: they could be the start of the stop string."""
    ts = TextStream(ByteTokenizer(), ["abc"])
    shown, text = "", "xxabxab"
    for i, ch in enumerate(text):
        assert not ts.add(ord(ch))
        shown += ts.delta()
        assert shown == text[:max(0, i - 1)]
    assert ts.add(ord("c"))
    shown += ts.delta()
    assert shown == ts.final() == "xxabx"


def test_no_stop_string_is_found_in_the_first_min_tokens_text():
    """vLLM's rule: the text of the first min_tokens tokens is not searched, and a string that lies
    wholly within it is not found later either; one it begins and a later token completes is."""
    def stops_at(text, min_tokens, stop=("ab", "long stop")):
        ts = TextStream(ByteTokenizer(), list(stop), min_tokens=min_tokens)
        return next((i + 1 for i, ch in enumerate(text) if ts.add(ord(ch))), None), ts.text
    assert stops_at("xabyyab", 0) == (3, "x")
    assert stops_at("xabyyab", 3) == (7, "xabyy")  # the first "ab" is within the first three tokens
    assert stops_at("xabyyab", 2) == (3, "x")  # "ab" completed by the third token
    assert stops_at("xabyy", 4) == (None, "xabyy")


class PieceTokenizer:
    """Each id decodes to a byte string of its own, as a byte-level BPE's token may end inside a
    character (b"a\\xc3" is "a" then the first byte of "é")."""
    PIECES = {1: b"x", 2: b"a\xc3", 3: b"\xa9"}

    def decode(self, ids):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def test_the_whole_characters_of_tokens_held_back_count_where_the_next_token_starts():
    """text_offset of a token that continues a character: where the character starts, after what
    the token before it began with ("a" of b"a\xc3"), not where the text stood before both."""
    ts = TextStream(PieceTokenizer())
    assert ts.whole_chars() == 0 and not ts.add(1) and ts.whole_chars() == 1
    assert not ts.add(2) and ts.text == "x" and ts.whole_chars() == 2  # "a" is whole, "é" is not yet
    ts.add(3)
    assert ts.text == "xaé" and ts.whole_chars() == 3


def test_a_stop_string_completed_by_a_token_ending_in_a_partial_character_is_found_at_the_end():
    """The text of b"a\\xc3" waits for the character's next byte; if the output ends first, the
    final text still holds the "a" that completes "xa", and must stop there, not show it."""
    ts = TextStream(PieceTokenizer(), ["xa"])
    assert not ts.add(1) and not ts.add(2)  # "a" waits with its partial character
    assert ts.final() == "" and ts.stop_reason == "xa"
    ts = TextStream(PieceTokenizer(), ["xa"], include_stop=True)
    assert not ts.add(1) and not ts.add(2) and (ts.final(), ts.stop_reason) == ("xa", "xa")
    ts = TextStream(PieceTokenizer(), ["xa"], min_tokens=2)  # within the first min_tokens: not searched
    assert not ts.add(1) and not ts.add(2) and (ts.final(), ts.stop_reason) == ("xa", None)  # no U+FFFD
    ts = TextStream(PieceTokenizer(), ["xa"])
    assert not ts.add(1) and ts.add(2) is False and ts.add(3)  # the character completes: found as it grows
    assert (ts.final(), ts.stop_reason) == ("", "xa")


def byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer.json in memory: a few letters, and <0xNN> tokens for every
    other byte, which its decoder fuses into characters by runs."""
    from tokenizers import Tokenizer, decoders, models

    from common.tokenizer import HFTokenizer

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    vocab.update({ch: len(vocab) + i for i, ch in enumerate("\u2581helo")})
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return HFTokenizer(tok)


def test_an_output_cut_inside_a_character_keeps_the_whole_characters_before_it_streamed_or_not():
    """A byte-fallback decoder turns a whole run of byte tokens to U+FFFD when the run ends inside a
    character: the text of a non-streamed output lost the complete emoji before the cut one, where
    the streamed text kept it."""
    from common.text import output_text

    tok = byte_fallback_tokenizer()
    byte = {b: 1 + b for b in range(256)}
    emoji = "\U0001F600".encode()
    ids = tok.encode("hello") + [byte[b] for b in emoji + emoji[:2]]  # max_tokens cut the second emoji
    assert tok.decode(ids) == "hello" + "\ufffd" * 6  # the whole run, the first emoji's bytes with it
    params = SamplingParams(max_tokens=len(ids))
    assert output_text(tok, ids, params) == stream_all(tok, ids)[1] == "hello\U0001F600"
    for cut in range(len(ids) + 1):  # every prefix: the same text streamed or not
        assert output_text(tok, ids[:cut], params) == stream_all(tok, ids[:cut])[1]


# ----------------------------------------------------------------------------- the router's side, with a scripted worker


def test_router_stops_at_a_stop_string_and_cancels_the_workers_work():
    """A real Router on loopback and a scripted worker on its worker socket: tokens "x", "a", then
    "b" and "c" together. "ab" spans two messages; the router cuts the text before it, drops the
    token after it, tells the worker to cancel, and ends the request with stop."""
    import asyncio

    from common import protocol as P
    from common.sampling_params import SamplingParams
    from tests.cluster import scripted_worker, serving_router

    async def scenario():
        async with serving_router(model=MODEL) as (router, connect):
            worker = await scripted_worker(router, connect, "w")
            replies = []
            params = SamplingParams(max_tokens=500, stop=["ab"], logprobs=0, ignore_eos=True)
            assert router.submit("test", "r1", [1, 2, 3], params, True, replies.append)
            work = (await worker.arecv()).msg
            assert isinstance(work, P.PrefillWork) and work.sampling["stop"] == ["ab"]
            for index, tokens in ((0, [ord("x")]), (1, [ord("a")]), (2, [ord("b"), ord("c")])):
                await worker.send(P.WorkerTokens(work.request_id, work.attempt, index, tokens,
                                                 logprobs=[[-1.0 - index, [], []]] * len(tokens)))
            cancel = (await asyncio.wait_for(worker.arecv(), 10)).msg
            assert cancel == P.CancelWork(work.request_id, work.attempt)
            done = replies[-1]
            assert isinstance(done, P.Done) and (done.finish_reason, done.stop_reason) == ("stop", "ab")
            assert (done.text, done.token_ids) == ("x", [ord("x"), ord("a"), ord("b")])
            assert [lp[0] for lp in done.logprobs] == [-1.0, -2.0, -3.0]
            streamed = [m for m in replies if isinstance(m, P.Token)]
            assert "".join(m.text for m in streamed) == "x" and sum(len(m.token_ids) for m in streamed) == 3
            assert not router.requests

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "decoded at the end"])
@pytest.mark.parametrize("case", ["partial character", "partial character, stop string", "stop token",
                                  "stop token kept"])
def test_the_routers_text_shows_neither_a_trailing_partial_character_nor_the_stop_token(case, stream):
    """As vLLM's: an output that ends inside a character ("x", then 0xC3) ends its text before it,
    even with "\\ufffd" as a stop string, and a stop token that ended it ("b") adds no text unless
    include_stop_str_in_output. Streamed or decoded once at the end, the text is the same."""
    import asyncio

    from common import protocol as P
    from common.sampling_params import SamplingParams
    from tests.cluster import scripted_worker, serving_router

    tokens, finish, want = {"partial character": ([ord("x"), 0xC3], "length", ("length", None, "x")),
                            "partial character, stop string": ([ord("x"), 0xC3], "length", ("length", None, "x")),
                            "stop token": ([ord("x"), ord("b")], "stop", ("stop", ord("b"), "x")),
                            "stop token kept": ([ord("x"), ord("b")], "stop", ("stop", ord("b"), "xb"))}[case]
    params = SamplingParams(max_tokens=2, stop=["\ufffd"] if case.endswith("stop string") else [],
                            stop_token_ids=[ord("b")], include_stop_str_in_output=case == "stop token kept",
                            ignore_eos=True)

    async def scenario():
        async with serving_router(model=MODEL) as (router, connect):
            worker = await scripted_worker(router, connect, "w")
            replies = []
            assert router.submit("test", "r1", [1, 2, 3], params, stream, replies.append)
            work = (await worker.arecv()).msg
            await worker.send(P.WorkerTokens(work.request_id, work.attempt, 0, tokens, finish_reason=finish))
            for _ in range(100):
                if replies and isinstance(replies[-1], P.Done):
                    break
                await asyncio.sleep(0.02)
            done = replies[-1]
            assert isinstance(done, P.Done) and (done.finish_reason, done.stop_reason, done.text) == want
            streamed = "".join(m.text for m in replies if isinstance(m, P.Token))
            assert streamed == (want[2] if stream else ""), streamed
            assert not router.requests

    asyncio.run(scenario())
