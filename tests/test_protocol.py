"""The wire format (common/protocol.py): every message survives a round trip, and a header with
a wrong, missing or unknown field is refused naming the field and what is allowed."""

import re

import msgpack
import pytest

from common import protocol as P


def raw(tag: str, **body) -> bytes:
    return msgpack.packb({"v": P.PROTOCOL_VERSION, "type": tag, **body}, use_bin_type=True)


@pytest.mark.parametrize("msg", [
    P.Generate("r1", [1, 2, 3], {"max_tokens": 4}),
    P.Generate("r2", "text prompt"),
    P.Done("r1", "length", [5, 6], text=None),
    P.Error(None, "INVALID_ARGUMENT", "bad"),
    P.KVChunk("r1", 2, 64, [[0, 128], [300, 4]], "gloo", {"pair": "p", "tag": 7}),
    P.KVAck("r1", 0, False, "why"),
], ids=lambda m: type(m).__name__)
def test_messages_round_trip(msg):
    assert P.decode(P.encode(msg)) == msg


@pytest.mark.parametrize("body, field, allowed", [
    (dict(request_id="r", attempt=0, num_blocks=4, runs=[[0, "1"]]), "runs", "list[list[int]]"),
    (dict(request_id="r", attempt=0, num_blocks=4, runs=[0, 1]), "runs", "list[list[int]]"),
    (dict(request_id="r", attempt=True, num_blocks=4, runs=[]), "attempt", "int"),
    (dict(request_id=5, attempt=0, num_blocks=4, runs=[]), "request_id", "str"),
    (dict(request_id="r", attempt=0, num_blocks=4, runs=[], transport_info=[]), "transport_info", "dict"),
])
def test_a_field_of_the_wrong_type_is_refused_naming_it(body, field, allowed):
    with pytest.raises(P.ProtocolError, match=rf"KVChunk\.{field}=.* has the wrong type; allowed: {re.escape(allowed)}"):
        P.decode(raw("KVChunk", **body))


def test_optional_and_union_fields_take_each_of_their_types():
    assert P.decode(raw("Error", request_id=None, code="X", message="m")).request_id is None
    assert P.decode(raw("Generate", request_id="r", prompt=[1, 2])).prompt == [1, 2]
    with pytest.raises(P.ProtocolError, match=r"Generate\.prompt=.*allowed: str \| list\[int\]"):
        P.decode(raw("Generate", request_id="r", prompt=[1, "2"]))
    with pytest.raises(P.ProtocolError, match=r"Error\.request_id=3 has the wrong type"):
        P.decode(raw("Error", request_id=3, code="X", message="m"))


def test_unknown_and_missing_fields_are_refused_naming_them():
    with pytest.raises(P.ProtocolError, match=r"KVAck: unknown fields \['extra'\]; allowed: \["):
        P.decode(raw("KVAck", request_id="r", attempt=0, ok=True, message="", extra=1))
    with pytest.raises(P.ProtocolError, match=r"KVAck: missing field 'ok'"):
        P.decode(raw("KVAck", request_id="r", attempt=0))
    with pytest.raises(P.ProtocolError, match=r"message type 'Nope' is unknown"):
        P.decode(raw("Nope"))


def test_fields_added_later_have_defaults_so_older_messages_still_decode():
    """Logprobs (WorkerTokens, Token, Done) and metrics counters (Heartbeat) came after version 1:
    a message without them decodes, with their defaults."""
    old = P.decode(raw("WorkerTokens", request_id="r", attempt=1, index=0, token_ids=[5]))
    assert (old.logprobs, old.prompt_logprobs) == (None, None)
    beat = P.decode(raw("Heartbeat", worker_id="w", incarnation="i", queued=0, running=1, free_blocks=2, total_blocks=3))
    assert (beat.prefix_queries, beat.prefix_hits, beat.kv_bytes) == (0, 0, {})
    assert P.decode(raw("Done", request_id="r", finish_reason="stop", token_ids=[])).stop_reason is None
    new = P.WorkerTokens("r", 1, 0, [5, 6], "stop", {}, [[-0.5, [5, 9], [-0.5, -1.5]], [-0.1, [], []]], [None, [-2.0, [], []]])
    assert P.decode(P.encode(new)) == new
    assert P.decode(P.encode(P.Done("r", "stop", [1], stop_reason="\n\n"))).stop_reason == "\n\n"


def test_a_token_batch_carries_each_item_checked_alone():
    items = [P.WorkerTokens("a", 1, 0, [5, 6], None, {}, None, None),
             P.WorkerTokens("b", 2, 7, [9], "stop", {"prefill_s": 0.5}, [[-0.1, [9], [-0.1]]], None)]
    batch = P.decode(P.encode(P.batch_tokens(items)))
    assert isinstance(batch, P.WorkerTokenBatch) and P.unbatch_tokens(batch) == items
    batch.items[1][3] = "not token ids"
    batch.items.append(["c", 1])  # missing fields
    batch.items.append("not a list")
    first, *bad = P.unbatch_tokens(batch)
    assert first == items[0] and all(isinstance(e, P.ProtocolError) for e in bad)
    assert "WorkerTokens.token_ids='not token ids' has the wrong type" in str(bad[0])
    assert "missing field 'index'" in str(bad[1]) and "items[3]" in str(bad[2])
    # every field given, but a bool for an int (msgpack keeps them apart); and one leaving its defaults out
    rest = P.unbatch_tokens(P.WorkerTokenBatch([["d", True, 0, [1], None, {}, None, None], ["e", 1, 0, [2]]]))
    assert "WorkerTokens.attempt=True has the wrong type" in str(rest[0])
    assert rest[1] == P.WorkerTokens("e", 1, 0, [2])
