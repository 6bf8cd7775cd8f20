"""Errors a user can act on. Each carries a code that the router will put on the wire, so the
same failure reads the same whether it happens in-process or across a socket."""

import contextlib
import errno
import socket


class PdserveError(Exception):
    code = "INTERNAL"


class InvalidArgument(PdserveError, ValueError):
    """A request or configuration value outside what is allowed; the message names both, and
    `param` the field, where there is one (the HTTP API reports it in the error's "param")."""

    code = "INVALID_ARGUMENT"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NoRoom(InvalidArgument):
    """A request this worker's KV pool can never hold, where another worker's pool may: a worker
    reports it as NO_ROOM (its prefill worker's own pool: PREFILL_NO_ROOM), which the router
    retries elsewhere, where INVALID_ARGUMENT ends a request."""
    code = "NO_ROOM"


class StartupError(PdserveError, RuntimeError):
    """A process of a cluster that exited, or did not become ready, while it started."""

    code = "STARTUP"


class ModelLoadError(PdserveError, ValueError):
    """A checkpoint that cannot be loaded: missing file, unknown architecture, wrong shape."""

    code = "MODEL_LOAD"


def first_line(e: BaseException, limit: int = 200) -> str:
    """'Type: the first line of its message': a compiler's failure in one log line, not its dump.
    An error raised while another was handled names that one too (a CUDA graph whose capture
    failed ends in capture_end's own error; the first is the cause)."""
    line = (str(e).strip().splitlines() or [""])[0][:limit]
    inner = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return f"{type(e).__name__}: {line}" + (f" (after {first_line(inner, limit)})" if inner is not None else "")


def short_repr(value, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: for naming a bad value in an error message."""
    r = repr(value)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def nested(value):
    """value and each value inside its maps, lists and tuples, depth first, each container before
    what it holds (a check that raises on one looks no deeper); one met again (a list that holds
    itself) is not walked twice. For the checks of a caller's data that name what is wrong."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if isinstance(v, (dict, list, tuple)):
            if id(v) in seen:
                continue
            seen.add(id(v))
        yield v
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


@contextlib.contextmanager
def port_free(host: str, port: int, flag: str):
    """Binding within turns "address in use" (a socket's OSError, ZeroMQ's ZMQError alike) into
    an InvalidArgument naming the port and the flag that sets it, not a traceback."""
    try:
        yield
    except Exception as e:  # an OSError, or a zmq.ZMQError (not an OSError): both carry errno
        code = getattr(e, "errno", None)
        # (a name: the socket's resolver knows none such, ZeroMQ takes it for a network interface)
        if code in (errno.EADDRNOTAVAIL, errno.ENODEV) or isinstance(e, socket.gaierror):
            raise InvalidArgument(f"host {host!r} is not an address of this machine, so {flag} {port} cannot be "
                                  "bound there; allowed: one of its addresses, 127.0.0.1 or 0.0.0.0 (all)",
                                  param="--host") from None
        if code != errno.EADDRINUSE:
            raise
    else:
        return
    raise InvalidArgument(f"port {port} on {host} is in use (another pdserve router or worker, or another of "
                          f"this process's ports?); allowed: a free port for {flag} (0 picks one)", param=flag)


def made_dir(path, flag: str):
    """The folder `path` (a pathlib.Path), made if missing, or an InvalidArgument naming it and the
    flag that gave it: a traceback of mkdir's OSError says neither."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidArgument(f"{flag} {str(path)!r}: {e.strerror}; allowed: a folder this user can create or write "
                              "to", param=flag) from None
    return path
