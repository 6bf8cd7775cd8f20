"""Every message that crosses a socket, declared once.

A message is a msgpack map {"v": PROTOCOL_VERSION, "type": <tag>, ...fields}. Tensor bytes never
go inside it: they travel as separate zero-copy frames after the header (KVChunk), or off the
socket altogether (common/kv_transport/). Decoding is for
untrusted bytes: the size is capped before unpacking, msgpack's own length limits are set, the
version and type must be known, and every field is checked against its declared type. Anything
else raises ProtocolError with what was wrong; a receiver answers or drops it and carries on.
No pickle anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from common.errors import InvalidArgument, PdserveError, nested, short_repr as _short
from common.text import LONE_SURROGATE
from common.typed_fields import build, holds, schema

PROTOCOL_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 16 * 2**20  # header frames; KV frames are capped separately
MAX_MAP_LEN = 4096  # entries of one map in a message: decode refuses more
KV_TRANSPORTS = ("auto", "zmq", "shm", "gloo", "cuda_ipc", "nccl")  # KVTransfer.transport: common/kv_transport/
ATTENTION_BACKENDS = ("auto", "sdpa", "triton", "flex")  # common/attention/; here so the CLI need not import torch


class ProtocolError(PdserveError, ValueError):
    code = "INVALID_ARGUMENT"
    request_id: str | None = None  # a Generate's own, when the bad message still names one


# ----------------------------------------------------------------------------- client <-> router

@dataclass
class Generate:
    """prompt is text or token ids; or, with messages (OpenAI-style chat), prompt is "" and the
    router renders messages with the model's chat template (common/chat.py)."""
    request_id: str
    prompt: str | list[int]
    sampling: dict = field(default_factory=dict)
    stream: bool = True
    messages: list[dict] | None = None
    token_batches: bool = False  # the client reads TokenBatch: its streams' tokens may come several to a message
    # vLLM's add_special_tokens for a text or chat prompt: None, a text's tokenizer adds BOS and the like,
    # a chat's template writes its own (router/prompts.py Prompts.encode)
    add_special_tokens: bool | None = None
    # a chat's template options (common/chat.py TemplateArgs): vLLM's chat_template_kwargs, and where
    # its prompt ends
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass
class Cancel:
    request_id: str


@dataclass
class StatusRequest:
    ask_id: str = ""  # echoed in the reply: a call that timed out does not take a later call's


@dataclass
class MetricsRequest:
    """The router's Prometheus metrics, for an API server process to serve at /metrics."""
    ask_id: str = ""


@dataclass
class Rejected:
    """An API server refused a request before it reached the router (a bad body, a bad key): the
    router counts it in request_errors_total, which it alone keeps. code: one of REJECT_CODES."""
    code: str


@dataclass
class Probe:
    """Router -> a ZeroMQ client whose requests send it nothing yet (not streamed, or not begun):
    nothing to answer or read. A client whose socket is gone makes the send fail, and the router
    cancels its requests (otherwise they would run to their end for nobody)."""


# What clients send a router's client port: a worker's port answers them with an Error naming the
# right port, as a client would otherwise wait for a reply that never comes.
CLIENT_MESSAGES = (Generate, Cancel, StatusRequest, MetricsRequest, Rejected)

REJECT_CODES = ("INVALID_ARGUMENT", "UNAUTHENTICATED", "NOT_FOUND", "METHOD_NOT_ALLOWED", "REQUEST_TIMEOUT", "TOO_LARGE",
                "INTERNAL")


@dataclass
class Token:
    """Generated tokens [index, index + len(token_ids)) of a request, in order. logprobs: one
    entry per token when asked for (common/sampling.py Logprob); prompt_logprobs on the first."""
    request_id: str
    index: int
    token_ids: list[int]
    text: str = ""
    logprobs: list | None = None
    prompt_logprobs: list | None = None


@dataclass
class TokenBatch:
    """Tokens of several of one client's requests in one message, each item a Token's fields in
    their order (batch_tokens, unbatch_tokens): the router's replies to a worker's step, for the
    requests whose Generate set token_batches. One send per client and step where there was one
    per stream and step, a third of the router's CPU per streamed token (bench router)."""
    items: list[list]


@dataclass
class Done:
    request_id: str
    finish_reason: str
    token_ids: list[int]
    text: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if one did


@dataclass
class Error:
    request_id: str | None
    code: str  # INVALID_ARGUMENT, OVERLOADED, UNAVAILABLE, TOO_LARGE, INTERNAL; to a worker, ALREADY_EXISTS
    message: str


@dataclass
class StatusReply:
    workers: list[dict]
    queued: int
    in_flight: int
    context: int = 0  # what the router admits, prompt and output (its API servers follow it)
    missing: list[str] = field(default_factory=list)  # roles the live workers lack to serve ("prefill", "decode")
    model: str = ""  # the router's --model, which its workers serve
    ask_id: str = ""  # the StatusRequest's
    policy: str = ""  # the router's --policy (bench serve --router reads its counters by it)
    kv_events: bool = True  # whether its prefix_affine hears the workers' cache events (not --no-kv-events)
    serving: int = 0  # workers that take work: alive and not leaving (its /health's count)
    stopping: bool = False  # told to stop, it finishes what it holds and admits no new request


@dataclass
class MetricsReply:
    text: bytes  # Prometheus' text format
    ask_id: str = ""  # the MetricsRequest's


# ----------------------------------------------------------------------------- workers <-> router

@dataclass
class Register:
    role: str  # "prefill", "decode" or "mono" (both in one process)
    worker_id: str
    incarnation: str
    device: str
    total_blocks: int
    block_size: int
    kv_address: str = ""  # decode/mono: where prefill workers push KV
    model: str = ""
    kv_transports: list[str] = field(default_factory=list)  # KV transports it sends (prefill) or receives by
    kv_dtype: str = ""  # of its KV pool: a prefill and a decode worker must agree on it, and on block_size
    batch_invariant: bool | None = None  # runs batch-invariant kernels (common/batch_invariant.py); None: not said
    prefix_caching: bool = True  # keeps a prefix cache (prefix_affine routes shared prompts to it)
    max_model_len: int = 0  # the context it serves, prompt and output; 0: not said


@dataclass
class Registered:
    worker_id: str
    incarnation: str
    kv_events: bool = False  # the router routes by prefix caches: tell it theirs (KVEvents)


@dataclass
class Heartbeat:
    """Load and, for the router's metrics, counters since the worker (incarnation) started."""
    worker_id: str
    incarnation: str
    queued: int
    running: int
    free_blocks: int
    total_blocks: int
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # ... and found there
    kv_bytes: dict = field(default_factory=dict)  # KV transport -> bytes sent by it
    spec_decode: list = field(default_factory=list)  # speculative decoding's [drafts, draft tokens, accepted tokens]
    held: int = 0  # prefilled, their KV kept for a decode worker (waiting for its room, or on the way)
    preemptions: int = 0  # requests its scheduler preempted: their blocks freed for other decodes, recomputed later


@dataclass
class Holding:
    """Worker -> router, every HOLDING_S: the attempts it holds, [request_id, attempt] pairs
    (prefilling or queued for it, waiting for decode room, decoding or preempted). A request queued
    at a live worker is waiting, not lost: its deadline is held off while a worker of its attempt
    says so, so a busy cluster queues requests instead of re-prefilling them on a timeout."""
    worker_id: str
    requests: list


@dataclass
class Leaving:
    """Worker -> router when told to stop (SIGTERM, SIGINT): it takes no new work and finishes what it
    holds, for up to its --drain-timeout (NVIDIA Dynamo's graceful shutdown). gone: it stops now;
    what it still holds, the router re-dispatches at once rather than at its heartbeat timeout. The
    router answers the first with the same message: a worker it does not answer within a second
    stops at once (no router is there to take its requests' tokens). idle: it holds nothing as it
    goes, so a request it prefilled is in its decode worker's hands (whose first tokens may reach
    the router after this message): the router keeps it there rather than re-dispatch it."""
    worker_id: str
    gone: bool = False
    idle: bool = False


@dataclass
class KVEvents:
    """Worker -> router, where Registered asked for them (NVIDIA Dynamo's KV events, vLLM's
    BlockStored / BlockRemoved): the block hashes (common/prefix_hash.py) its prefix cache gained
    and lost since the last KVEvents, sent at most every 50 ms, and before the first token of a
    prefill that stored some (the router then sees them by the time it sees the prefill end). seq counts
    an incarnation's KVEvents from 0. reset: stored is the whole cache (after Registered, or when
    asked by KVEventsResync), possibly continued by more KVEvents; a router that sees a seq missing
    asks for one."""
    worker_id: str
    seq: int
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    reset: bool = False


@dataclass
class KVEventsResync:
    """Router -> worker: a KVEvents went missing; send the whole cache again (reset)."""


@dataclass
class PrefillWork:
    """Router -> prefill (or mono) worker: compute the KV of token_ids and sample the next token.
    token_ids may extend the prompt with tokens already generated (a migrated request). To a decode
    worker naming itself as decode_worker_id: prefill it there and decode on (a local prefill)."""
    request_id: str
    attempt: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: dict
    seed: int
    decode_worker_id: str = ""
    decode_kv_address: str = ""


@dataclass
class WorkerTokens:
    """Prefill/decode worker -> router: tokens at positions [index, ...) of the generated output."""
    request_id: str
    attempt: int
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    timings: dict = field(default_factory=dict)
    logprobs: list | None = None  # one entry per token, when the sampling asks for them
    prompt_logprobs: list | None = None  # with the first token, when asked for


@dataclass
class WorkerTokenBatch:
    """A worker step's WorkerTokens in one message, each item a WorkerTokens' fields in their order
    (batch_tokens, unbatch_tokens): at batch 64, one send a step where 64 took 0.7 ms on a CPU."""
    items: list[list]


@dataclass
class WorkerError:
    request_id: str
    attempt: int
    code: str  # a KVRefuse's, relayed; PREFILL_NO_ROOM: the prefill worker's own pool cannot hold the prompt
    message: str


@dataclass
class CancelWork:
    """Router -> worker: drop this attempt of the request. Only that attempt: a retry's next attempt
    may reach a decode worker (by the prefill worker's KVReserve) before the old attempt's cancel."""
    request_id: str
    attempt: int


@dataclass
class Shutdown:
    reason: str = ""


# ----------------------------------------------------------------------------- prefill <-> decode

@dataclass
class KVReserve:
    """Prefill -> decode: hold blocks for this many tokens of KV (a lease, until expiry)."""
    request_id: str
    attempt: int
    num_tokens: int
    layout: dict
    max_len: int = 0  # the longest the sequence may grow (prompt + max_tokens, before the decode worker's cap)
    # the asking prefill worker's host and process: where its blocks are fenced against a one-sided
    # writer (shm, cuda_ipc), they come back as soon as that process is gone, not at the lease's end
    writer_host: str = ""
    writer_pid: int = 0


@dataclass
class KVGrant:
    request_id: str
    attempt: int
    block_ids: list[int]
    lease_s: float
    transports: dict = field(default_factory=dict)  # transport name -> how to reach it (common/kv_transport/)


@dataclass
class KVRefuse:
    request_id: str
    attempt: int
    code: str  # BUSY (retry later), NO_ROOM (never: the pool is too small), LAYOUT_MISMATCH, INVALID_ARGUMENT, CANCELLED
    message: str


@dataclass
class KVChunk:
    """Prefill -> decode, ahead of the KVTransfer header: some of a request's KV units, for the
    blocks granted to this request and attempt. A unit is one block of one layer's K or V; the
    request's units are numbered in (layer, K/V, block) order over its first num_blocks granted
    blocks, and this chunk holds the runs [first, count] of them, in order: in its one frame
    (zmq), or point to point under transport_info's pair and tag (gloo, nccl)."""
    request_id: str
    attempt: int
    num_blocks: int
    runs: list[list[int]]
    transport: str = "zmq"
    transport_info: dict = field(default_factory=dict)


@dataclass
class KVTransfer:
    """Prefill -> decode: the KV of one request is (or, for gloo and nccl, is being) put into
    these granted blocks by `transport`; start decoding it once all of it is there. No frames:
    the bytes went in the KVChunks ahead of it (zmq), straight into the decode worker's pool (shm,
    cuda_ipc; on one GPU cuda_ipc's copies may still be under way: transport_info carries the
    event that says when they end), or point to point as those KVChunks announced (gloo, nccl).
    prefilled_at: the prefill's wall-clock time when it sampled the first token, for the decode
    worker's handoff_s."""
    request_id: str
    attempt: int
    token_ids: list[int]
    num_prompt_tokens: int
    first_token: int
    sampling: dict
    seed: int
    layout: dict
    num_tokens: int
    block_ids: list[int]  # the decode worker's blocks granted for it
    transport: str = "zmq"
    transport_info: dict = field(default_factory=dict)
    prefilled_at: float = 0.0


@dataclass
class KVRelease:
    """Prefill -> decode: the reservation is not needed after all (the request finished at its
    first token, failed, or was cancelled)."""
    request_id: str
    attempt: int


@dataclass
class KVAck:
    request_id: str
    attempt: int
    ok: bool
    message: str = ""


MESSAGES: dict[str, type] = {cls.__name__: cls for cls in (
    Generate, Cancel, StatusRequest, MetricsRequest, Rejected, Probe, Token, TokenBatch, Done, Error, StatusReply,
    MetricsReply,
    Register, Registered, Heartbeat, Holding, Leaving, KVEvents, KVEventsResync, PrefillWork, WorkerTokens,
    WorkerTokenBatch, WorkerError, CancelWork, Shutdown,
    KVReserve, KVGrant, KVRefuse, KVRelease, KVChunk, KVTransfer, KVAck)}


def reply_id(msg) -> str | None:
    """The id a message is filed under, and an answer to it carries: a request's, or a status or
    metrics call's (None: neither)."""
    return getattr(msg, "request_id", None) or getattr(msg, "ask_id", None) or None


def encode(msg) -> bytes:
    body = {f.name: getattr(msg, f.name) for f in schema(type(msg))[1]}  # plain data: no deep copy (asdict's)
    body["v"] = PROTOCOL_VERSION
    body["type"] = type(msg).__name__
    try:
        return msgpack.packb(body, use_bin_type=True)
    except UnicodeEncodeError:  # Python strings may hold a lone surrogate ('\ud800'); UTF-8 may not
        raise InvalidArgument(f"a string of this {type(msg).__name__} holds {LONE_SURROGATE}") from None
    except (OverflowError, TypeError, ValueError) as e:  # [2**70], an object msgpack cannot carry, deep nesting
        raise InvalidArgument(f"this {type(msg).__name__} holds a value that cannot be sent ({e}); allowed: "
                              "text, bytes, booleans, None, integers within 64 bits, floats, and lists and maps of them"
                              ) from None


def check_maps(value, name: str, param: str | None = None) -> None:
    """What decode would refuse in data a caller gives (a request's sampling options, a chat's
    messages, a JSON schema), refused by name before it is sent: a map key that is not text, a map
    of over MAX_MAP_LEN entries. Sent, the whole message is refused, and a schema that reached the
    workers so was dropped by each in turn until the request's attempts ran out."""
    for v in nested(value):
        if isinstance(v, dict):
            if len(v) > MAX_MAP_LEN:
                raise InvalidArgument(f"{name} holds a map of {len(v)} entries; allowed: at most {MAX_MAP_LEN}",
                                      param=param or name)
            key = next((k for k in v if not isinstance(k, str)), None)
            if key is not None:
                raise InvalidArgument(f"{name} holds a map key {_short(key)}; allowed: text keys", param=param or name)


PEEK_BYTES = 4096  # of a message over the limit, read for the request id it begins with


def _first_request_id(buf: bytes | memoryview) -> str | None:
    """The request_id a message begins with, read from its first bytes alone: encode writes a
    Generate's fields first, its id first of them (a message over the limit is not decoded)."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=PEEK_BYTES)
    unpacker.feed(bytes(buf[:PEEK_BYTES]))
    try:
        if unpacker.read_map_header() and unpacker.unpack() == "request_id":
            rid = unpacker.unpack()
            return rid if isinstance(rid, str) else None
    except Exception:  # cut short, or not a map: no id to name
        pass
    return None


def decode(buf: bytes | memoryview, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
    if len(buf) > max_bytes:
        e = ProtocolError(f"message of {len(buf)} bytes is over the limit of {max_bytes}")
        e.code, e.request_id = "TOO_LARGE", _first_request_id(buf)  # that request fails at once, not at its timeout
        raise e
    try:
        body = msgpack.unpackb(buf, raw=False, strict_map_key=True,
                               max_str_len=max_bytes, max_bin_len=max_bytes,
                               max_array_len=max_bytes // 2, max_map_len=MAX_MAP_LEN)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        error = ProtocolError(f"message is not valid msgpack ({type(e).__name__}: {e})")
        error.request_id = _first_request_id(buf)  # a Generate's: it fails at once, not at its timeout
        raise error from None
    if not isinstance(body, dict):
        raise ProtocolError(f"message must be a map, got {type(body).__name__}")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported; allowed: {PROTOCOL_VERSION}")
    tag = body.pop("type", None)
    cls = MESSAGES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"message type {tag!r} is unknown")
    try:
        return build(cls, body, ProtocolError)
    except ProtocolError as e:  # the client can then fail that request at once, not at its timeout
        if cls is Generate and isinstance(body.get("request_id"), str):
            e.request_id = body["request_id"]
        raise


BATCHES = {WorkerTokens: WorkerTokenBatch, Token: TokenBatch}  # an item's type -> its batch's
ITEMS = {batch: item for item, batch in BATCHES.items()}


def batch_tokens(msgs: list[WorkerTokens] | list[Token]) -> WorkerTokenBatch | TokenBatch:
    """One message of several of one kind (not empty): each item its fields' values in order."""
    return BATCHES[type(msgs[0])]([list(vars(m).values()) for m in msgs])  # a dataclass sets its fields in order


def unbatch_tokens(batch: WorkerTokenBatch | TokenBatch) -> list[WorkerTokens | Token | ProtocolError]:
    """Each item as the message it stands for, checked as a message of its own is; a bad item is
    its ProtocolError, in its place, and the others stand."""
    cls = ITEMS[type(batch)]
    fields = schema(cls)[1]
    checks = [f.check for f in fields]
    out: list = []
    for i, item in enumerate(batch.items):
        if type(item) is list and len(item) == len(checks) and all(map(holds, checks, item)):
            out.append(cls(*item))  # every field given and of its type: the usual item
            continue
        if not isinstance(item, list) or len(item) > len(fields):
            out.append(ProtocolError(f"{type(batch).__name__}.items[{i}]={_short(item)}; allowed: a list of at "
                                     f"most {len(fields)} {cls.__name__} fields"))
            continue
        try:  # defaults to fill in, or an error to name
            out.append(build(cls, {f.name: v for f, v in zip(fields, item)}, ProtocolError))
        except ProtocolError as e:
            out.append(e)
    return out
