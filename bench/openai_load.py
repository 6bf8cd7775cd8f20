"""The load of `pdserve bench serve` over HTTP, for any OpenAI-compatible server (pdserve's router
with --http-port, vLLM, SGLang, ...): the same requests as the SDK driver (bench/serve.py drive),
sent to POST /v1/completions as token-id prompts, greedy, ignore_eos, streamed, with
stream_options.include_usage so the token count comes from the server's usage. aiohttp, as vLLM's
own benchmark_serving uses: a light client matters when the load generator shares the machine.

A sample's first token is its first chunk with a choice; its inter-token gaps are between chunks
(a chunk may carry more than one token, which only usage tells).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from bench.serve import Sample
from router.client import RequestError


async def refused(method: str, url: str, r: aiohttp.ClientResponse) -> RequestError:
    """A server's refusal, as the CLI reports errors: its status and body, and for a 401 the flag."""
    text = (await r.text())[:500]
    if r.status == 401:
        return RequestError("UNAUTHENTICATED", f"{method} {url} answered 401 ({text}): pass the server's "
                                               "--api-key")
    return RequestError("UNAVAILABLE" if r.status >= 500 else "INVALID_ARGUMENT",
                        f"{method} {url} answered {r.status}: {text}")


async def served_model(session: aiohttp.ClientSession, base_url: str, headers: dict) -> str:
    try:
        async with session.get(f"{base_url}/v1/models", headers=headers) as r:
            if r.status != 200:
                raise await refused("GET", f"{base_url}/v1/models", r)
            return (await r.json())["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # refused, timed out, not a URL
        raise RequestError("UNAVAILABLE", f"no HTTP server answers at {base_url} ({type(e).__name__}: {e}): is "
                                          "one running there?") from None


def served_model_at(base_url: str, api_key: str | None) -> str:
    """The model the server at base_url serves (another server may name the checkpoint --model
    points at otherwise: the bench draws its prompts from --model's vocabulary and says both)."""
    async def ask():
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            return await served_model(session, base_url.rstrip("/").removesuffix("/v1"), headers)
    return asyncio.run(ask())


async def completion_chunks(session: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None):
    """Each chunk of one streamed POST (a completion or a chat), parsed, with its arrival time
    (time.perf_counter); a refused request raises."""
    async with session.post(url, json=body, headers=headers) as r:
        if r.status != 200:
            raise await refused("POST", url, r)
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                yield time.perf_counter(), json.loads(line[6:])


async def drive_http(base_url: str, requests, concurrency: int = 0, api_key: str | None = None
                     ) -> tuple[list[Sample], float]:
    base_url = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        model = await served_model(session, base_url, headers)
        gate = asyncio.Semaphore(concurrency or len(requests) or 1)
        start = time.perf_counter()

        async def one(offset, prompt, max_tokens) -> Sample:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            async with gate:
                s = Sample(time.perf_counter(), len(prompt))
                async for now, chunk in completion_chunks(session, f"{base_url}/v1/completions", body, headers):
                    if chunk.get("usage"):
                        s.tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices"):
                        s.first = s.first or now
                        s.token_times.append(now)
                s.end = time.perf_counter()
            return s

        samples = await asyncio.gather(*(one(*r) for r in requests))
        return list(samples), time.perf_counter() - start
