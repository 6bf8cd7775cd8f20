"""TokenBatch: the router's replies to a worker's step go one message per client that asked for
them (the SDK does), not one per stream; each stream stays whole and in order, its Done behind its
last token, and a client that did not ask gets a Token per stream as before."""

import asyncio

from common import protocol as P
from router.client import Client
from router.connection import replies
from tests.cluster import cluster, scripted_worker, serving_router


def test_a_token_batch_round_trips_and_names_a_bad_item():
    items = [P.Token("a", 0, [5, 6], "hi"), P.Token("b", 3, [9], "", [[-0.5, [9], [-0.5]]], None)]
    batch = P.decode(P.encode(P.batch_tokens(items)))
    assert isinstance(batch, P.TokenBatch) and P.unbatch_tokens(batch) == items
    batch.items.append(["c", "not an index", [1]])
    assert "Token.index='not an index' has the wrong type" in str(P.unbatch_tokens(batch)[2])


def test_the_router_sends_a_step_s_tokens_one_message_per_client_that_asked_and_done_after_them():
    async def scenario():
        async with serving_router() as (router, connect):
            worker = await scripted_worker(router, connect, "mono-0")
            batched, single = connect(router.frontend.address), connect(router.frontend.address)
            for chan, rid, asks, prompt in ((batched, "a", True, [11, 12]), (batched, "b", True, [21, 22]),
                                            (single, "c", False, [31, 32])):
                await chan.send(P.Generate(rid, prompt, {"max_tokens": 2, "temperature": 0, "ignore_eos": True},
                                           True, token_batches=asks))
            work = [(await asyncio.wait_for(worker.arecv(), 10)).msg for _ in range(3)]
            assert all(isinstance(w, P.PrefillWork) for w in work), work
            # two steps, each a token for each request: its prompt echoed, the second ends it
            for i in range(2):
                await worker.send(P.batch_tokens([P.WorkerTokens(w.request_id, w.attempt, i, [w.token_ids[i]],
                                                                 "length" if i else None) for w in work]))
            got = {chan: [] for chan in (batched, single)}
            for chan, want in ((batched, 2), (single, 1)):
                while len([m for m in got[chan] if isinstance(m, P.Done)]) < want:
                    msg = (await asyncio.wait_for(chan.arecv(), 10)).msg
                    if not isinstance(msg, P.Probe):  # the router checking on a client still waiting
                        got[chan].append(msg)
            return got[batched], got[single]

    batched, single = asyncio.run(scenario())
    # the first step's two tokens in one TokenBatch; in the second, each Done sends the tokens
    # held before it first
    assert [type(m).__name__ for m in batched] == ["TokenBatch", "Token", "Done", "Token", "Done"], batched
    assert sorted(t.request_id for t in P.unbatch_tokens(batched[0])) == ["a", "b"]
    streams: dict[str, list] = {}
    for m in batched:
        for item in (P.unbatch_tokens(m) if isinstance(m, P.TokenBatch) else [m]):
            streams.setdefault(item.request_id, []).append(item)
    for rid, first, second in (("a", 11, 12), ("b", 21, 22)):
        tokens, done = streams[rid][:-1], streams[rid][-1]
        assert [(t.index, t.token_ids) for t in tokens] == [(0, [first]), (1, [second])], streams[rid]
        assert isinstance(done, P.Done) and done.token_ids == [first, second]
    assert [type(m).__name__ for m in single] == ["Token", "Token", "Done"], single
    assert [m.token_ids for m in single] == [[31], [32], [31, 32]]


def test_the_sdk_streams_many_requests_whole_through_token_batches(tmp_path):
    """A real cluster: concurrent SDK streams (their tokens batched by the router) give the same
    tokens and text as each request alone."""
    with cluster(tmp_path, prefill=0, decode=0, mono=1) as c, Client(c.address, timeout=120) as client:
        prompts = [f"request {i} says" for i in range(6)]
        alone = [client.generate(p, max_tokens=12, temperature=0, ignore_eos=True) for p in prompts]
        streams = [client.stream(p, max_tokens=12, temperature=0, ignore_eos=True) for p in prompts]
        chunks = {i: [] for i in range(len(prompts))}
        live = set(chunks)
        while live:  # read them interleaved, as they arrive
            for i in sorted(live):
                try:
                    chunks[i].append(next(streams[i]))
                except StopIteration:
                    live.discard(i)
    for i, want in enumerate(alone):
        got = chunks[i]
        assert [t for ch in got for t in ch.token_ids] == want.token_ids == streams[i].result.token_ids
        # the text streamed so far; a last incomplete character comes with the Result
        assert want.text.startswith("".join(ch.text for ch in got)) and streams[i].result.text == want.text
        assert [ch.index for ch in got] == [sum(len(x.token_ids) for x in got[:k]) for k in range(len(got))]


def test_a_token_with_prompt_logprobs_goes_alone_after_what_was_held():
    """prompt_logprobs are as long as the prompt: a batch of them could pass the client's message cap."""
    async def scenario():
        async with serving_router() as (router, connect):
            sent = []
            router._send = lambda chan, msg, to, quiet=False: sent.append((to, msg)) or True  # sent
            reply = router.clients.reply_to(b"c", True)
            with router.clients.batched():
                reply(P.Token("a", 0, [1]))
                reply(P.Token("b", 0, [2], prompt_logprobs=[None, [-0.5, [3], [-0.5]]]))
                reply(P.Token("a", 1, [4]))
                held = sent[:]  # what went before the batch's end
            return held, sent[len(held):]

    sent, at_end = asyncio.run(scenario())
    assert [(m.request_id, m.index) for _, m in sent] == [("a", 0), ("b", 0)]  # what was held, then "b" alone
    assert all(type(m) is P.Token for _, m in sent) and [(m.request_id, m.index) for _, m in at_end] == [("a", 1)]


def test_a_bad_item_of_a_token_batch_leaves_the_others_to_the_client():
    batch = P.batch_tokens([P.Token("a", 0, [1]), P.Token("b", 0, [2])])
    batch.items.insert(1, ["c", "no index", [3]])
    good, bad = replies(P.decode(P.encode(batch)))
    assert [m.request_id for m in good] == ["a", "b"] and len(bad) == 1 and "Token.index" in str(bad[0])
    assert replies(P.Done("a", "length", [1])) == ([P.Done("a", "length", [1])], [])
