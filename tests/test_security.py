"""Loopback by default, and with CURVE keys every socket is authenticated: an unknown peer can
neither submit requests, nor register, nor push KV."""

import threading
import time

import pytest
import zmq
import zmq.auth

from common import protocol as P
from common.security import create_keys
import router.client
from router.client import Client, RequestError
from tests.cluster import cluster

pytestmark = pytest.mark.timeout(300)


def rogue(address: str, server_public: bytes | None, keys_dir=None) -> zmq.Socket:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys_dir is not None:
        pub, sec = zmq.auth.load_certificate(str(keys_dir / "client.key_secret"))
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
        layout = {"layers": 4, "kv_heads": 4, "head_dim": 16, "block_size": 16, "dtype": "float32",
                  "model": "dummy:nanogpt"}
        attempts = [
            (c.address, P.Generate("x", [1, 2, 3], {}, True)),
            (f"tcp://127.0.0.1:{c.worker_port}", P.Register("decode", "evil", "1", "cpu", 10, 16, "tcp://127.0.0.1:1")),
            (decode["kv_address"], P.KVReserve("x", 1, 10, layout)),
        ]
        socks = []
        for address, msg in attempts:
            for sock in (rogue(address, None), rogue(address, server_public, intruder_keys)):
                sock.send(P.encode(msg))
                socks.append(sock)
        time.sleep(2.0)
        assert not any(s.poll(0) for s in socks), "an unauthenticated peer got an answer"
        workers = client.status().workers
        assert sorted(w["worker_id"] for w in workers) == ["decode-0", "prefill-0"]  # no "evil"
        assert all(w["free_blocks"] == w["total_blocks"] for w in workers)  # nothing was reserved
        for s in socks:
            s.close()
        # An SDK client whose key the router refuses hears so, instead of waiting out its timeout.
        monkeypatch.setattr(router.client, "CONNECT_TIMEOUT_S", 1.0)
        monkeypatch.setenv("PDSERVE_CURVE_DIR", str(intruder_keys))
        with pytest.raises(RequestError) as e, Client(c.address, timeout=60) as intruder:
            intruder.generate([1, 2, 3], max_tokens=2)
        assert e.value.code == "UNAVAILABLE" and "CURVE key" in e.value.message, e.value
        # Nor does one without keys hang: it used to send a Cancel on a socket left with no
        # connection (the refused handshake), and that send waited for good (6 runs in 20).
        monkeypatch.delenv("PDSERVE_CURVE_DIR")
        monkeypatch.setattr(router.client, "CONNECT_TIMEOUT_S", 0.25)  # the router never answers these
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
