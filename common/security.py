"""Optional ZeroMQ CURVE authentication and encryption for every socket pdserve opens.

A key directory (made by `pdserve keys --dir DIR`) holds three keypairs, one per role, so that a
host trusted only to send requests cannot act as a worker:

- server: the router's two ports bind with it;
- worker: workers connect to the router's worker port with it, and a decode worker's KV ingress
  binds with it, so a worker host needs no server secret (it could pose as the router);
- client: SDK clients, API servers and the CLI connect to the router's client port with it.

`authorized/clients/` and `authorized/workers/` hold the public keys each side admits: the client
port admits the first, the worker port and every KV ingress the second (ZAP domains). When
PDSERVE_CURVE_DIR names such a directory (`--curve-dir` sets it; child processes inherit it),
every socket is encrypted, and a peer whose key is not admitted cannot complete the handshake.
Each host needs only its role's files (`pdserve keys` says which); secrets are written 0600.
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
CLIENTS, WORKERS = "clients", "workers"  # the ZAP domains, and authorized/'s folders
# What a socket is for: (the keypair it shows; connecting, the keypair whose public key its
# server shows, binding, the domain whose keys it admits).
ENDS = {
    "client": ("client", "server"),  # to the router's client port: SDK, API servers, CLI, benches
    "worker": ("worker", "server"),  # to the router's worker port
    "kv_sender": ("worker", "worker"),  # a prefill worker to a decode worker's KV ingress
    "router_clients": ("server", CLIENTS),  # the router's client port
    "router_workers": ("server", WORKERS),  # the router's worker port
    "kv_ingress": ("worker", WORKERS),  # a decode worker's KV ingress
}
HOSTS = ("router host: the whole directory; worker hosts: server.key, worker.key_secret and authorized/workers/; "
         "client hosts: server.key and client.key_secret")


@dataclass(frozen=True)
class CurveKeys:
    directory: Path
    pairs: dict  # name -> (public, secret or None), for the keypairs found

    @classmethod
    def load(cls, directory: str | Path) -> "CurveKeys":
        """The keypairs in `directory` (each host holds only its role's: checked when a socket
        needs one); InvalidArgument naming a file that cannot be read."""
        d = Path(directory)
        if not d.is_dir():
            raise InvalidArgument(f"--curve-dir {d} is not a directory; allowed: one `pdserve keys --dir {d}` made")
        if any((d / "authorized").glob("*.key")):  # authorized/client.key: one key for clients and workers
            raise InvalidArgument(f"{d} was made by an older pdserve, with one client key for clients and workers "
                                  "alike; allowed: a directory `pdserve keys --dir NEW` makes (a keypair per role)")
        pairs = {}
        for name in ("server", "worker", "client"):
            for path, secret in ((d / f"{name}.key_secret", True), (d / f"{name}.key", False)):
                if path.exists():
                    try:
                        public, secret_key = zmq.auth.load_certificate(str(path))
                    except (OSError, ValueError) as e:
                        raise InvalidArgument(f"{path} cannot be read as a CURVE key ({type(e).__name__}: {e}); "
                                              f"allowed: a file `pdserve keys` wrote") from None
                    pairs[name] = (public, secret_key if secret else None)
                    break
        return cls(d, pairs)

    def pair(self, name: str, secret: bool, end: str) -> tuple[bytes, bytes | None]:
        have = self.pairs.get(name)
        if have is None or (secret and have[1] is None):
            file = f"{name}.key_secret" if secret else f"{name}.key"
            raise InvalidArgument(f"{self.directory / file} is missing, and a {end.replace('_', ' ')} socket needs "
                                  f"it; allowed: the files of this host's role ({HOSTS})")
        return have

    def check(self, *ends: str) -> None:
        """InvalidArgument now, naming the file, if a socket for one of `ends` could not be made."""
        for end in ends:
            own, other = ENDS[end]
            self.pair(own, True, end)
            if other in ("server", "worker"):
                self.pair(other, False, end)
            elif not (self.directory / "authorized" / other).is_dir():
                raise InvalidArgument(f"{self.directory / 'authorized' / other} is missing, and a "
                                      f"{end.replace('_', ' ')} socket needs it; allowed: {HOSTS}")


def create_keys(directory: str | Path, replace: bool = False) -> Path:
    """Keypairs into `directory`, secrets readable by their owner alone; keys already there are
    refused unless `replace`: every process still using them would be locked out."""
    d = Path(directory)
    there = sorted(p.name for p in d.glob("*.key*")) if d.is_dir() else []
    if there and not replace:
        raise InvalidArgument(f"{d} already holds CURVE keys ({', '.join(there)}): new ones would lock out every "
                              "process using them; allowed: a new directory, or --replace")
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    for name, admitted in (("server", None), ("worker", WORKERS), ("client", CLIENTS)):
        zmq.auth.create_certificates(str(d), name)
        (d / f"{name}.key_secret").chmod(0o600)
        if admitted:
            (d / "authorized" / admitted).mkdir(parents=True, exist_ok=True)
            shutil.copy(d / f"{name}.key", d / "authorized" / admitted / f"{name}.key")
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


def secure(sock: zmq.Socket, ctx, end: str) -> None:
    """Apply CURVE to a socket about to bind or connect as `end` (ENDS), if keys are configured."""
    keys = current_keys()
    if keys is None:
        return
    own, other = ENDS[end]
    sock.curve_publickey, sock.curve_secretkey = keys.pair(own, True, end)
    if other in (CLIENTS, WORKERS):
        keys.check(end)
        _authenticator(ctx, keys)
        sock.zap_domain = other.encode()
        sock.curve_server = True
    else:
        sock.curve_serverkey = keys.pair(other, False, end)[0]


def _authenticator(ctx, keys: CurveKeys):
    """One ZAP authenticator per context, admitting each domain's authorized public keys."""
    if id(ctx) in _authenticators:
        return
    import zmq.asyncio

    if isinstance(ctx, zmq.asyncio.Context):
        from zmq.auth.asyncio import AsyncioAuthenticator as Auth
    else:
        from zmq.auth.thread import ThreadAuthenticator as Auth
    auth = Auth(ctx)
    auth.start()
    for domain in (CLIENTS, WORKERS):
        if (keys.directory / "authorized" / domain).is_dir():
            auth.configure_curve(domain=domain, location=str(keys.directory / "authorized" / domain))
    _authenticators[id(ctx)] = auth


HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def refusal(event: int, who: str) -> str | None:
    """Why a connecting socket's handshake failed, from its monitor's event (None: it did not)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"it refused this {who}'s CURVE key (not among its authorized/{who}s/)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return "the handshake failed: one side uses CURVE keys (PDSERVE_CURVE_DIR), the other not, or not the same"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # what a CURVE server that cannot read our hello does
        return "it drops the handshake: the server.key here is not its own (another key directory's?)"
    return None


def close_context(ctx) -> None:
    """Terminate a context, its ZAP authenticator first: the authenticator holds a socket of the
    context open, and term() waits for every socket, so a process with CURVE on never exited."""
    auth = _authenticators.pop(id(ctx), None)
    if auth is not None:
        auth.stop()
    ctx.term()
