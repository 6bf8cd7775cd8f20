"""Loopback by default, and with CURVE keys every socket is authenticated: an unknown peer can
neither submit requests, nor register, nor push KV."""

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
import zmq
import zmq.auth

from common import protocol as P
from common.errors import InvalidArgument
from common.security import create_keys
import router.connection
from router.client import AsyncClient, Client, RequestError
from tests.cluster import cluster
from tests.test_chaos import wait_for

pytestmark = pytest.mark.timeout(300)


def rogue(address: str, server_public: bytes | None, keys_dir=None, role: str = "client") -> zmq.Socket:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys_dir is not None:
        pub, sec = zmq.auth.load_certificate(str(keys_dir / f"{role}.key_secret"))
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, pub, sec
    sock.connect(address)
    return sock


def test_curve_keeps_unknown_peers_out(tmp_path, monkeypatch):
    keys = create_keys(tmp_path / "keys")
    intruder_keys = create_keys(tmp_path / "intruder")  # a valid keypair, but not authorized
    monkeypatch.setenv("PDSERVE_CURVE_DIR", str(keys))
    with cluster(tmp_path) as c, Client(c.address, timeout=60) as client:
        r = client.generate([1, 2, 3], max_tokens=4, temperature=0, ignore_eos=True)
        assert len(r.token_ids) == 4
        workers = client.status().workers
        decode = next(w for w in workers if w["role"] == "decode")
        assert all(w["kv_address"].startswith("tcp://127.0.0.1:") for w in workers if w["kv_address"])
        server_public, _ = zmq.auth.load_certificate(str(keys / "server.key"))
        worker_public, _ = zmq.auth.load_certificate(str(keys / "worker.key"))
        layout = {"layers": 4, "kv_heads": 4, "head_dim": 16, "block_size": 16, "dtype": "float32",
                  "model": "dummy:nanogpt"}
        register = P.Register("decode", "evil", "1", "cpu", 10, 16, "tcp://127.0.0.1:1")
        attempts = [
            (c.address, server_public, P.Generate("x", [1, 2, 3], {}, True), None),
            (f"tcp://127.0.0.1:{c.worker_port}", server_public, register, keys),  # a client's key: not a worker's
            (decode["kv_address"], worker_public, P.KVReserve("x", 1, 10, layout), keys),
        ]
        socks = []
        for address, public, msg, client_keys in attempts:
            for sock in (rogue(address, None), rogue(address, public, intruder_keys),
                         rogue(address, public, intruder_keys, "worker")):
                sock.send(P.encode(msg))
                socks.append(sock)
            if client_keys is not None:
                socks.append(rogue(address, public, client_keys))
                socks[-1].send(P.encode(msg))
        time.sleep(2.0)
        assert not any(s.poll(0) for s in socks), "an unauthenticated peer got an answer"
        workers = client.status().workers
        assert sorted(w["worker_id"] for w in workers) == ["decode-0", "prefill-0"]  # no "evil"
        assert all(w["free_blocks"] == w["total_blocks"] for w in workers)  # nothing was reserved
        for s in socks:
            s.close()
        # An SDK client whose key the router refuses, or that holds another server key, hears so
        # at once instead of waiting out CONNECT_TIMEOUT_S (10 s) for "no router answers".
        unauthorized = tmp_path / "unauthorized"  # the router's server.key, a client key of its own
        shutil.copytree(intruder_keys, unauthorized)
        (unauthorized / "server.key").write_bytes((keys / "server.key").read_bytes())
        (unauthorized / "server.key_secret").unlink()
        for directory, why in ((unauthorized, "it refused this client's CURVE key"),
                               (intruder_keys, "the server.key here is not its own")):
            monkeypatch.setenv("PDSERVE_CURVE_DIR", str(directory))
            began = time.monotonic()
            with pytest.raises(RequestError) as e, Client(c.address, timeout=60) as intruder:
                intruder.generate([1, 2, 3], max_tokens=2)
            assert e.value.code == "UNAVAILABLE" and why in e.value.message, e.value
            assert time.monotonic() - began < router.connection.CONNECT_TIMEOUT_S / 2
        # Nor does one without keys hang: it used to send a Cancel on a socket left with no
        # connection (the refused handshake), and that send waited for good (6 runs in 20).
        monkeypatch.delenv("PDSERVE_CURVE_DIR")
        monkeypatch.setattr(router.connection, "CONNECT_TIMEOUT_S", 0.25)  # the router never answers these
        outcomes = []

        def keyless():
            for _ in range(10):
                with Client(c.address, timeout=60) as plain:
                    try:
                        plain.generate([1, 2, 3], max_tokens=2)
                    except RequestError as err:
                        outcomes.append(err.code)
        runner = threading.Thread(target=keyless, daemon=True)
        runner.start()
        runner.join(60)
        assert not runner.is_alive(), f"a keyless client hung after {len(outcomes)} refusals"
        assert outcomes == ["UNAVAILABLE"] * 10


def test_a_send_after_a_refused_handshake_fails_rather_than_waits(monkeypatch):
    """After a handshake refused before the first send (1 run in 60 of the keyless loop above,
    under load), libzmq stops trying, and a send with no connection to queue on waited for good.
    Made certain here by a peer that greets as a CURVE server and then holds the connection (a
    router closes it, and a close seen first has libzmq try again)."""
    monkeypatch.delenv("PDSERVE_CURVE_DIR", raising=False)
    monkeypatch.setattr(router.connection, "CONNECT_TIMEOUT_S", 3.0)  # longer than the wait for the refusal
    server, held = socket.create_server(("127.0.0.1", 0)), []

    def greet_as_curve_server():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            held.append(conn)  # ZMTP 3.0's greeting: signature, version, mechanism, as-server, filler
            conn.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + b"\x01" + bytes(31))

    threading.Thread(target=greet_as_curve_server, daemon=True).start()
    address = "tcp://127.0.0.1:%d" % server.getsockname()[1]
    try:
        with Client(address, timeout=60) as client:
            monkeypatch.setattr(client.connection, "drain", lambda: False)  # the refusal not yet seen
            time.sleep(1.0)
            outcomes = []

            def calls():  # libzmq takes messages until it next reads its commands, then none
                for call in (client.submit, client.submit, client.submit, client.status):
                    outcomes.append(refused(call, *([[1, 2, 3]] if call == client.submit else [])))
                    time.sleep(0.1)

            sent = threading.Thread(target=calls, daemon=True)
            sent.start()
            sent.join(30)
            assert not sent.is_alive(), f"a send after a refused handshake waited for good ({outcomes})"
        assert outcomes[-2:] == ["UNAVAILABLE"] * 2 and set(outcomes) <= {"UNAVAILABLE", "none raised"}, outcomes

        async def submit_async():
            async with AsyncClient(address, timeout=60) as client:
                await asyncio.sleep(1.0)
                errors = []
                for call in (client.submit([1, 2, 3]), client.submit([1, 2, 3]), client.status()):
                    try:
                        await asyncio.wait_for(call, 30)
                    except RequestError as e:
                        errors.append(e)
                    await asyncio.sleep(0.1)
                return errors

        errors = asyncio.run(submit_async())
        assert len(errors) >= 2 and all(e.code == "UNAVAILABLE" and "one side uses CURVE keys" in e.message
                                        for e in errors), errors
    finally:
        server.close()
        for conn in held:
            conn.close()


def test_a_request_whose_send_waits_is_not_lost_when_the_connection_drops_meanwhile(monkeypatch):
    """A send waiting for the socket (the router reads nothing) when the connection drops goes once
    the router is back (libzmq keeps it), and its reply is read: it was marked lost, its id closed,
    and the router ran it to its end for nobody."""
    monkeypatch.delenv("PDSERVE_CURVE_DIR", raising=False)
    ctx = zmq.Context()
    stalled = ctx.socket(zmq.ROUTER)
    stalled.setsockopt(zmq.LINGER, 0)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    port = stalled.bind_to_random_port("tcp://127.0.0.1")
    back = ctx.socket(zmq.ROUTER)
    back.setsockopt(zmq.LINGER, 0)
    sent, stop = [], threading.Event()
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
            def fill():
                while not stop.is_set():
                    sent.append(client.submit("x" * 20000, max_tokens=1))

            filling = threading.Thread(target=fill, daemon=True)
            filling.start()
            try:
                counted = -1
                while counted != len(sent):  # until a send waits: nothing went for a second
                    counted = len(sent)
                    time.sleep(1.0)
                stop.set()
                stalled.close()
                wait_for(lambda: rebound(back, port), what="the port to be free again")
                got = {}
                while filling.is_alive() or sent[-1] not in got:
                    assert back.poll(30000), f"the waiting send never came ({len(got)} of {len(sent)} did)"
                    peer, head = back.recv_multipart()
                    got[P.decode(head).request_id] = peer
                last = sent[-1]
                back.send_multipart([got[last], P.encode(P.Error(last, "INVALID_ARGUMENT", "from the router"))])
                with pytest.raises(RequestError) as e:
                    client.wait(last)
                assert (e.value.code, e.value.message) == ("INVALID_ARGUMENT", "from the router"), e.value
            finally:  # the client's socket is the filling thread's until its send ends (it fails in 10 s)
                stop.set()
                filling.join(30)
    finally:
        stalled.close()
        back.close()
        ctx.term()


def rebound(sock: zmq.Socket, port: int) -> bool:
    """Whether sock could bind the port (a socket closed there a moment ago may still hold it)."""
    try:
        sock.bind(f"tcp://127.0.0.1:{port}")
        return True
    except zmq.ZMQError:
        return False


def refused(call, *args) -> str:
    """The code of the RequestError a call raised."""
    try:
        call(*args)
    except RequestError as e:
        return e.code
    return "none raised"


def test_a_worker_whose_key_the_router_refuses_says_so(tmp_path, monkeypatch):
    """It logged "no router has answered ... Is that the router's worker port?" every 10 s."""
    keys = create_keys(tmp_path / "keys")
    intruder = create_keys(tmp_path / "intruder")
    (intruder / "server.key").write_bytes((keys / "server.key").read_bytes())  # the router's, but its own key
    (intruder / "server.key_secret").unlink()
    monkeypatch.setenv("PDSERVE_CURVE_DIR", str(keys))
    with cluster(tmp_path, decode=0, prefill=0, mono=1) as c:
        env = dict(os.environ, PDSERVE_CURVE_DIR=str(intruder))
        proc = subprocess.Popen([sys.executable, "-m", "common.cli", "mono", "--router",
                                 f"tcp://127.0.0.1:{c.worker_port}", "--threads", "1"], env=env,
                                stderr=subprocess.PIPE, text=True)
        try:
            deadline, lines = time.monotonic() + 90, []
            while time.monotonic() < deadline:
                line = proc.stderr.readline()
                lines.append(line)
                if "refuses to talk" in line or not line:
                    break
            assert "it refused this worker's CURVE key (not among its authorized/workers/)" in lines[-1], lines[-5:]
        finally:
            proc.kill()
            proc.wait()
        with Client(c.address, timeout=60) as client:
            assert [w["worker_id"] for w in client.status().workers] == ["mono-0"]


def test_each_host_needs_only_its_roles_keys_and_secrets_are_private(tmp_path):
    from common.security import CurveKeys

    keys = create_keys(tmp_path / "keys")
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name in ("server", "worker", "client"):
        assert stat.S_IMODE((keys / f"{name}.key_secret").stat().st_mode) == 0o600
    worker_host = tmp_path / "worker-host"
    (worker_host / "authorized").mkdir(parents=True)
    shutil.copytree(keys / "authorized" / "workers", worker_host / "authorized" / "workers")
    for name in ("server.key", "worker.key_secret"):
        shutil.copy(keys / name, worker_host / name)
    CurveKeys.load(worker_host).check("worker", "kv_ingress", "kv_sender")
    with pytest.raises(InvalidArgument, match="client.key_secret is missing, and a client socket needs it"):
        CurveKeys.load(worker_host).check("client")
    client_host = tmp_path / "client-host"
    client_host.mkdir()
    for name in ("server.key", "client.key_secret"):
        shutil.copy(keys / name, client_host / name)
    CurveKeys.load(client_host).check("client")
    with pytest.raises(InvalidArgument, match="worker.key_secret is missing, and a worker socket needs it"):
        CurveKeys.load(client_host).check("worker")
    (client_host / "client.key_secret").write_text("garbage")
    with pytest.raises(InvalidArgument, match="client.key_secret cannot be read as a CURVE key"):
        CurveKeys.load(client_host)


def test_keys_already_in_a_directory_are_kept_unless_replace_is_given(tmp_path):
    from click.testing import CliRunner
    from common.cli import main

    d = tmp_path / "keys"
    assert CliRunner().invoke(main, ["keys", "--dir", str(d)]).exit_code == 0
    first = (d / "server.key").read_bytes()
    result = CliRunner().invoke(main, ["keys", "--dir", str(d)])
    assert result.exit_code != 0 and "already holds CURVE keys" in str(result.exception) + result.output
    assert (d / "server.key").read_bytes() == first
    assert CliRunner().invoke(main, ["keys", "--dir", str(d), "--replace"]).exit_code == 0
    assert (d / "server.key").read_bytes() != first
