"""A model's generation_config.json gives the sampling a served request leaves out, as vLLM's
--generation-config auto does: over the SDK, HTTP in the router, and HTTP from API servers."""

import asyncio
import json

import pytest

from common import protocol as P
from common.errors import InvalidArgument
from common.generation_config import parse_overrides, sampling_defaults
from router.launcher import free_port
from router.openai_api import parse_chat, parse_completion
from tests.checkpoints import write_config_only
from tests.cluster import http_request, scripted_worker, serving_router

# What a Llama 3 Instruct checkpoint ships, with transformers' own defaults and fields we leave out
SHIPPED = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.0,
           "max_new_tokens": 100, "eos_token_id": [1, 2]}
TAKEN = {"temperature": 0.6, "top_p": 0.9}


@pytest.fixture
def model_dir(tmp_path):
    path = write_config_only(tmp_path / "model")
    (path / "generation_config.json").write_text(json.dumps(SHIPPED))
    return path


def test_the_models_sampling_fields_are_taken_unless_they_are_transformers_own(model_dir, tmp_path):
    assert sampling_defaults(str(model_dir)) == TAKEN
    assert sampling_defaults(str(model_dir), "vllm") == {}
    assert sampling_defaults("dummy:nanogpt") == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 20, "min_p": 0.05}))
    assert sampling_defaults(str(model_dir), str(other)) == {"top_k": 20, "min_p": 0.05}
    assert sampling_defaults(str(model_dir), overrides=parse_overrides('{"temperature": 0.2}')) == {
        "temperature": 0.2, "top_p": 0.9}
    with pytest.raises(InvalidArgument, match=r"--generation-config='nowhere' is invalid .*allowed: auto"):
        sampling_defaults(str(model_dir), "nowhere")
    for text, said in (('{"max_tokens": 5}', "sets 'max_tokens'; allowed: temperature, top_p"),
                       ("[1]", "is invalid; allowed: a JSON object"),
                       ('{"top_p": 2}', "--override-generation-config: top_p=2")):
        with pytest.raises(InvalidArgument, match=said):
            parse_overrides(text)
    (other / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(InvalidArgument, match=r"other/generation_config.json: temperature=-1"):
        sampling_defaults(str(model_dir), str(other))


def test_a_request_gives_what_it_gives_and_takes_the_rest():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    params = parse_chat(chat, "m", 1024, defaults=TAKEN).params
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 0)
    params = parse_completion({"prompt": "x", "temperature": 0, "top_p": None}, "m", TAKEN).params
    assert (params.temperature, params.top_p) == (0.0, 0.9)  # null is not given, as OpenAI's clients send it
    assert parse_completion({"prompt": "x"}, "m").params.temperature == 1.0  # no defaults: SamplingParams'


@pytest.mark.parametrize("api_servers", [1, 2])
def test_served_requests_that_leave_sampling_out_take_the_models(model_dir, api_servers):
    """What a worker is sent: the model's temperature and top_p where the request gave none, the
    request's own where it did; from SDK clients, the router's HTTP, and its API servers'."""

    async def scenario():
        http_port = free_port()
        async with serving_router(model=str(model_dir), http_port=http_port, api_server_count=api_servers) as (
                router, connect):
            worker = await scripted_worker(router, connect, "mono-0")
            client = connect(router.frontend.address)

            async def sent(submit) -> dict:
                await submit()
                while not isinstance(msg := (await asyncio.wait_for(worker.arecv(), 30)).msg, P.PrefillWork):
                    pass
                await worker.send(P.WorkerTokens(msg.request_id, msg.attempt, 0, [7], "length"))
                return msg.sampling

            async def sdk(sampling):
                await client.send(P.Generate("r", [1, 2, 3], sampling, False))

            async def over_http(body):
                url = f"http://127.0.0.1:{http_port}/v1/completions"
                asyncio.ensure_future(asyncio.to_thread(http_request, url, "POST", body, None))

            for submit, own in ((lambda: sdk({"max_tokens": 1}), {}),
                                (lambda: sdk({"max_tokens": 1, "temperature": 0.0, "top_p": None}), {"temperature": 0}),
                                (lambda: over_http({"prompt": [1, 2, 3], "max_tokens": 1}), {}),
                                (lambda: over_http({"prompt": [1, 2, 3], "max_tokens": 1, "top_p": 0.5}),
                                 {"top_p": 0.5})):
                sampling = await sent(submit)
                assert (sampling["temperature"], sampling["top_p"]) == (
                    own.get("temperature", 0.6), own.get("top_p", 0.9)), sampling
    asyncio.run(scenario())
