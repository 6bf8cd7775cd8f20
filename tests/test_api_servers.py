"""API server processes (--api-server-count) and clients that go away: a dead API server is
restarted and the requests it held are cancelled on the workers, a dead router takes its API
servers with it, and any ZeroMQ client the router can no longer reach has its requests cancelled
rather than decoded to their end for nobody. (test_http runs the whole HTTP API both in the router
and from API servers.)"""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import zmq
import zmq.asyncio
from click.testing import CliRunner

from common import protocol as P
from common.cli import main
from common.errors import InvalidArgument
from router.client import Client, RequestError
from router.drain import Drain
from router.openai_api import ApiError
from router.server import DEAD_WORKER_MEMORY_S, Router, RouterConfig
from tests.cluster import cluster, router_children, running, scripted_worker, serving_router, wait_blocks_free

pytestmark = pytest.mark.timeout(300)
MODEL = "dummy:nanogpt"


def test_a_client_the_router_cannot_reach_has_its_requests_cancelled():
    async def scenario():
        async with serving_router() as (router, connect):
            worker = await scripted_worker(router, connect, "mono-0")
            gone, stays = connect(router.frontend.address), connect(router.frontend.address)
            sampling = {"max_tokens": 1000, "temperature": 0, "ignore_eos": True}
            for chan, rid in ((gone, "a"), (gone, "b"), (stays, "c")):
                await chan.send(P.Generate(rid, [7, 8], sampling, True, token_batches=True))
            work = {}
            while len(work) < 3:
                msg = (await asyncio.wait_for(worker.arecv(), 10)).msg
                work[msg.request_id] = msg
            names = {rid: router.requests[rid].client_request_id for rid in work}
            gone.close()
            cancelled, step = set(), 0
            deadline = time.monotonic() + 10
            while len(cancelled) < 2:  # a step's tokens every 20 ms until the router gives up on "gone"
                assert time.monotonic() < deadline, f"cancelled only {cancelled}"
                await worker.send(P.batch_tokens([P.WorkerTokens(w.request_id, w.attempt, step, [5], None)
                                                  for rid, w in work.items() if names[rid] not in cancelled]))
                step += 1
                try:
                    msg = (await asyncio.wait_for(worker.arecv(), 0.02)).msg
                except asyncio.TimeoutError:
                    continue
                if isinstance(msg, P.CancelWork):
                    cancelled.add(names[msg.request_id])
            left = [r.client_request_id for r in router.requests.values()]
            got = []
            while len(got) < step:  # "c" was served all along
                reply = (await asyncio.wait_for(stays.arecv(), 10)).msg
                if not isinstance(reply, P.Probe):
                    got += P.unbatch_tokens(reply) if isinstance(reply, P.TokenBatch) else [reply]
            return cancelled, left, got

    cancelled, left, got = asyncio.run(scenario())
    assert cancelled == {"a", "b"} and left == ["c"]
    assert [t.index for t in got] == list(range(len(got))) and all(t.request_id == "c" for t in got)


async def gone_client_s_work(router, connect, max_tokens: int, stream: bool):
    """A mono worker, and the work of one request from a client that then closes its socket."""
    worker = await scripted_worker(router, connect, "mono-0")
    gone = connect(router.frontend.address)
    await gone.send(P.Generate("a", [7, 8], {"max_tokens": max_tokens, "ignore_eos": True}, stream,
                               token_batches=True))
    work = (await asyncio.wait_for(worker.arecv(), 10)).msg
    gone.close()
    return worker, work


@pytest.mark.parametrize("stream", [False, True], ids=["not-streamed", "streamed-before-its-first-token"])
def test_a_gone_client_whose_request_sends_it_nothing_is_found_by_a_probe(stream):
    """Nothing goes to such a client before its request ends (or begins), so no failed send would
    show it gone: the router probes it (an SDK client reads past the probe)."""
    async def scenario():
        async with serving_router() as (router, connect):
            worker, work = await gone_client_s_work(router, connect, 1000, stream=stream)
            closed = time.monotonic()
            while True:  # the worker sends nothing: the request would run on for nobody
                msg = (await asyncio.wait_for(worker.arecv(), 5)).msg
                if isinstance(msg, P.CancelWork):
                    return msg.request_id == work.request_id, time.monotonic() - closed, len(router.requests)

    cancelled, after_s, left = asyncio.run(scenario())
    assert cancelled and left == 0
    assert after_s < 3, f"found gone after {after_s:.1f}s"


def test_an_sdk_client_reads_past_probes():
    async def scenario():
        async with serving_router() as (router, connect):
            worker = await scripted_worker(router, connect, "mono-0")
            probes = []
            send = router.clients.send
            router.clients.send = lambda client, msg: (probes.append(msg) if isinstance(msg, P.Probe) else None,
                                                     send(client, msg))[1]
            client = await asyncio.to_thread(Client, router.frontend.address, 10)
            try:
                pending = asyncio.ensure_future(asyncio.to_thread(client.generate, [7, 8], max_tokens=2))
                work = (await asyncio.wait_for(worker.arecv(), 10)).msg
                await asyncio.sleep(1.5)  # probed meanwhile (the worker's heartbeat timeout is 2 s)
                await worker.send(P.WorkerTokens(work.request_id, work.attempt, 0, [5, 6], "length"))
                result = await pending
                status = await asyncio.to_thread(client.status)  # no probe filed as its reply
                assert isinstance(status, P.StatusReply), status
                return result, len(probes)
            finally:
                client.close()

    result, probes = asyncio.run(scenario())
    assert result.token_ids == [5, 6] and probes >= 1


def test_a_gone_client_s_request_that_ends_is_counted_once():
    """A reply that cannot be delivered finds the client gone; the request, which ends in the same
    batch, is finished once, as what it was ("length"), not also as "cancelled". (No probe here:
    it would find the client gone first.)"""
    async def scenario():
        async with serving_router() as (router, connect):
            router.clients._next_probe = float("inf")
            worker, work = await gone_client_s_work(router, connect, 1, stream=True)
            await asyncio.sleep(0.3)  # the router's socket drops the peer
            await worker.send(P.WorkerTokens(work.request_id, work.attempt, 0, [5], "length"))
            deadline = time.monotonic() + 5
            while router.requests:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # and anything it would do on the next turns
            return router.metrics.render().decode()

    metrics = asyncio.run(scenario())
    finished = re.findall(r'pdserve:request_success_total\{finished_reason="(\w+)",model_name="[^"]*"\} (\S+)', metrics)
    assert [f for f in finished if f[1] != "0.0"] == [("length", "1.0")], finished


@pytest.mark.parametrize("api_servers", [1, 2], ids=["in-router", "api-servers"])
def test_a_stopping_router_streams_on_through_its_drain_then_ends_with_unavailable(tmp_path, api_servers):
    with cluster(tmp_path, prefill=0, decode=0, mono=1, http=True, api_servers=api_servers,
                 router_args=["--drain-timeout", "0.3"]) as c:  # a 1,000-token stream outlasts it
        body = dict(model=MODEL, prompt="x", max_tokens=1000, stream=True, ignore_eos=True)

        async def scenario():
            async with aiohttp.ClientSession() as s:
                async with s.post(c.http_url + "/v1/completions", json=body) as r:
                    assert (await r.content.readline()).startswith(b"data: ")
                    c.router.proc.terminate()
                    events = [line async for line in r.content if line.startswith(b"data: ")]
                    return events[-2:]

        started = time.monotonic()
        error, done = asyncio.run(scenario())
        assert done == b"data: [DONE]\n" and b'"code": "UNAVAILABLE"' in error, error
        assert b"the router stopped before this request finished: its --drain-timeout, 0.3s, passed" in error, error
        assert c.router.proc.wait(10) == 0 and time.monotonic() - started < 8


def connections(pid: int, port: int) -> int:
    """Established TCP connections that process pid has accepted on port (from /proc)."""
    inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
              if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port, state, inode = int(fields[1].split(":")[1], 16), fields[3], fields[9]
        count += local_port == port and state == "01" and inode in inodes
    return count


def test_a_dead_api_server_is_restarted_and_its_requests_cancelled_while_the_other_serves_on(tmp_path):
    with cluster(tmp_path, http=True, api_servers=2, router_args=["--max-queue", "64"]) as c:
        port = int(c.http_url.rsplit(":", 1)[1])
        body = dict(model=MODEL, prompt="x" * 20, max_tokens=300, stream=True, ignore_eos=True, temperature=0)

        async def scenario():
            sessions = [aiohttp.ClientSession() for _ in range(8)]  # a connection each
            try:
                streams = [await s.post(c.http_url + "/v1/completions", json=body) for s in sessions]
                for r in streams:
                    assert r.status == 200 and (await r.content.readline()).startswith(b"data: ")
                servers = router_children(c)
                held = {pid: connections(pid, port) for pid in servers}
                assert sum(held.values()) == 8, held
                victim = max(held, key=held.get)
                os.kill(victim, signal.SIGKILL)
                finished = 0
                for r in streams:  # the victim's streams break; the others run to their end
                    try:
                        events = [line async for line in r.content if line.startswith(b"data: ")]
                        finished += events[-1] == b"data: [DONE]\n"
                    except aiohttp.ClientError:
                        pass
                assert finished == 8 - held[victim], (finished, held)
                return victim, held[victim]
            finally:
                for s in sessions:
                    await s.close()

        victim, lost = asyncio.run(scenario())
        with Client(c.address, timeout=30) as sdk:
            workers = wait_blocks_free(sdk)
            assert all(w["free_blocks"] == w["total_blocks"] for w in workers), workers
            assert sdk.status().in_flight == 0
        deadline = time.monotonic() + 20
        while len(servers := router_children(c)) < 2 or victim in servers:
            assert time.monotonic() < deadline, f"API server {victim} was not restarted: {servers}"
            time.sleep(0.2)

        async def after():  # both API servers serve again (the restarted one may take a moment to accept)
            async with aiohttp.ClientSession() as s:
                for _ in range(4):
                    async with s.post(c.http_url + "/v1/completions", json=body | {"stream": False, "max_tokens": 4},
                                      headers={"Connection": "close"}) as r:
                        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4

        asyncio.run(after())
        log = c.router.log_path.read_text()
        assert re.search(rf"API server \d \(pid {victim}\) was killed by SIGKILL; restarting it", log), log[-3000:]
        if lost:
            assert re.search(rf"is gone( \([^)]*\))?: its {lost} requests cancelled", log), log[-3000:]


def test_a_killed_router_takes_its_api_servers_along(tmp_path):
    with cluster(tmp_path, prefill=0, decode=0, mono=1, http=True, api_servers=2) as c:
        servers = router_children(c)
        assert len(servers) == 2
        c.router.proc.kill()
        c.router.proc.wait(10)
        deadline = time.monotonic() + 10
        while alive := [pid for pid in servers if running(pid)]:
            assert time.monotonic() < deadline, f"API servers {alive} outlived their router"
            time.sleep(0.1)


def test_api_server_count_must_be_positive_and_serve_a_port():
    result = CliRunner().invoke(main, ["router", "--http-port", "0", "--api-server-count", "0"])
    assert result.exit_code == 2 and "--api-server-count" in result.output and "0" in result.output
    r = subprocess.run([sys.executable, "-m", "common.cli", "router", "--port", "0", "--worker-port", "0",
                        "--api-server-count", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--api-server-count is for the HTTP API: give --http-port too" in r.stderr, r.stderr
    with pytest.raises(InvalidArgument, match="api_server_count=2 is invalid.* with an http_port"):
        Router(RouterConfig(port=0, worker_port=0, api_server_count=2))  # a router made in code checks it too


def test_a_router_whose_api_servers_cannot_start_says_so_and_exits(tmp_path):
    """aiohttp missing on the host (here a stand-in that fails to import): the API servers exit at
    start, and the router, which waits for them to serve before it is ready, fails naming that."""
    fake = tmp_path / "aiohttp"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise ImportError("no aiohttp here (a test stand-in)")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "common.cli", "router", "--port", "0", "--worker-port", "0",
                        "--http-port", "0", "--api-server-count", "2"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "no aiohttp here" in r.stderr and re.search(r"API server \d exited with 1 before it served", r.stderr)
    assert "router:" not in r.stdout  # never said it was ready


def test_a_dead_api_server_s_requests_are_cancelled_at_once_streamed_or_not(tmp_path):
    """Requests that are not streamed send nothing to their API server before they end, so the
    router cannot find it gone by a failed send: it knows the dead process's identity instead."""
    with cluster(tmp_path, http=True, api_servers=2, router_args=["--max-queue", "64"]) as c, \
            Client(c.address, timeout=30) as sdk:
        port = int(c.http_url.rsplit(":", 1)[1])
        body = dict(model=MODEL, prompt="x" * 20, max_tokens=900, ignore_eos=True, temperature=0)

        async def scenario():
            sessions = [aiohttp.ClientSession() for _ in range(8)]  # a connection each
            try:
                posts = [asyncio.ensure_future(s.post(c.http_url + "/v1/completions", json=body)) for s in sessions]
                deadline = time.monotonic() + 20
                while sdk.status().in_flight < 8:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                held = {pid: connections(pid, port) for pid in router_children(c)}
                assert sum(held.values()) == 8, held
                victim = max(held, key=held.get)
                os.kill(victim, signal.SIGKILL)
                killed = time.monotonic()
                while (left := sdk.status().in_flight) > 8 - held[victim]:
                    assert time.monotonic() - killed < 3, f"{left} requests in flight; the victim held {held[victim]}"
                    await asyncio.sleep(0.05)
                answers = await asyncio.gather(*posts, return_exceptions=True)
                return held[victim], left, [a for a in answers if not isinstance(a, Exception)]
            finally:
                for s in sessions:
                    await s.close()

        lost, left, answered = asyncio.run(scenario())
        assert left == 8 - lost and len(answered) == 8 - lost and all(a.status == 200 for a in answered)
        assert re.search(rf"is gone( \([^)]*\))?: its {lost} requests cancelled", c.router.log_path.read_text())


def test_the_workers_max_model_len_is_what_the_router_and_its_api_servers_admit(tmp_path):
    """--max-model-len given to the workers reaches the router (the launcher passes it on), which
    refuses past it over ZeroMQ and HTTP alike, and reports it in the model card."""
    with cluster(tmp_path, http=True, api_servers=2, worker_args=["--max-model-len", "128"]) as c, \
            Client(c.address, timeout=60) as client:
        with pytest.raises(RequestError, match="prompt has 130 tokens but the model.s maximum context length is 128 "
                                                    "tokens; allowed: at most 127"):
            client.generate([1] * 130, max_tokens=2)
        assert len(client.generate([1] * 60, max_tokens=500, ignore_eos=True).token_ids) == 68  # cut to fit

        async def scenario():
            async with aiohttp.ClientSession() as s:
                async with s.get(c.http_url + "/v1/models") as r:
                    card = (await r.json())["data"][0]
                out = []
                for prompt, max_tokens in (([1] * 130, 2), ([1] * 60, 69), ([1] * 60, 68)):
                    body = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, ignore_eos=True)
                    async with s.post(c.http_url + "/v1/completions", json=body) as r:
                        out.append((r.status, await r.json()))
                return card, out

        card, ((s1, e1), (s2, e2), (s3, ok)) = asyncio.run(scenario())
    assert card["max_model_len"] == 128
    assert s1 == 400 and e1["error"]["param"] == "prompt" and "at most 127" in e1["error"]["message"]
    assert s2 == 400 and "max_tokens=69 is too large" in e2["error"]["message"] and "length is 128" in e2["error"]["message"]
    assert s3 == 200 and ok["usage"]["completion_tokens"] == 68


def test_a_router_told_more_than_a_worker_serves_admits_what_it_serves(tmp_path):
    """A worker started with a shorter context (or a GPU worker whose pool holds less) lowers what
    the router admits: a longer prompt is refused by the router itself, and the log names the worker."""
    with cluster(tmp_path, prefill=0, decode=0, mono=1, worker_args=["--max-model-len", "128"],
                 router_args=["--max-model-len", "512"]) as c, Client(c.address, timeout=60) as client:
        with pytest.raises(RequestError, match=r"prompt has 130 tokens but the model's maximum context length is 128 "
                                                    "tokens; allowed: at most 127"):
            client.generate([1] * 130, max_tokens=2)
        assert len(client.generate([1] * 60, max_tokens=500, ignore_eos=True).token_ids) == 68
        assert [w["max_model_len"] for w in client.status().workers] == [128]
        table = CliRunner().invoke(main, ["status", "--router", c.address]).output.splitlines()
        assert table[0].endswith("admits a context of 128 tokens"), table
        assert "total blocks  context" in table[1] and table[3].split()[8:10] == ["512", "128"], table
    log = (tmp_path / "logs" / "router.log").read_text()
    assert "worker mono-0 serves a context of 128 tokens; the router admits 128 from now on (was 512)" in log


@pytest.mark.parametrize("api_servers", [1, 2], ids=["in-router", "api-servers"])
def test_a_pool_smaller_than_the_context_lowers_it_and_a_chat_without_max_tokens_is_served(tmp_path, api_servers):
    """--kv-cache-gb 0.001 holds 512 of dummy:nanogpt's 1,024 tokens. A chat without max_tokens
    asks for the whole context (vLLM's default): it had been refused, "request needs 64 KV blocks".
    API server processes follow the context the router admits, within a second."""
    with cluster(tmp_path, http=True, worker_args=["--kv-cache-gb", "0.001"], api_servers=api_servers) as c:
        def post(path, body=None):
            req = urllib.request.Request(c.http_url + path, None if body is None else json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        def cards():  # the API servers take connections as the kernel hands them out: ask several times
            return {post("/v1/models")[1]["data"][0]["max_model_len"] for _ in range(4 * api_servers)}

        deadline = time.monotonic() + 10
        while cards() != {512} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cards() == {512}
        status, chat = post("/v1/chat/completions", dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                          ignore_eos=True))
        too_long = [post("/v1/completions", dict(model=MODEL, prompt=[1] * 10, max_tokens=600))
                    for _ in range(4 * api_servers)]
    assert status == 200 and chat["choices"][0]["finish_reason"] == "length" and chat["usage"]["total_tokens"] == 512
    assert all(code == 400 and "max_tokens=600 is too large" in e["error"]["message"]
               and "length is 512" in e["error"]["message"] for code, e in too_long), too_long
    assert "max_model_len lowered from 1024 to 512 tokens" in (tmp_path / "logs" / "decode-0.log").read_text()


def test_the_router_admits_the_least_context_its_live_workers_serve(caplog):
    async def scenario():
        async with serving_router(max_model_len=512) as (router, connect):
            seen = []
            for name, context in (("mono-0", 256), ("mono-1", 128), ("mono-2", 0)):  # 0: an older worker, not said
                await scripted_worker(router, connect, name, max_model_len=context)
                seen.append(router.prompts.context)
            for name in ("mono-1", "mono-0"):  # dead, it still counts (it may come back); forgotten, no more
                router.worker_lost(router.registry.workers[name], "test")
                seen.append(router.prompts.context)
                router.registry.workers[name].last_seen -= DEAD_WORKER_MEMORY_S + 1
                router.tick(time.monotonic())
                seen.append(router.prompts.context)
            # one that left when told to stop counts no more at once, whether it drained first or not
            for name, drained in (("mono-3", True), ("mono-4", False)):
                await scripted_worker(router, connect, name, max_model_len=64)
                seen.append(router.prompts.context)
                w = router.registry.workers[name]
                if drained:
                    router.on_leaving(w, P.Leaving(name))
                    seen.append(router.prompts.context)
                router.on_leaving(w, P.Leaving(name, gone=True))
                seen.append(router.prompts.context)
            return seen

    with caplog.at_level("INFO", logger="pdserve.router"):
        assert asyncio.run(scenario()) == [256, 128, 128, 128, 256, 256, 512, 64, 64, 512, 64, 512]
    assert "no worker known serves less than 512 tokens now: the router admits 512 again" in caplog.text


def test_an_api_servers_health_counts_the_workers_that_take_work_as_the_routers_own_does():
    """/health's worker count: a worker that is leaving (draining, taking no new work) was counted
    by an API server, not by the router's own HTTP front. Both say whether the router is stopping."""
    from router.api_server import RouterLink
    from router.http import LocalBackend

    async def scenario():
        async with serving_router() as (router, connect):
            await scripted_worker(router, connect, "mono-0")
            leaving = await scripted_worker(router, connect, "mono-1")
            await leaving.send(P.Leaving("mono-1"))
            deadline = time.monotonic() + 10
            while not router.registry.workers["mono-1"].leaving:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            link = RouterLink(router.frontend.address, router.cfg.model, router.cfg.max_queue)
            link.start()
            try:
                serving = await LocalBackend(router).health(), await link.health()
                router.stopping = Drain(held=0, timeout_s=5)
                return serving, (await LocalBackend(router).health(), await link.health())
            finally:
                await link.close()

    serving, stopping = asyncio.run(scenario())
    assert serving == ((1, [], False),) * 2 and stopping == ((1, [], True),) * 2


def test_an_api_servers_status_call_that_gave_up_does_not_answer_the_next_one(monkeypatch):
    """A router's reply that comes after its call timed out is dropped: it answered the next call
    (replies were matched by type, first in first out, not by the call's ask_id)."""
    import router.api_server as api_server
    from common.channel import Channel

    monkeypatch.setattr(api_server, "ASK_TIMEOUT_S", 0.3)

    async def late_first_router(chan):
        n = 0
        while True:
            env = await chan.arecv()
            if isinstance(env.msg, P.StatusRequest):
                n += 1
                if n == 1:
                    await asyncio.sleep(0.5)
                chan.post(P.StatusReply([], queued=0, in_flight=0, ask_id=env.msg.ask_id, serving=n),  # reply n: n
                          to=env.sender)

    async def scenario():
        ctx = zmq.asyncio.Context()
        router = Channel.bind(ctx, zmq.ROUTER, "tcp://127.0.0.1:0")
        serving = asyncio.ensure_future(late_first_router(router))
        link = api_server.RouterLink(router.address, "dummy:nanogpt", 10)
        link._tasks = [asyncio.ensure_future(link._read())]  # no other status calls (start's context follower)
        try:
            with pytest.raises(ApiError, match="did not answer a StatusRequest"):
                await link.health()
            monkeypatch.setattr(api_server, "ASK_TIMEOUT_S", 10)  # the next calls wait for their replies
            return [(await link.health())[0] for _ in range(2)]
        finally:
            serving.cancel()
            await link.close()
            router.close()
            ctx.term()

    assert asyncio.run(scenario()) == [2, 3]
