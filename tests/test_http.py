"""The OpenAI-compatible HTTP API of a real cluster (router + workers on loopback), driven by the
official `openai` client, sync and async, streaming and not: the monolithic engine's tokens for
greedy and seeded requests, stop strings across tokens, n choices, logprobs equal to log_softmax of
the engine's own logits, echo and usage; every error in OpenAI's shape; a client that goes away
frees every KV block; API keys; /metrics that parse and count right."""

import asyncio
import gc
import json
import pathlib
import re
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")  # a test extra; the GPU machine's image lacks it, and its gpu tests are elsewhere

from common import protocol as P  # noqa: E402
from common.engine import Engine  # noqa: E402
from common.sampling_params import SamplingParams, choice_seed
from router.client import Client, RequestError
from tests.cluster import cluster, http_request, router_children, stop, wait_blocks_free

pytestmark = pytest.mark.timeout(600)
MODEL = "dummy:nanogpt"
KEY = "sk-test-key"
ALIAS = "gpt-4o-mini"  # --served-model-name: a name an existing client is hard-wired to
PROMPT_IDS = [72, 101, 108, 108, 111, 44, 32]


@pytest.fixture(scope="module")
def engine():
    return Engine(model=MODEL, enable_prefix_caching=False)


@pytest.fixture(scope="module", params=[1, 2], ids=["in-router", "api-servers"])
def served(request, tmp_path_factory):
    """Every test below runs against HTTP served in the router process and by two API server
    processes beside it (--api-server-count 2): they must not differ."""
    with cluster(tmp_path_factory.mktemp("http"), http=True, api_key=KEY, api_servers=request.param,
                 router_args=["--max-queue", "16", "--served-model-name", ALIAS, "--served-model-name", MODEL,
                              "--tool-call-parser", "hermes", "--log-requests"]) as c:
        yield c


def api(c, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.http_url + "/v1", api_key=KEY, max_retries=0, timeout=120, **kw)


def reference(engine, prompt, **sampling):
    return engine.generate([prompt], SamplingParams(**sampling))[0]


def ids_of(tokens: list[str]) -> list[int]:
    """Token ids back from return_tokens_as_token_ids' "token_id:N" strings."""
    return [int(t.removeprefix("token_id:")) for t in tokens]


def engine_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of the engine's raw logits at every position of ids, by one plain prefill."""
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0), request_id="ref-logits")
    batch = engine.scheduler.schedule()
    _, input_ids, positions, meta, _ = engine.runner.prepare(batch)
    with torch.inference_mode():
        hidden = engine.model(input_ids, positions, engine.kv_cache, meta, None)
        logprobs = torch.log_softmax(engine.model.logits(hidden).float(), dim=-1)
    engine.abort_request("ref-logits")
    return logprobs


def http(c, method, path, body=None, key=KEY, raw: bytes | None = None, headers: dict | None = None):
    """(status, headers, parsed JSON or text) of one plain HTTP request to cluster c."""
    return http_request(c.http_url + path, method, body, key, raw, headers)


# ----------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("stream", [False, True])
def test_completions_give_the_engines_tokens(served, engine, stream):
    client = api(served)
    cases = [("Hello, world", dict(temperature=0)), (PROMPT_IDS, dict(temperature=0.9, top_p=0.9, top_k=50, seed=7))]
    for prompt, sampling in cases:
        want = reference(engine, prompt, max_tokens=12, ignore_eos=True, **sampling)
        args = dict(model=MODEL, prompt=prompt, max_tokens=12, logprobs=0, stream=stream,
                    extra_body=dict(ignore_eos=True, return_tokens_as_token_ids=True, top_k=sampling.pop("top_k", 0)),
                    **sampling)
        if stream:
            chunks = list(client.completions.create(**args, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
            assert not chunks[-1].choices and all(c.usage is None for c in chunks[:-1])
            assert all("usage" in c.model_fields_set for c in chunks)  # "usage": null before the last, as OpenAI's
        else:
            r = client.completions.create(**args)
            text, tokens, finish, usage = r.choices[0].text, r.choices[0].logprobs.tokens, [r.choices[0].finish_reason], r.usage
        assert ids_of(tokens) == want.token_ids
        assert text == want.text
        assert finish == ["length"]
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            len(want.prompt_token_ids), 12, len(want.prompt_token_ids) + 12)


def test_vllms_continuous_usage_stats_count_each_choices_tokens_as_they_stream(served):
    """stream_options.continuous_usage_stats (with include_usage, as vLLM): every chunk carries its
    choice's usage so far; the last, the request's."""
    for chat in (False, True):
        args = dict(model=MODEL, max_tokens=7, n=2, stream=True, temperature=0.8, seed=3, logprobs=True if chat else 0,
                    stream_options={"include_usage": True, "continuous_usage_stats": True},
                    extra_body=dict(ignore_eos=True, return_tokens_as_token_ids=True))
        client = api(served)
        if chat:
            messages = [{"role": "user", "content": "Hi"}]
            chunks = list(client.chat.completions.create(messages=messages, **args))
            prompt_len = http(served, "POST", "/tokenize", {"messages": messages})[2]["count"]
        else:
            chunks = list(client.completions.create(prompt=PROMPT_IDS, **args))
            prompt_len = len(PROMPT_IDS)
        seen = {0: 0, 1: 0}
        for c in chunks[:-1]:
            (choice,) = c.choices
            lp = choice.logprobs
            seen[choice.index] += len((lp.content if chat else lp.tokens) or []) if lp else 0
            assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (
                prompt_len, seen[choice.index], prompt_len + seen[choice.index]), (chat, c)
        assert seen == {0: 7, 1: 7} and not chunks[-1].choices
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt_len, 14)


def test_chat_gives_the_engines_tokens_sync_and_async(served, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt_ids = engine.tokenizer.encode_chat(messages)
    want = {seed: reference(engine, prompt_ids, max_tokens=10, ignore_eos=True, temperature=0.8, seed=seed)
            for seed in (1, 2)}
    args = dict(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0.8, logprobs=True,
                extra_body=dict(ignore_eos=True, return_tokens_as_token_ids=True))
    r = api(served).chat.completions.create(seed=1, **args)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want[1].text
    assert ids_of([t.token for t in r.choices[0].logprobs.content]) == want[1].token_ids
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 10

    async def streamed():
        async with openai.AsyncOpenAI(base_url=served.http_url + "/v1", api_key=KEY, max_retries=0) as client:
            async def one(seed):
                chunks = [c async for c in await client.chat.completions.create(seed=seed, stream=True, **args)]
                return chunks
            return await asyncio.gather(*(one(s) for s in (1, 2)))

    for seed, chunks in zip((1, 2), asyncio.run(streamed())):
        deltas = [c.choices[0].delta for c in chunks]
        assert deltas[0].role == "assistant" and deltas[0].content == ""  # the role first
        assert all(d.role is None for d in deltas[1:])
        assert "".join(d.content or "" for d in deltas) == want[seed].text
        tokens = [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        assert ids_of(tokens) == want[seed].token_ids
        assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


def test_response_format_and_structured_outputs_give_the_engines_json(served, engine):
    """The SDK's response_format (chat) and vLLM's structured_outputs (a streamed completion) reach
    the workers, whose tokens are the engine's; a schema that does not compile is a 400 naming it."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"],
              "additionalProperties": False}
    messages = [{"role": "user", "content": "Give me JSON"}]
    want = reference(engine, engine.tokenizer.encode_chat(messages), max_tokens=40, temperature=0.7, seed=3,
                     structured_outputs={"json": schema})
    assert want.finish_reason == "stop" and set(json.loads(want.text)) == {"n", "ok"}
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    r = api(served).chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=40, temperature=0.7,
                                            seed=3, response_format=fmt)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want.text, "stop")
    spec = {"regex": "[a-z]{2,6}( [a-z]{2,6})*"}
    want = reference(engine, "Words:", max_tokens=12, temperature=0.9, seed=5, structured_outputs=spec)
    chunks = list(api(served).completions.create(model=MODEL, prompt="Words:", max_tokens=12, temperature=0.9, seed=5,
                                                 stream=True, extra_body={"structured_outputs": spec}))
    assert "".join(c.choices[0].text for c in chunks) == want.text and re.fullmatch(spec["regex"], want.text)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    got, _, body = http(served, "POST", "/v1/chat/completions", dict(model=MODEL, messages=messages,
                                                                     response_format=bad))
    assert got == 400 and body["error"]["param"] == "response_format", body
    assert "response_format.json_schema.schema does not compile" in body["error"]["message"]
    # a grammar that compiles until it meets the model's vocabulary: refused by the prefill worker
    got, _, body = http(served, "POST", "/v1/completions", dict(model=MODEL, prompt="x", structured_outputs={
        "grammar": 'start: <[99999]> "a"'}))
    assert got == 400 and "Token range end too large: 99999" in body["error"]["message"], body
    served_on = api(served).completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
    assert served_on.usage.completion_tokens == 2


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def test_tool_choice_gives_tool_calls_of_the_engines_json(served, engine):
    """A named function's arguments and "required" calls are the engine's tokens under the same
    schema, shown as tool_calls (streamed: the named call's arguments as they come, required
    calls once whole); the tools' results go back as messages, and "none" answers in text."""
    from router.tool_calls import parse

    tools, client = [WEATHER, CLOCK], api(served)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    ids = engine.tokenizer.encode_chat(messages, tools=tools)
    args = dict(model=MODEL, messages=messages, tools=tools, max_completion_tokens=60, temperature=0.8, seed=4)
    named = {"type": "function", "function": {"name": "get_weather"}}
    want = reference(engine, ids, max_tokens=60, temperature=0.8, seed=4,
                     structured_outputs={"json": WEATHER["function"]["parameters"]})
    assert want.finish_reason == "stop" and set(json.loads(want.text)) == {"city", "days"}
    r = client.chat.completions.create(tool_choice=named, **args)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", want.text)
    assert r.choices[0].message.content is None
    assert r.choices[0].finish_reason == "stop" and call.id.startswith("call_")
    deltas = [c.choices[0].delta for c in client.chat.completions.create(tool_choice=named, stream=True, **args)]
    pieces = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert pieces[0].id and pieces[0].function.name == "get_weather" and all(p.id is None for p in pieces[1:])
    assert "".join(p.function.arguments for p in pieces) == want.text

    spec = parse({"tools": tools, "tool_choice": "required"}, parallel=False).structured_outputs()
    want = reference(engine, ids, max_tokens=60, temperature=0.8, seed=4, structured_outputs=spec)
    assert want.finish_reason == "stop"
    expected = [(c["name"], c["parameters"]) for c in json.loads(want.text)]
    args["parallel_tool_calls"] = False  # one call: a random model's list of calls may run on to max_tokens
    r = client.chat.completions.create(tool_choice="required", **args)
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
    assert r.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(tool_choice="required", stream=True, **args))
    streamed = [t for c in chunks if c.choices and c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == expected
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    messages += [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                 {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 21 C"}]
    want = reference(engine, engine.tokenizer.encode_chat(messages, tools=tools), max_tokens=8, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="none",
                                       max_completion_tokens=8, temperature=0)
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == (want.text, None)


def test_auto_tool_choice_finds_the_calls_in_the_models_text(served):
    """tool_choice "auto" (the default with tools) under --tool-call-parser hermes: calls written
    in Hermes' format are shown as tool_calls, the text before them as content, and an answer
    without calls as text; streamed, the content as it comes and the calls at the end. A random
    model is made to write them by a regex only they match."""
    client, tools = api(served), [WEATHER, CLOCK]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    two = call + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    cases = [("", call, [("get_weather", {"city": "Paris", "days": 2})]),
             ("Let me look. ", two, [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
             ("It is sunny.", "", [])]
    for content, calls_text, want in cases:
        body = dict(model=MODEL, messages=messages, tools=tools, max_completion_tokens=400, temperature=0.8, seed=1,
                    extra_body={"structured_outputs": {"regex": re.escape(content + calls_text)}})
        r = client.chat.completions.create(**body)
        message = r.choices[0].message
        assert message.content == (content or None)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == want
        assert r.choices[0].finish_reason == ("tool_calls" if want else "stop")
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **body) if c.choices]
        streamed = [t for c in chunks if c.delta.tool_calls for t in c.delta.tool_calls]
        assert "".join(c.delta.content or "" for c in chunks) == content
        assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == want
        assert chunks[-1].finish_reason == ("tool_calls" if want else "stop")
    body["parallel_tool_calls"] = False  # the first call alone
    body["extra_body"] = {"structured_outputs": {"regex": re.escape(two)}}
    assert [c.function.name for c in client.chat.completions.create(**body).choices[0].message.tool_calls] == \
        ["get_weather"]


def test_reasoning_is_shown_apart_from_the_answer_and_its_calls(tmp_path):
    """--reasoning-parser qwen3 beside --tool-call-parser hermes: what the model writes in
    <think> is reasoning_content, streamed and not; the calls after it are found as without
    reasoning; chat_template_kwargs reach the template (checked by name)."""
    weather = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
    output = f"<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{weather}\n</tool_call>"
    with cluster(tmp_path, http=True, api_key=KEY, router_args=["--reasoning-parser", "qwen3",
                                                                 "--tool-call-parser", "hermes"]) as c:
        client = api(c)
        body = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                    max_completion_tokens=400, extra_body={"structured_outputs": {"regex": re.escape(output)},
                                                           "chat_template_kwargs": {"enable_thinking": True}})
        r = client.chat.completions.create(**body)
        message = r.choices[0].message
        assert (message.reasoning, message.reasoning_content, message.content) == (
            "The user wants weather.", "The user wants weather.", None)  # vLLM's name, and DeepSeek's
        assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
            ("get_weather", {"city": "Paris", "days": 1})]
        assert r.choices[0].finish_reason == "tool_calls"
        chunks = [ch.choices[0] for ch in client.chat.completions.create(stream=True, **body) if ch.choices]
        for name in ("reasoning", "reasoning_content"):
            assert "".join(getattr(ch.delta, name, None) or "" for ch in chunks) == "The user wants weather."
        assert not any(ch.delta.content for ch in chunks)
        assert [t.function.name for ch in chunks for t in ch.delta.tool_calls or []] == ["get_weather"]
        body["extra_body"] = {"structured_outputs": {"regex": "Plain answer"}}  # no <think>: all content
        message = client.chat.completions.create(**body).choices[0].message
        assert (message.reasoning_content, message.content, message.tool_calls) == (None, "Plain answer", None)
        body["extra_body"] = {"chat_template_kwargs": {"messages": []}}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**body)
        assert e.value.body["param"] == "chat_template_kwargs" and "sets ['messages']" in e.value.body["message"]
        # response_format thinks first, as vLLM's: its JSON begins after </think>, here the prompt's "</think"
        # and the '>' a bias makes its first token (on the prefill worker, the JSON on the decode worker)
        schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
                  "additionalProperties": False}
        started = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "<think>\nhm\n</think"}]
        ask = dict(model=MODEL, max_completion_tokens=40, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}, extra_body={
            "add_generation_prompt": False, "continue_final_message": True, "logit_bias": {str(ord(">")): 100}})
        content = client.chat.completions.create(messages=started, **ask).choices[0].message.content
        assert content[0] == ">" and json.loads(content[1:])["a"] in ("x", "y"), content
        streamed = client.chat.completions.create(messages=started, stream=True, **ask)
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == content
        started[1]["content"] += ">"  # a prompt that closed the thinking: JSON from the first token
        assert json.loads(client.chat.completions.create(messages=started, **ask).choices[0].message.content)


def test_usage_says_how_much_of_the_prompt_was_found_cached(served):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: none the first time, every full block
    but the one holding the last token the second."""
    prompt = [(7 * i) % 250 + 3 for i in range(100)]
    client = api(served)
    first, second = (client.completions.create(model=MODEL, prompt=prompt, max_tokens=2) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 96


def test_n_choices_have_seeds_seed_plus_index(served, engine):
    client = api(served)
    r = client.completions.create(model=MODEL, prompt=["Once upon", PROMPT_IDS], n=3, seed=11, temperature=1.0,
                                  max_tokens=8, extra_body=dict(ignore_eos=True))
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:
        prompt = ["Once upon", PROMPT_IDS][c.index // 3]
        want = reference(engine, prompt, max_tokens=8, ignore_eos=True, temperature=1.0, seed=choice_seed(11, c.index % 3))
        assert c.text == want.text
    assert len({c.text for c in r.choices[:3]}) == 3, "n choices of one prompt must differ"
    prompt_tokens = len(engine.tokenize("Once upon")) + len(PROMPT_IDS)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, 6 * 8)  # prompts counted once
    greedy = client.completions.create(model=MODEL, prompt="abc", n=2, temperature=0, max_tokens=6)
    assert greedy.choices[0].text == greedy.choices[1].text


# ----------------------------------------------------------------------------- stop, logprobs, echo


def stop_string_in(text: str, at_least: int = 3) -> str:
    """A two-character stop string that first occurs at character at_least or later."""
    for i in range(at_least, len(text) - 1):
        s = text[i:i + 2]
        if s.isprintable() and "\ufffd" not in s and text.find(s) == i:
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_across_tokens_cut_the_text_and_free_the_blocks(served, engine):
    want = reference(engine, "The stop test", max_tokens=40, temperature=0, ignore_eos=True)
    stop = stop_string_in(want.text)
    cut = want.text.index(stop)
    ends_at = next(k for k in range(1, 41) if stop in engine.tokenizer.decode(want.token_ids[:k]))  # completes it
    client = api(served)
    args = dict(model=MODEL, prompt="The stop test", max_tokens=40, temperature=0, stop=[stop, "never"],
                extra_body=dict(ignore_eos=True))
    r = client.completions.create(**args)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text[:cut], "stop")
    assert r.choices[0].model_extra["stop_reason"] == stop
    assert r.usage.completion_tokens == ends_at < 40
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == want.text[:cut]  # never a character of the stop string
    assert chunks[-1].choices[0].finish_reason == "stop"
    kept = client.completions.create(**args | {"extra_body": dict(ignore_eos=True, include_stop_str_in_output=True)})
    assert kept.choices[0].text == want.text[:cut + len(stop)]
    # min_tokens: no stop string in the text of the first min_tokens tokens (vLLM's rule), found
    # alike in the router and in an engine
    late = client.completions.create(**args | {"extra_body": dict(ignore_eos=True, min_tokens=ends_at)})
    want_late = reference(engine, "The stop test", max_tokens=40, temperature=0, ignore_eos=True, stop=[stop, "never"],
                          min_tokens=ends_at)
    assert late.usage.completion_tokens == len(want_late.token_ids) > ends_at
    assert late.choices[0].text == want_late.text and want_late.token_ids[:ends_at] == want.token_ids[:ends_at]
    with Client(served.address, timeout=60) as sdk:  # the ZeroMQ SDK: the same stop, in the router
        res = sdk.generate("The stop test", max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
        assert (res.text, res.finish_reason, res.stop_reason) == (want.text[:cut], "stop", stop)
        assert res.token_ids == want.token_ids[:ends_at]
        workers = wait_blocks_free(sdk)
        assert all(w["free_blocks"] == w["total_blocks"] for w in workers), workers
        assert sdk.status().in_flight == 0


def test_chat_stream_sends_no_empty_deltas_while_text_is_held_back(served, engine):
    messages = [{"role": "user", "content": "Tell me a story"}]
    want = reference(engine, engine.tokenizer.encode_chat(messages), max_tokens=40, temperature=0, ignore_eos=True)
    stop = stop_string_in(want.text)
    chunks = list(api(served).chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                      stop=[stop], stream=True, extra_body=dict(ignore_eos=True)))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == want.text[:want.text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(d.content for d in deltas[1:-1]), [d.content for d in deltas]  # as vLLM: a chunk says something


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(served, stream):
    """vLLM's: the prompt and its logprobs, no completion (what evaluation harnesses score with)."""
    client = api(served)
    args = dict(model=MODEL, prompt="The cat sat", echo=True, logprobs=1, temperature=0)
    scored = client.completions.create(**args, max_tokens=1)  # the prompt's logprobs, then one token's
    if stream:
        chunks = list(client.completions.create(**args, max_tokens=0, stream=True,
                                                stream_options={"include_usage": True}))
        choices = [c.choices[0] for c in chunks if c.choices]
        text = "".join(c.text for c in choices)
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
        logprobs = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
        finish, usage = choices[-1].finish_reason, chunks[-1].usage
    else:
        r = client.completions.create(**args, max_tokens=0)
        text, tokens, logprobs = r.choices[0].text, r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs
        finish, usage = r.choices[0].finish_reason, r.usage
    P = scored.usage.prompt_tokens
    assert text == "The cat sat" and tokens == scored.choices[0].logprobs.tokens[:P]
    assert logprobs == scored.choices[0].logprobs.token_logprobs[:P] and finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (P, 0)
    with pytest.raises(openai.BadRequestError, match="max_tokens=0 is invalid without echo"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)


def test_a_response_of_megabytes_is_written_as_it_is_made(served):
    """n choices of echoed logprobs make megabytes of JSON (201 MB held the router's loop 5.7 s):
    written a piece at a time, as chunks of one body, the same JSON as a small response's."""
    body = dict(model=MODEL, prompt="The cat sat on the mat. " * 12, echo=True, logprobs=20, temperature=0,
                max_tokens=8)
    status, small_headers, one = http(served, "POST", "/v1/completions", body)
    assert status == 200 and "Content-Length" in small_headers
    status, headers, many = http(served, "POST", "/v1/completions", {**body, "n": 8})
    assert status == 200 and headers.get("Transfer-Encoding") == "chunked", headers
    assert headers["Content-Type"] == small_headers["Content-Type"] == "application/json; charset=utf-8"
    assert len(json.dumps(many)) > 1 << 20 and [c["index"] for c in many["choices"]] == list(range(8))
    alone = one["choices"][0]
    for c in many["choices"]:  # greedy: each choice the one's (its logprobs to the last bits: batched on a CPU)
        assert (c["text"], c["logprobs"]["tokens"]) == (alone["text"], alone["logprobs"]["tokens"])
        assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(alone["logprobs"]["token_logprobs"][1:], abs=1e-4)
    assert many["usage"]["completion_tokens"] == 8 * one["usage"]["completion_tokens"]


def test_an_echoed_prompt_shows_its_special_tokens_where_its_logprobs_do(served):
    """A prompt of token ids holding BOS (<s>) is echoed with it, as vLLM echoes it, and each
    prompt token's text_offset is where its text starts in that echo (the text left <s> out, and
    the offsets counted the text without it)."""
    r = api(served).completions.create(model=MODEL, prompt=[256, 104, 105], echo=True, logprobs=0, max_tokens=1)
    choice = r.choices[0]
    assert choice.text.startswith("<s>hi") and choice.logprobs.tokens[:3] == ["<s>", "h", "i"], choice
    assert choice.logprobs.text_offset[:4] == [0, 3, 4, 5], choice.logprobs


def test_logprobs_are_log_softmax_of_the_engines_logits(served, engine):
    client = api(served)
    r = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0.7, seed=3, logprobs=5,
                                  echo=True, extra_body=dict(ignore_eos=True, return_tokens_as_token_ids=True))
    lp = r.choices[0].logprobs
    ids = ids_of(lp.tokens)
    P = len(PROMPT_IDS)
    assert ids[:P] == PROMPT_IDS and len(ids) == P + 6
    assert r.choices[0].text.startswith(engine.tokenizer.decode(PROMPT_IDS))  # echo
    ref = engine_logprobs(engine, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    for pos in range(1, len(ids)):
        row = ref[pos - 1]
        assert lp.token_logprobs[pos] == pytest.approx(row[ids[pos]].item(), abs=1e-4)
        top = {int(k.removeprefix("token_id:")): v for k, v in lp.top_logprobs[pos].items()}
        best = row.topk(5)
        want = dict(zip(best.indices.tolist(), best.values.tolist()))
        want[ids[pos]] = row[ids[pos]].item()  # the sampled token too, as OpenAI and vLLM give it
        assert top.keys() == want.keys()
        assert all(top[t] == pytest.approx(want[t], abs=1e-4) for t in want)
    assert lp.text_offset[:3] == [0, 1, 2]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    for item in chat.choices[0].logprobs.content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy takes the best
        raw = bytes(item.bytes)  # the token's own bytes: its text, or OpenAI's "bytes:\\xNN" inside a character
        assert item.token == (raw.decode() if raw.isascii() or not item.token.startswith("bytes:")
                              else "bytes:" + "".join(f"\\x{b:02x}" for b in raw))
        assert len(raw) <= 1  # dummy:nanogpt: a byte a token (none for EOS)


def test_sdk_gets_logprobs_too(served, engine):
    with Client(served.address, timeout=60) as sdk:
        res = sdk.generate(PROMPT_IDS, max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
        streamed = [lp for chunk in sdk.stream(PROMPT_IDS, max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
                    for lp in chunk.logprobs]
    want = reference(engine, PROMPT_IDS, max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
    assert res.token_ids == want.token_ids and len(res.logprobs) == len(want.logprobs) == len(streamed) == 5
    for got, exp, s in zip(res.logprobs, want.logprobs, streamed):
        assert got[1] == exp[1] == s[1] and got[0] == pytest.approx(exp[0], abs=1e-4)


# ----------------------------------------------------------------------------- errors


def test_errors_have_openais_shape_and_the_server_serves_on(served):
    base = dict(model=MODEL, prompt="hi", max_tokens=2)
    cases = [
        (dict(raw=b"{not json"), 400, "INVALID_ARGUMENT", None, "not valid JSON"),
        (dict(body=[1, 2]), 400, "INVALID_ARGUMENT", None, "JSON object"),
        (dict(body=base | {"max_tokens": "lots"}), 400, "INVALID_ARGUMENT", "max_tokens", "max_tokens='lots'"),
        (dict(body=base | {"max_tokens": -3}), 400, "INVALID_ARGUMENT", "max_tokens", "allowed: an integer in [1, 2**31 - 1]"),
        (dict(body=base | {"temperature": "hot"}), 400, "INVALID_ARGUMENT", "temperature", "a finite number >= 0"),
        (dict(body=base | {"frobnicate": 1}), 400, "INVALID_ARGUMENT", "frobnicate", "unknown field 'frobnicate'"),
        (dict(body=base | {"presence_penalty": 2.5}), 400, "INVALID_ARGUMENT", "presence_penalty", "[-2, 2]"),
        (dict(body=base | {"logit_bias": {"999": 1}}), 400, "INVALID_ARGUMENT", "logit_bias", "token ids [999]"),
        (dict(body=base | {"stop_token_ids": [7, 999]}), 400, "INVALID_ARGUMENT", "stop_token_ids", "token ids [999]"),
        (dict(body=base | {"max_tokens": 100000}), 400, "INVALID_ARGUMENT", "max_tokens",
         "max_tokens=100000 is too large: the model's maximum context length is"),
        (dict(body=base | {"tools": [{"type": "function"}]}), 400, "INVALID_ARGUMENT", "tools", "not supported"),
        (dict(raw=b'{"model": "%s", "prompt": "a\\ud800"}' % MODEL.encode()), 400, "INVALID_ARGUMENT", "prompt",
         "lone surrogate"),
        (dict(raw=b'{"model": "%s", "prompt": "a", "stop": ["\\ud800"]}' % MODEL.encode()), 400, "INVALID_ARGUMENT",
         "stop", "lone surrogate"),
        (dict(raw=b"[" * 100_000), 400, "INVALID_ARGUMENT", None, "nests too deeply"),
        # each of n choices carried them: 16 x 200 kB at n=400 held the router's loop 11.7 s
        (dict(body=base | {"stop": ["é" * 1024, "x" * 2049]}), 400, "INVALID_ARGUMENT", "stop",
         "allowed: at most 4096 bytes of text in all (UTF-8); these are 4097"),
        (dict(body=base | {"logprobs": 21}), 400, "INVALID_ARGUMENT", "logprobs", "[0, 20]"),
        (dict(body=base | {"prompt": [1, 999]}), 400, "INVALID_ARGUMENT", "prompt", "[999]"),
        (dict(body=base | {"prompt": [[1]] * 5, "n": 4}), 400, "INVALID_ARGUMENT", "n", "max_queue"),
        # counted before any prompt is tokenized or checked (900,000 one-letter prompts took 2 s)
        (dict(body=base | {"prompt": [[999]] * 40}), 400, "INVALID_ARGUMENT", "prompt", "max_queue"),
        (dict(body=base | {"stream_options": {"include_usage": True}}), 400, "INVALID_ARGUMENT", "stream_options",
         "with stream=false; allowed: stream_options only with stream=true"),
        (dict(body=base | {"model": "gpt-4"}), 404, "NOT_FOUND", "model", "'gpt-4' does not exist"),
        (dict(body=base | {"model": "m" * 100_000}), 404, "NOT_FOUND", "model", "'mmmmm"),
        (dict(raw=b'{"prompt": "' + b"x" * (4 * 2**20) + b'"}'), 413, "TOO_LARGE", None, "over the limit"),
        (dict(raw=b'{"prompt": "hi"}', headers={"Content-Encoding": "gzip"}), 400, "INVALID_ARGUMENT", None,
         "could not be decoded (Content-Encoding: gzip)"),
        (dict(raw=b'{"prompt": "hi"}', headers={"Content-Encoding": "xyz"}), 400, "INVALID_ARGUMENT", None,
         "Content-Encoding: 'xyz' is not supported; allowed: one of gzip or deflate, or none"),
    ]
    for kw, status, code, param, text in cases:
        got, _, body = http(served, "POST", "/v1/completions", **kw)
        assert got == status, (kw, body)
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["code"], error["param"]) == (code, param) and text in error["message"], error
        assert len(error["message"]) < 1000  # nothing the client sent is echoed whole
    too_long = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_completion_tokens=5000)
    got, _, body = http(served, "POST", "/v1/chat/completions", too_long)
    assert got == 400 and body["error"]["param"] == "max_completion_tokens", body
    chat = dict(model=MODEL, messages=[{"role": "", "content": "x"}])
    got, _, body = http(served, "POST", "/v1/chat/completions", chat)
    assert got == 400 and "messages[0].role" in body["error"]["message"] and body["error"]["param"] == "messages"
    got, _, body = http(served, "GET", "/v1/nothing")
    assert got == 404 and body["error"]["type"] == "not_found_error"
    assert http(served, "GET", "/v1/completions")[0] == 405
    with pytest.raises(openai.BadRequestError) as e:  # the client library reads the shape too
        api(served).completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    assert api(served).completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens >= 1


def test_overload_is_429_with_retry_after_and_a_disconnect_frees_every_block(served):
    """16 long streams fill max_queue; the next request gets 429. The streams' clients then go away
    mid-stream: every request is cancelled on the workers and every block comes back."""
    import aiohttp

    async def scenario():
        body = dict(model=MODEL, prompt="x" * 40, max_tokens=800, stream=True, ignore_eos=True)
        headers = {"Authorization": f"Bearer {KEY}"}
        sessions = [aiohttp.ClientSession() for _ in range(16)]
        try:
            responses = [await s.post(served.http_url + "/v1/completions", json=body, headers=headers) for s in sessions]
            for r in responses:
                assert r.status == 200
                assert (await r.content.readline()).startswith(b"data: ")  # decoding has started
            async with aiohttp.ClientSession() as s:
                async with s.post(served.http_url + "/v1/completions", json=body | {"stream": False},
                                  headers=headers) as r:
                    assert r.status == 429 and r.headers["Retry-After"] == "1"
                    assert (await r.json())["error"]["code"] == "OVERLOADED"
        finally:
            for s in sessions:
                await s.close()  # gone mid-stream

    before = scrape(served)
    with Client(served.address, timeout=60) as sdk:
        asyncio.run(scenario())
        workers = wait_blocks_free(sdk)
        assert all(w["free_blocks"] == w["total_blocks"] for w in workers), workers
        deadline = time.monotonic() + 10
        while sdk.status().in_flight:
            assert time.monotonic() < deadline, "requests of closed connections still in flight"
            time.sleep(0.1)
    after = scrape(served)  # cancelled, not run to their end
    cancelled = [value(m, "pdserve:request_success_total", finished_reason="abort") for m in (before, after)]
    assert cancelled[1] - cancelled[0] == 16
    assert value(after, "pdserve:request_errors_total", code="OVERLOADED") - \
        value(before, "pdserve:request_errors_total", code="OVERLOADED") == 1
    log = served.router.log_path.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def test_a_stream_whose_client_reads_nothing_stops_and_its_connection_closes(served):
    """An HTTP client that stopped reading its stream held its choices decoding, and what they made
    grew in the router (or an API server) for as long as it kept the connection: 5 MB/s and more
    with logprobs. As a ZeroMQ client's, after 5 s in which it took nothing its choices stop and
    its connection is closed."""
    said = lambda: served.router.log_path.read_text().count("read nothing of response")  # noqa: E731
    before = said()
    host, port = served.http_url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(dict(model=MODEL, prompt="x", max_tokens=1000, n=16, stream=True, ignore_eos=True,
                           logprobs=20)).encode()
    with socket.socket() as sock, Client(served.address, timeout=60) as sdk:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 90
        while said() == before:
            assert time.monotonic() < deadline, served.router.log_path.read_text()[-3000:]
            time.sleep(0.2)
        assert re.search(r"HTTP client \S+ read nothing of response \S+ for 5 s: its connection closes and its 16 "
                         r"choices stop", served.router.log_path.read_text())
        while sdk.status().in_flight:
            assert time.monotonic() < deadline, "the stalled stream's choices still in flight"
            time.sleep(0.1)
        workers = wait_blocks_free(sdk)
        assert all(w["free_blocks"] == w["total_blocks"] for w in workers), workers
        sock.settimeout(30)
        try:  # what the kernel holds of the stream, then the end of the connection
            while sock.recv(1 << 20):
                pass
        except ConnectionResetError:
            pass
    assert api(served).completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3


def test_a_body_of_megabytes_is_waited_for_while_its_client_reads_however_slowly():
    """A body written in 1 MiB pieces is waited for as long as its client reads (a piece that took
    longer than send_wait_s to a client reading 1.3 MB/s was cut, once the kernel's buffers were
    full); a client that reads nothing for send_wait_s is cut, its connection closed."""
    import types

    from aiohttp.test_utils import TestServer

    from router.http import HttpFront
    from router.prompts import Prompts

    prompts = Prompts(MODEL)
    front = HttpFront(types.SimpleNamespace(prompts=prompts, rejected=lambda code: None, max_queue=16), "127.0.0.1",
                      0, None, 2**24)
    front.send_wait_s = 0.3
    text = "hello world, " * 96000  # 6 MB of /tokenize's JSON: more than the kernel's buffers hold

    def asking(port: int, window: int) -> socket.socket:
        """A connection that has asked /tokenize for `text`, its receive buffer `window` bytes."""
        body = json.dumps({"prompt": text}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, window)
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        return sock

    def read(port: int, pause_s: float, first_pause_s: float = 0.0, window: int = 1 << 16) -> bytes:
        with asking(port, window) as sock:
            time.sleep(first_pause_s)
            got = []
            sock.settimeout(30)
            while True:
                try:
                    piece = sock.recv(1 << 16)
                except ConnectionResetError:
                    break
                if not piece:
                    break
                got.append(piece)
                time.sleep(pause_s)
            return b"".join(got)

    def reset(port: int) -> None:
        """Asks, reads nothing, and goes away: its connection reset while the body waits for it."""
        with asking(port, 4096) as sock:
            time.sleep(0.15)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # close with a reset

    def trickle(port: int) -> None:
        """Reads 1 KiB a twentieth of a second (20 KB/s: under 16 KiB a send_wait_s, yet some in each), for 2 s."""
        with asking(port, 4096) as sock:
            sock.recv(1024)  # the response has begun
            for _ in range(40):
                sock.recv(1024)
                time.sleep(0.05)

    stalls = []
    front.request_log.http_client_stalled = lambda *args: stalls.append(args)
    unhandled = []

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unhandled.append(context))
        # as the router runs it: a client that goes away cancels its handler
        async with TestServer(front.app, handler_cancellation=True) as server:
            slow = await asyncio.to_thread(read, server.port, 0.05)  # 64 KiB a twentieth of a second
            stopped = await asyncio.to_thread(read, server.port, 0.0, 1.0, 4096)  # nothing for 1 s, then all
            assert len(stalls) == 1
            await asyncio.to_thread(trickle, server.port)
            assert len(stalls) == 2  # a trickle keeps no connection
            await asyncio.to_thread(reset, server.port)
            await asyncio.sleep(0.5)
            gc.collect()  # a task whose exception nobody took says so when it is collected
            return slow, stopped

    slow, stopped = asyncio.run(scenario())
    assert not unhandled, unhandled  # the write a cancelled handler left is cancelled with it
    head, _, chunked = slow.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head and slow.endswith(b"\r\n0\r\n\r\n"), f"cut after {len(slow)} bytes"
    body, rest = b"", chunked
    while True:  # the chunks' sizes, then their bytes
        size, _, rest = rest.partition(b"\r\n")
        if int(size, 16) == 0:
            break
        body, rest = body + rest[:int(size, 16)], rest[int(size, 16) + 2:]
    assert json.loads(body)["tokens"] == prompts.encode(text, None)
    # cut: what the kernel held when the connection was closed (3 MB of 6), and no last chunk
    assert not stopped.endswith(b"\r\n0\r\n\r\n") and len(stopped) < 0.75 * len(slow)


def test_x_request_id_names_the_response_and_the_log_lines_and_a_bad_one_is_refused(served):
    """vLLM's X-Request-Id: echoed, in the response's id, and in the router's and the access log's
    lines (--log-requests), from the router process and from API servers alike."""
    body = dict(model=MODEL, prompt="hi", max_tokens=2)
    status, headers, answer = http(served, "POST", "/v1/completions", body, headers={"X-Request-Id": "trace-7"})
    assert status == 200 and headers["X-Request-Id"] == "trace-7", headers
    assert re.fullmatch(r"cmpl-trace-7-[0-9a-f]{8}", answer["id"]), answer["id"]
    status, headers, answer = http(served, "POST", "/v1/completions", dict(body, request_id="trace-8"))  # vLLM's
    assert status == 200 and headers["X-Request-Id"] == "trace-8", headers
    assert re.fullmatch(r"cmpl-trace-8-[0-9a-f]{8}", answer["id"]), answer["id"]
    status, headers, answer = http(served, "POST", "/v1/completions", dict(body, request_id="trace-8"),
                                   headers={"X-Request-Id": "trace-9"})  # the header's comes first, as in vLLM
    assert status == 200 and headers["X-Request-Id"] == "trace-9" and "trace-9" in answer["id"], answer
    status, _, answer = http(served, "POST", "/v1/completions", dict(body, request_id="a b"))
    assert status == 400 and answer["error"]["param"] == "request_id", answer
    status, headers, answer = http(served, "POST", "/v1/completions", body)  # none given: ours, alike
    assert status == 200 and answer["id"] == f"cmpl-{headers['X-Request-Id']}"
    for bad in ("a b", "x" * 257, 'q"uote'):
        status, headers, answer = http(served, "POST", "/v1/completions", body, headers={"X-Request-Id": bad})
        assert status == 400 and "X-Request-Id" not in headers, (bad, status, headers)
        assert answer["error"]["message"].startswith("X-Request-Id: ") and \
            "allowed: 1 to 256 printable ASCII characters" in answer["error"]["message"]
    status, _, _ = http(served, "POST", "/v1/completions", dict(body, max_tokens=-1), headers={"X-Request-Id": "no-9"})
    assert status == 400
    deadline = time.monotonic() + 10
    while True:
        log = served.router.log_path.read_text()
        said = [re.search(pattern, log) for pattern in (
            r"request trace-7-[0-9a-f]{8}-0 \(#[0-9a-f]{6}-\d+\) admitted from \S+: \d+ prompt tokens, max_tokens 2",
            r"request trace-7-[0-9a-f]{8}-0 \(#[0-9a-f]{6}-\d+\) finished \(length\): 2 tokens in ",
            r'"POST /v1/completions HTTP/1.1" 200 \d+ [0-9.]+ "trace-7"',  # the access log
            r"request no-9 from http refused: INVALID_ARGUMENT: max_tokens=-1")]
        if all(said) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(said), (said, log[-3000:])


def test_api_key_guards_v1_but_not_health_and_metrics(served):
    for key in (None, "wrong"):
        status, _, body = http(served, "GET", "/v1/models", key=key)
        assert status == 401 and body["error"]["code"] == "UNAUTHENTICATED"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.http_url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in api(served).models.list().data] == [ALIAS, MODEL]
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):  # /ping: vLLM's, SageMaker's
        status, _, body = http(served, method, path, key=None)
        assert (status, body) == (200, {"status": "ok", "workers": 2}), (method, path)
    assert http(served, "GET", "/metrics", key=None)[0] == 200
    # SageMaker's inference route, beside its /ping: either body, told apart by what it holds; behind the key
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    completion = {"prompt": "Hi", "max_tokens": 3, "temperature": 0}
    for body, path in ((chat, "/v1/chat/completions"), (completion, "/v1/completions")):
        status, _, answer = http(served, "POST", "/invocations", body)
        _, _, want = http(served, "POST", path, body)
        assert status == 200 and answer["object"] == want["object"] and answer["choices"] == want["choices"], answer
        assert http(served, "POST", "/invocations", body, key=None)[0] == 401
    status, _, answer = http(served, "POST", "/invocations", {"input": "Hi"})
    assert status == 400 and "neither messages nor prompt" in answer["error"]["message"], answer


def test_a_key_that_is_not_utf8_is_a_401_and_a_malformed_header_keeps_the_key_out_of_the_log(served):
    """The first was a 500 (UnicodeEncodeError); the second logged a traceback quoting the line
    aiohttp could not parse, API key and all."""
    def raw(header: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", int(served.http_url.rsplit(":", 1)[1])), timeout=30) as s:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + header + b"\r\n\r\n")
            return b"".join(iter(lambda: s.recv(65536), b""))
    assert raw(b"Authorization: Bearer \xff\xfe").startswith(b"HTTP/1.1 401")
    assert raw(b"Authorization: Bearer sekret-of-the-client\x00").split(b"\r\n")[0].endswith(b" 400 Bad Request")
    assert api(served).models.list().data  # serving on
    logs = "".join(p.read_text(errors="replace") for p in served.log_dir.glob("*.log"))
    assert "refused a malformed HTTP request (BadHttpMessage)" in logs or "(InvalidHeader)" in logs, logs[-3000:]
    assert "sekret-of-the-client" not in logs


@pytest.mark.parametrize("allowed", ["*", "https://a.example"])
def test_web_pages_of_allowed_origins_may_call_it(allowed):
    """CORS, as vLLM's (--allowed-origins, '*' by default): a browser's preflight is answered
    before the API key is asked for, and every answer, a stream's too, names the origin it allows."""
    import types

    from aiohttp.test_utils import TestClient, TestServer

    from router.http import HttpFront

    refused = []
    backend = types.SimpleNamespace(prompts=types.SimpleNamespace(model=MODEL, defaults={}), rejected=refused.append)
    front = HttpFront(backend, "127.0.0.1", 0, "sekrit", 2**20, allowed_origins=allowed)

    async def scenario():
        async with TestClient(TestServer(front.app)) as client:
            out = {}
            for origin in ("https://a.example", "https://b.example"):
                r = await client.options("/v1/chat/completions", headers={
                    "Origin": origin, "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type"})
                out[origin] = (r.status, dict(r.headers))
            r = await client.get("/v1/models", headers={"Origin": "https://a.example"})  # no key: refused, but readable
            return out, r.status, dict(r.headers)

    preflights, status, headers = asyncio.run(scenario())
    status_a, a = preflights["https://a.example"]
    assert status_a == 204 and a["Access-Control-Allow-Origin"] == allowed
    assert "POST" in a["Access-Control-Allow-Methods"] and a["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert (status, headers["Access-Control-Allow-Origin"]) == (401, allowed)
    assert refused == ["UNAUTHENTICATED"]  # counted once; the preflights are not refusals
    status_b, b = preflights["https://b.example"]
    if allowed == "*":
        assert status_b == 204 and b["Access-Control-Allow-Origin"] == "*"
    else:
        assert status_b == 403 and "Access-Control-Allow-Origin" not in b and a["Vary"] == b["Vary"] == "Origin"


def test_vllms_model_card_version_tokenize_and_detokenize_routes(served, engine):
    card = api(served).models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == 1024
    status, _, body = http(served, "GET", "/v1/models/gpt-4")
    assert status == 404 and body["error"]["code"] == "NOT_FOUND" and "'gpt-4'" in body["error"]["message"]
    assert f"served: '{ALIAS}', '{MODEL}'" in body["error"]["message"]
    alias = api(served).models.retrieve(ALIAS)  # --served-model-name: vLLM's
    assert alias.id == ALIAS and alias.model_extra["root"] == MODEL
    r = api(served).completions.create(model=ALIAS, prompt="Hello", max_tokens=4, temperature=0)
    assert r.model == ALIAS and r.choices[0].text == reference(engine, "Hello", max_tokens=4, temperature=0).text
    status, _, body = http(served, "GET", "/version", key=None)
    assert status == 200 and isinstance(body["version"], str)
    status, _, body = http(served, "POST", "/tokenize", {"model": MODEL, "prompt": "Hello, world"}, key=None)
    assert status == 200 and body == {"count": len(body["tokens"]), "max_model_len": 1024,
                                      "tokens": engine.tokenizer.encode("Hello, world")}
    long = "hello world, é " * 16000  # past /tokenize's one write: the same JSON, written in pieces
    status, _, big = http(served, "POST", "/tokenize", {"prompt": long, "return_token_strs": True}, key=None)
    ids = engine.tokenizer.encode(long)
    assert status == 200 and big == {"count": len(ids), "max_model_len": 1024, "tokens": ids,
                                     "token_strs": [chr(i) for i in ids]}  # a byte as its value's character
    messages = [{"role": "user", "content": "Hi"}]
    status, _, chat = http(served, "POST", "/tokenize", {"messages": messages})
    assert status == 200 and chat["tokens"] == engine.tokenizer.encode_chat(messages)
    started = messages + [{"role": "assistant", "content": "Hel"}]
    status, _, chat = http(served, "POST", "/tokenize", {"messages": started, "add_generation_prompt": False,
                                                        "continue_final_message": True})
    assert status == 200 and bytes(chat["tokens"]).endswith(b"<|assistant|>\nHel")
    status, _, text = http(served, "POST", "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert (status, text) == (200, {"prompt": "Hello, world"})
    for path, bad, param in (("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
                             ("/tokenize", {"prompt": 5}, "prompt"),
                             ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                             ("/detokenize", {"tokens": [1], "model": "gpt-4"}, "model")):
        status, _, body = http(served, "POST", path, bad)
        assert status in (400, 404) and body["error"]["param"] == param, (path, bad, body)


def test_vllms_sampling_extensions_are_taken_at_what_we_do(served):
    client = api(served)
    ok = dict(model=MODEL, max_tokens=2, extra_body=dict(skip_special_tokens=True, spaces_between_special_tokens=True))
    assert client.completions.create(prompt="x", echo=True, **ok).choices[0].text.startswith("x")
    messages = [{"role": "user", "content": "x"}]
    extra = dict(add_generation_prompt=True, continue_final_message=False, echo=False, chat_template_kwargs={})
    assert client.chat.completions.create(messages=messages, model=MODEL, max_tokens=2, extra_body=extra).choices
    # no max_tokens: up to the context's end, which an API server's request must not be refused for
    # (a favoured stop token ends it at once)
    r = client.chat.completions.create(messages=messages, model=MODEL,
                                       extra_body=dict(stop_token_ids=[65], logit_bias={"65": 100}))
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 1)
    for field, value in (("skip_special_tokens", False), ("echo", True)):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(messages=messages, model=MODEL, max_tokens=2, extra_body={field: value})
        assert e.value.body["param"] == field and "not supported" in e.value.body["message"]


def test_a_chat_continues_its_last_message_as_vllms_continue_final_message(served, engine):
    """continue_final_message: the model goes on with a started answer, its prompt the template's
    up to where that message's text ends; add_generation_prompt=false alone: no assistant turn opened."""
    started = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    client = api(served)
    for extra in (dict(add_generation_prompt=False, continue_final_message=True), dict(add_generation_prompt=False)):
        ids = engine.tokenizer.encode_chat(started, **extra)
        r = client.chat.completions.create(messages=started, model=MODEL, max_tokens=6, temperature=0,
                                           extra_body=extra)
        assert r.choices[0].message.content == reference(engine, ids, max_tokens=6, temperature=0).text, extra
    assert bytes(ids).endswith(b"Hel\n") and not bytes(ids).endswith(b"<|assistant|>\n")
    with pytest.raises(openai.BadRequestError) as e:  # add_generation_prompt is true unless said
        client.chat.completions.create(messages=started, model=MODEL, max_tokens=2,
                                       extra_body=dict(continue_final_message=True))
    assert e.value.body["param"] == "continue_final_message" and "add_generation_prompt=false" in e.value.body[
        "message"]


# ----------------------------------------------------------------------------- metrics


def scrape(c) -> dict:
    """{(name, frozenset(labels)): value} of every sample."""
    status, headers, text = http(c, "GET", "/metrics", key=None)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, model_name=ALIAS, **labels) -> float:
    """The sum of name's samples with these labels; model_name: the first --served-model-name of
    the `served` fixture's cluster, or --model of one started without it."""
    want = dict(model_name=model_name, **labels)
    return sum(v for (n, ls), v in samples.items() if n == name and want.items() <= dict(ls).items())


def settled(c) -> dict:
    """The metrics once the workers' counters stop moving: an earlier test's cancelled requests may
    still be leaving the workers, and their counters come with the next heartbeats. (The router
    process's own, process_* and python_gc_*, move all the time.)"""
    ours = lambda samples: {k: v for k, v in samples.items() if k[0].startswith("pdserve:")}  # noqa: E731
    deadline = time.monotonic() + 10
    last = scrape(c)
    while True:
        time.sleep(0.5)  # two heartbeats or more
        now = scrape(c)
        if ours(now) == ours(last) or time.monotonic() > deadline:
            return now
        last = now


def test_metrics_parse_and_count_known_requests(served):
    client = api(served)
    long_prompt = list(range(1, 100))
    before = settled(served)
    for _ in range(2):  # the second one finds the first one's blocks in the prefill's prefix cache
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=5, extra_body=dict(ignore_eos=True))
    client.completions.create(model=MODEL, prompt="hey", max_tokens=7, temperature=0, stop=["\x00\x01"],
                              extra_body=dict(ignore_eos=True))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hey", max_tokens=0)
    assert http(served, "GET", "/v1/models", key="wrong")[0] == 401  # refused before the router: counted too
    assert http(served, "GET", "/v1/completions")[0] == 405
    assert http(served, "GET", "/v1/embeddings")[0] == 404
    assert http(served, "GET", "/v1/models/gpt-4")[0] == 404  # a model not served
    assert http(served, "GET", "/favicon.ico", key=None)[0] == 404  # not the API's: not counted
    after = settled(served)  # the workers' counters come with their heartbeats

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("pdserve:request_success_total", finished_reason="length") == 3
    assert grew("pdserve:request_errors_total", code="INVALID_ARGUMENT") == 1
    for code, n in (("UNAUTHENTICATED", 1), ("METHOD_NOT_ALLOWED", 1), ("NOT_FOUND", 2)):
        assert grew("pdserve:request_errors_total", code=code) == n, code
    assert grew("pdserve:prompt_tokens_total") == 2 * 99 + 3
    assert grew("pdserve:generation_tokens_total") == 5 + 5 + 7
    assert grew("pdserve:request_prompt_tokens_sum") == 2 * 99 + 3  # vLLM's per-request histograms
    assert grew("pdserve:request_generation_tokens_sum") == 5 + 5 + 7
    assert grew("pdserve:request_prompt_tokens_bucket", le="100.0") == 3  # 1, 2, 5, ... 1000: the context's
    assert grew("pdserve:request_prompt_tokens_bucket", le="50.0") == 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "kv_handoff_seconds", "request_time_per_output_token_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert grew(f"pdserve:{name}_count") == 3, name
    assert grew("pdserve:inter_token_latency_seconds_count") == 4 + 4 + 6
    assert grew("pdserve:prefix_cache_hits_total") >= 96  # six full 16-token blocks of the repeated prompt
    assert grew("pdserve:prefix_cache_queries_total") == 2 * 99 + 3
    assert grew("pdserve:kv_transfer_bytes_total") > 0
    for role in ("prefill", "decode"):
        worker = dict(worker_id=f"{role}-0", role=role)
        assert value(after, "pdserve:worker_alive", **worker) == 1
        assert value(after, "pdserve:worker_kv_blocks_total", **worker) > 0
        assert value(after, "pdserve:worker_kv_blocks_used", **worker) == 0
    assert value(after, "pdserve:num_requests_running") == value(after, "pdserve:num_requests_waiting") == 0
    # ours, and the router process's own (as prometheus_client's default registry has them)
    assert all(re.fullmatch(r"pdserve:[a-z0-9_]+|(process|python)_[a-z0-9_]+", n) for n, _ in after)


def test_a_dead_workers_gauges_and_status_read_idle_not_its_last_heartbeat():
    """A worker declared dead kept its last heartbeat's load in its per-worker gauges and in
    `status --json` for the 5 minutes it is remembered: a panel summing running requests or KV in
    use showed load that had moved to other workers, or gone."""
    from router.metrics import _StateCollector
    from tests.cluster import scripted_worker, serving_router

    async def scenario():
        async with serving_router(model=MODEL, heartbeat_timeout_s=0.5) as (router, connect):
            worker = await scripted_worker(router, connect, "decode-0", role="decode")
            await worker.send(P.Heartbeat("decode-0", "1", queued=2, running=6, free_blocks=10, total_blocks=64,
                                          held=1))
            views = []
            w = router.registry.workers["decode-0"]
            for seen in (lambda: w.running == 6, lambda: not w.alive):  # its heartbeat read; then dead
                deadline = time.monotonic() + 10
                while not seen():
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                gauges = {(m.name, s.labels["worker_id"]): s.value for m in _StateCollector(router, MODEL).collect()
                          for s in m.samples if "worker_id" in s.labels}
                views.append((gauges, w.describe(time.monotonic())))
            return views

    (live, live_status), (dead, dead_status) = asyncio.run(scenario())
    key = lambda name: (f"pdserve:{name}", "decode-0")  # noqa: E731
    assert [live[key(n)] for n in ("worker_num_requests_running", "worker_num_requests_waiting",
                                   "worker_kv_blocks_used")] == [6, 3, 54]
    assert [dead[key(n)] for n in ("worker_alive", "worker_num_requests_running", "worker_num_requests_waiting",
                                   "worker_kv_blocks_used", "kv_cache_usage_perc")] == [0, 0, 0, 0, 0]
    assert (live_status["running"], dead_status["running"], dead_status["free_blocks"]) == (6, 0, 64)


def test_metrics_have_every_finish_reason_preemptions_the_process_and_no_worker_that_left():
    """As vLLM's: request_success_total's finish reasons there from the start (rate() and absent()
    work at once), num_preemptions_total from the workers' heartbeats, the process's own metrics. A
    worker stopped as it was told leaves the per-worker gauges: a scale-down is no outage."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.cluster import scripted_worker, serving_router

    def samples(router) -> dict:
        return {(s.name, s.labels.get("finished_reason") or s.labels.get("worker_id")): s.value
                for family in text_string_to_metric_families(router.metrics.render().decode())
                for s in family.samples}

    async def scenario():
        async with serving_router(model=MODEL) as (router, connect):
            fresh = samples(router)
            staying = await scripted_worker(router, connect, "decode-0", role="decode")
            leaving = await scripted_worker(router, connect, "decode-1", role="decode")
            for preempted in (3, 5):  # counted since the worker registered
                await staying.send(P.Heartbeat("decode-0", "1", 0, 0, 64, 64, preemptions=preempted))
            await leaving.send(P.Leaving("decode-1", gone=True, idle=True))
            deadline = time.monotonic() + 10
            while not router.registry.workers["decode-1"].left or samples(router)[
                    ("pdserve:num_preemptions_total", None)] < 5:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            return fresh, samples(router)

    fresh, after = asyncio.run(scenario())
    assert [fresh[("pdserve:request_success_total", r)] for r in ("stop", "length", "abort")] == [0, 0, 0]
    assert fresh[("process_resident_memory_bytes", None)] > 0 and ("python_gc_collections_total", None) in fresh
    assert after[("pdserve:num_preemptions_total", None)] == 5
    assert after[("pdserve:worker_alive", "decode-0")] == 1 and ("pdserve:worker_alive", "decode-1") not in after


def test_metrics_take_vllms_prefix_for_tools_made_for_vllm():
    """--metrics-prefix vllm: an autoscaler's query (KEDA's vllm:num_requests_waiting) or a
    gateway's (vllm:kv_cache_usage_perc) finds ours under vLLM's names, and no pdserve: name is left."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.cluster import scripted_worker, serving_router

    async def scenario():
        async with serving_router(model=MODEL, metrics_prefix="vllm") as (router, connect):
            await scripted_worker(router, connect, "decode-0", role="decode")
            return {s.name for f in text_string_to_metric_families(router.metrics.render().decode()) for s in f.samples}

    names = asyncio.run(scenario())
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds_bucket", "vllm:request_success_total"} <= names, names
    assert not any(n.startswith("pdserve:") for n in names), names


def test_request_gauges_count_what_workers_run_and_the_rest_as_waiting():
    """vLLM's meanings: running is what the workers' batches hold (their heartbeats), waiting the
    rest the router admitted: in its queue, in a worker's queue, or waiting for decode room. They
    used to count every dispatched request as running (536 with a decode batch of 64)."""
    from types import SimpleNamespace

    from router.metrics import _StateCollector

    worker = lambda running, alive=True: SimpleNamespace(  # noqa: E731
        worker_id=f"w{running}", role="decode", alive=alive, left=False, running=running, queued=1,
        held=running // 3, total_blocks=8, free_blocks=8)
    router = SimpleNamespace(cfg=SimpleNamespace(model=MODEL), requests=dict.fromkeys(range(536)),
                             registry=SimpleNamespace(workers={"a": worker(64), "b": worker(3), "c": worker(9, False)}))
    gauges = {m.name: m.samples[0].value for m in _StateCollector(router, MODEL).collect()
              if m.name.startswith("pdserve:num")}
    assert gauges == {"pdserve:num_requests_running": 67, "pdserve:num_requests_waiting": 536 - 67}
    # a worker's waiting: queued for its steps, and prefilled requests it holds KV for (P.Heartbeat.held)
    waiting = {s.labels["worker_id"]: s.value for m in _StateCollector(router, MODEL).collect()
               if m.name == "pdserve:worker_num_requests_waiting" for s in m.samples}
    assert waiting == {"w64": 1 + 21, "w3": 1 + 1, "w9": 1 + 3}


def test_bench_serve_drives_the_http_api(served, capsys):
    from bench.serve import run_serve_bench

    result = run_serve_bench(MODEL, [], ["smoke_test"], None, 0, [], base_url=served.http_url, api_key=KEY)
    (row,) = result["results"]
    assert (row["frontend"], row["requests"], row["output_tokens"]) == ("http", 4, 4 * 8)
    assert row["ttft_p50_ms"] > 0 and row["output_tok_s"] > 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    for key in (None, "wrong"):  # was a RuntimeError's traceback
        with pytest.raises(RequestError, match="UNAUTHENTICATED: GET .*/v1/models answered 401 .*pass the server's "
                                               "--api-key"):
            run_serve_bench(MODEL, [], ["smoke_test"], None, 0, [], base_url=served.http_url, api_key=key)


def test_bench_serve_runs_find_no_prompt_of_another_in_the_caches(served):
    """The warm-up and every repeat sent the same prompts: the second run found its prompts cached
    (50% of them, here), which cut its TTFT."""
    from bench.serve import run_serve_bench

    result = run_serve_bench(MODEL, [], ["long_prompts"], served.address, 7, [], repeats=2)
    assert [r["requests"] for r in result["results"]] == [6, 6]
    assert [r["prompt_cached_pct"] for r in result["results"]] == [0.0, 0.0]
    # the router's own policy, from its status (so that prefix_affine's mispredictions are counted): was "-"
    assert [(r["policy"], r["kv_events"]) for r in result["results"]] == [("least_loaded", True)] * 2


def test_the_router_serves_all_of_this_without_torch(served):
    """Run after the tests above, which drove the router's every path (chat, logprobs, stop strings,
    metrics): it never loaded torch, so it starts in a fraction of a second and leaves the cores
    and memory to the workers."""
    api_servers = router_children(served)
    assert len(api_servers) == (served.api_server_count if served.api_server_count > 1 else 0)
    for pid in [served.router.proc.pid, *api_servers]:
        maps = pathlib.Path(f"/proc/{pid}/maps").read_text()
        assert "libzmq" in maps and "libtorch" not in maps


# ----------------------------------------------------------------------------- without workers, and failures


@pytest.mark.parametrize("api_servers", [1, 2], ids=["in-router", "api-servers"])
def test_health_and_requests_are_503_without_workers(tmp_path, api_servers):
    import subprocess
    import sys

    from router.launcher import free_port

    port, http_port = free_port(), free_port()
    router = subprocess.Popen([sys.executable, "-m", "common.cli", "router", "--port", str(port), "--worker-port",
                               str(free_port()), "--http-port", str(http_port), "--api-server-count", str(api_servers)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    class Bare:
        http_url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, _, body = http(Bare, "GET", "/health", key=None)
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline and router.poll() is None
                time.sleep(0.2)
        assert status == 503 and body["error"]["code"] == "UNAVAILABLE"
        assert http(Bare, "POST", "/ping", key=None)[0] == 503
        status, _, body = http(Bare, "POST", "/v1/completions", dict(prompt="hi"), key=None)
        assert status == 503 and body["error"]["message"] == "no worker has registered"
    finally:
        stop(router)


def test_migration_after_a_worker_death_keeps_tokens_and_logprobs_exact(tmp_path, engine):
    """A decode worker SIGKILLed mid-stream: its requests re-prefill elsewhere and finish with the
    fault-free tokens and logprobs, streamed without a gap or a repeat."""
    failover = ["--heartbeat-timeout", "0.6", "--decode-stall-timeout", "10", "--max-attempts", "10"]
    prompts = [[(5 * i + j) % 250 + 1 for j in range(12 + 3 * i)] for i in range(4)]
    want = [reference(engine, p, max_tokens=80, ignore_eos=True, temperature=0.8, seed=i, logprobs=2)
            for i, p in enumerate(prompts)]
    with cluster(tmp_path, prefill=1, decode=2, router_args=failover, http=True) as c:
        client = openai.OpenAI(base_url=c.http_url + "/v1", api_key="none", max_retries=0, timeout=120)
        streams = [client.completions.create(model=MODEL, prompt=p, max_tokens=80, temperature=0.8, seed=i, logprobs=2,
                                             stream=True, extra_headers={"X-Request-Id": f"job-{i}"},
                                             extra_body=dict(ignore_eos=True, return_tokens_as_token_ids=True))
                   for i, p in enumerate(prompts)]
        firsts = [next(iter(s)) for s in streams]  # every request is decoding
        assert [f.id.rsplit("-", 1)[0] for f in firsts] == [f"cmpl-job-{i}" for i in range(4)]
        assert [s.response.headers["X-Request-Id"] for s in streams] == [f"job-{i}" for i in range(4)]
        c.workers[1].proc.send_signal(signal.SIGKILL)  # decode-0
        for s, first, w in zip(streams, firsts, want):
            chunks = [first] + list(s)
            lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
            assert ids_of([t for lp in lps for t in lp.tokens]) == w.token_ids
            got = [x for lp in lps for x in lp.token_logprobs]
            assert got == pytest.approx([e[0] for e in w.logprobs], abs=1e-4)
        with Client(c.address) as sdk:
            assert any(not w["alive"] for w in sdk.status().workers)
        metrics = scrape(c)
        assert value(metrics, "pdserve:request_migrations_total", MODEL) >= 1
        assert value(metrics, "pdserve:worker_deaths_total", MODEL) == 1
    # the router's log names each migrated request by the client's X-Request-Id, and where it went
    moved = re.findall(r"request (job-\d)-\w+-0 \(#[0-9a-f]{6}-\d+\) attempt 1 failed \(worker decode-0 [^)]*\); "
                       r"attempt 2 on prefill-0 -> decode-1, carrying its \d+ delivered tokens",
                       (tmp_path / "logs" / "router.log").read_text())
    assert moved and set(moved) <= {f"job-{i}" for i in range(4)}, moved


def test_a_restarted_worker_is_one_death_and_a_stalled_router_loses_no_worker(tmp_path):
    """A worker killed and restarted by the launcher is one death, not one at its silence and one
    more when its new incarnation registers. A router held up (here SIGSTOPped) past the heartbeat
    timeout does not take its own stall for its workers' silence."""
    with cluster(tmp_path, prefill=0, decode=0, mono=1, restart=True, http=True,
                 router_args=["--heartbeat-timeout", "1"]) as c, Client(c.address, timeout=60) as sdk:
        (before,) = sdk.status().workers
        c.workers[0].proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            c.supervise_once()  # what pdserve launch does: restart what died
            (w,) = sdk.status().workers
            if w["alive"] and w["incarnation"] != before["incarnation"]:
                break
            assert time.monotonic() < deadline, w
            time.sleep(0.2)
        assert value(scrape(c), "pdserve:worker_deaths_total", MODEL) == 1
        c.router.proc.send_signal(signal.SIGSTOP)
        time.sleep(2.5)
        c.router.proc.send_signal(signal.SIGCONT)
        time.sleep(1.5)
        assert sdk.status().workers[0]["alive"] and value(scrape(c), "pdserve:worker_deaths_total", MODEL) == 1
        assert len(sdk.generate([1, 2, 3], max_tokens=3).token_ids) == 3
    assert "event loop was held up" in (tmp_path / "logs" / "router.log").read_text()
