"""Optional ZeroMQ CURVE authentication and encryption for every socket pdserve opens.

A key directory (made by `pdserve keys --dir DIR`) holds one server keypair, used by every socket
that binds (the router's two ports, each decode worker's KV ingress), one client keypair, used by
every socket that connects, and `authorized/`, the public keys allowed to connect. When
PDSERVE_CURVE_DIR names such a directory (the `--curve-dir` option sets it, and child processes
inherit it), every socket is encrypted and a peer whose key is not authorized cannot complete
the handshake: it can neither submit requests, register as a worker, nor push KV.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from common.errors import InvalidArgument

ENV = "PDSERVE_CURVE_DIR"


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes | None
    client_public: bytes
    client_secret: bytes
    authorized: Path

    @classmethod
    def load(cls, directory: str | Path) -> "CurveKeys":
        d = Path(directory)
        for name in ("server.key", "client.key_secret", "authorized"):
            if not (d / name).exists():
                raise InvalidArgument(f"{d / name} is missing; create the key directory with `pdserve keys --dir {d}`")
        server_public, _ = zmq.auth.load_certificate(str(d / "server.key"))
        server_secret = None
        if (d / "server.key_secret").exists():
            server_public, server_secret = zmq.auth.load_certificate(str(d / "server.key_secret"))
        client_public, client_secret = zmq.auth.load_certificate(str(d / "client.key_secret"))
        return cls(server_public, server_secret, client_public, client_secret, d / "authorized")


def create_keys(directory: str | Path, replace: bool = False) -> Path:
    """Keypairs into `directory`; keys already there are refused unless `replace`: every process
    still using them would be locked out."""
    d = Path(directory)
    there = [name for name in ("server.key", "server.key_secret", "client.key", "client.key_secret")
             if (d / name).exists()]
    if there and not replace:
        raise InvalidArgument(f"{d} already holds CURVE keys ({', '.join(there)}): new ones would lock out every "
                              "process using them; allowed: a new directory, or --replace")
    d.mkdir(parents=True, exist_ok=True)
    (d / "authorized").mkdir(exist_ok=True)
    zmq.auth.create_certificates(str(d), "server")
    zmq.auth.create_certificates(str(d), "client")
    shutil.copy(d / "client.key", d / "authorized" / "client.key")
    return d


_keys_cache: dict[str, CurveKeys] = {}
_authenticators: dict[int, object] = {}


def current_keys() -> CurveKeys | None:
    d = os.environ.get(ENV)
    if not d:
        return None
    if d not in _keys_cache:
        _keys_cache[d] = CurveKeys.load(d)
    return _keys_cache[d]


def secure(sock: zmq.Socket, ctx, server: bool) -> None:
    """Apply CURVE to a socket about to bind (server) or connect, if keys are configured."""
    keys = current_keys()
    if keys is None:
        return
    if server:
        if keys.server_secret is None:
            raise InvalidArgument(f"{ENV}={os.environ[ENV]} has no server.key_secret, needed to bind")
        _authenticator(ctx, keys)
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = keys.server_public, keys.server_secret
    else:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey, sock.curve_secretkey = keys.client_public, keys.client_secret


def _authenticator(ctx, keys: CurveKeys):
    """One ZAP authenticator per context, allowing only the authorized public keys."""
    if id(ctx) in _authenticators:
        return
    import zmq.asyncio

    if isinstance(ctx, zmq.asyncio.Context):
        from zmq.auth.asyncio import AsyncioAuthenticator as Auth
    else:
        from zmq.auth.thread import ThreadAuthenticator as Auth
    auth = Auth(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.authorized))
    _authenticators[id(ctx)] = auth


def close_context(ctx) -> None:
    """Terminate a context, its ZAP authenticator first: the authenticator holds a socket of the
    context open, and term() waits for every socket, so a process with CURVE on never exited."""
    auth = _authenticators.pop(id(ctx), None)
    if auth is not None:
        auth.stop()
    ctx.term()
