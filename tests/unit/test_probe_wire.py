"""vgpud.probes.wire: what is encoded decodes to itself; anything else is a WireError."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpud.probes.bcc_probes import HIST_ENTRIES
from vgpud.probes.layout import LAT_SLOTS
from vgpud.probes.wire import (
    DELETE_MAX,
    REPLY_MAX,
    REQUEST_MAX,
    Op,
    Reply,
    Request,
    Status,
    WireError,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from vgpud.wire import HEADER_SIZE, Oversized, body_length, frame, read_frame

u64 = st.integers(0, 2**64 - 1)
keys = st.tuples(u64, u64, u64)
texts = st.text(max_size=200)


@st.composite
def requests(draw: st.DrawFn) -> Request:
    op = draw(st.sampled_from(Op))
    if op is Op.DELETE:
        return Request(op, tuple(draw(st.lists(keys, max_size=50))))
    return Request(op)


@given(requests())
def test_requests_round_trip(req: Request) -> None:
    assert decode_request(encode_request(req)) == req


@given(st.binary(max_size=300))
def test_any_bytes_decode_or_raise_wire_error(body: bytes) -> None:
    try:
        req = decode_request(body)
    except WireError:
        return
    assert decode_request(encode_request(req)) == req


@given(st.binary(max_size=300), st.sampled_from(Op))
def test_any_reply_bytes_decode_or_raise_wire_error(body: bytes, op: Op) -> None:
    with contextlib.suppress(WireError):
        decode_reply(op, body)


def test_the_bodies_are_pinned() -> None:
    """The JSON of each message, as the module doc writes it."""
    assert encode_request(Request(Op.READ)) == b'{"op":"read"}'
    assert encode_request(Request(Op.DELETE, ((1, 2, 3),))) == \
        b'{"op":"delete","keys":[[1,2,3]]}'
    assert encode_reply(Op.READ, Reply(Status.OK, {(1, 2, 3): [4, 5]})) == \
        b'{"status":"ok","value":{"entries":1,"width":2,"counts":[1,2,3,4,5]}}'
    assert encode_reply(Op.LOAD, Reply(Status.OK, (True, ["tp:a"]))) == \
        b'{"status":"ok","value":{"attached":true,"points":["tp:a"]}}'
    assert encode_reply(Op.READ, Reply(Status.OFF, text="no bcc")) == \
        b'{"status":"off","text":"no bcc"}'
    assert encode_reply(Op.DELETE, Reply(Status.OK)) == b'{"status":"ok","value":null}'


@pytest.mark.parametrize("body", [
    b"", b"{}", b"[]", b'{"op":"nope"}', b'{"op":5}', b'{"op":"read","keys":[]}',
    b'{"op":"read","x":1}', b'{"op":"delete"}', b'{"op":"delete","keys":[[1,2]]}',
    b'{"op":"delete","keys":[[1,2,-3]]}', b'{"op":"delete","keys":[[1,2,true]]}',
    b'{"op":"delete","keys":[[1,2,18446744073709551616]]}', b'{"op":"delete","keys":{}}',
    b'{"op":"read","op":"read"}', b'{"op":"READ"}',
])
def test_malformed_requests_are_refused(body: bytes) -> None:
    with pytest.raises(WireError):
        decode_request(body)


def test_deletes_are_bounded() -> None:
    with pytest.raises(WireError):
        encode_request(Request(Op.DELETE, ((0, 0, 0),) * (DELETE_MAX + 1)))
    with pytest.raises(WireError):
        decode_request(json.dumps({"op": "delete", "keys": [[0, 0, 0]] * (DELETE_MAX + 1)})
                       .encode())
    with pytest.raises(WireError):
        encode_request(Request(Op.READ, ((0, 0, 0),)))
    # The largest DELETE fits in a request.
    assert len(encode_request(Request(Op.DELETE, ((2**64 - 1,) * 3,) * DELETE_MAX))) \
        <= REQUEST_MAX


def test_a_request_framed_by_the_daemon_reads_in_the_helper() -> None:
    req = Request(Op.DELETE, ((1, 2, 3),))
    out = frame(encode_request(req), REQUEST_MAX)
    assert out[:4] == b"VGW\x01" and len(out) == HEADER_SIZE + body_length(out[:8], REQUEST_MAX)
    pending = [out]

    def recv(n: int) -> bytes:  # three bytes a read at most
        got, pending[0] = pending[0][:min(n, 3)], pending[0][min(n, 3):]
        return got

    body = read_frame(recv, REQUEST_MAX)
    assert body is not None and decode_request(body) == req
    with pytest.raises(Oversized):
        body_length(frame(b"x" * (REQUEST_MAX + 1), REQUEST_MAX + 1)[:8], REQUEST_MAX)


@given(st.dictionaries(keys, st.lists(u64, min_size=LAT_SLOTS + 1, max_size=LAT_SLOTS + 1),
                       max_size=20))
def test_read_round_trips(counts: dict[tuple[int, int, int], list[int]]) -> None:
    reply = decode_reply(Op.READ, encode_reply(Op.READ, Reply(Status.OK, counts)))
    assert reply == Reply(Status.OK, counts)


@given(st.sampled_from([Op.LOAD, Op.REATTACH]), st.booleans(), st.lists(texts, max_size=10))
def test_points_round_trip(op: Op, ok: bool, points: list[str]) -> None:
    reply = decode_reply(op, encode_reply(op, Reply(Status.OK, (ok, points))))
    assert reply == Reply(Status.OK, (ok, points))


@given(st.sampled_from(Op), st.sampled_from([Status.OFF, Status.ERR]), texts)
def test_refusals_round_trip(op: Op, status: Status, text: str) -> None:
    assert decode_reply(op, encode_reply(op, Reply(status, text=text))) == Reply(status,
                                                                                  text=text)


@given(u64, st.booleans())
def test_scalars_round_trip(n: int, flag: bool) -> None:
    assert decode_reply(Op.DROPPED, encode_reply(Op.DROPPED, Reply(Status.OK, n))).value == n
    assert decode_reply(Op.STALE, encode_reply(Op.STALE, Reply(Status.OK, flag))).value is flag
    assert decode_reply(Op.DELETE, encode_reply(Op.DELETE, Reply(Status.OK))).value is None


def test_a_full_map_fits_in_a_reply() -> None:
    """HIST_ENTRIES entries of the largest values: the bound holds them."""
    one = encode_reply(Op.READ, Reply(Status.OK, {(2**64 - 1,) * 3: [2**64 - 1] * 66}))
    assert HIST_ENTRIES * (len(one) + 1) <= REPLY_MAX


@pytest.mark.parametrize("value", [
    {"entries": 2, "width": 2, "counts": [1, 2, 3, 4, 5]},
    {"entries": 1, "width": 2, "counts": [1, 2, 3, 4, 5, 6]},
    {"entries": 1, "width": 2, "counts": [1, 2, 3, 4, -5]},
    {"entries": 1, "width": 2, "counts": [1, 2, 3, 4, 5.0]},
    {"entries": 1, "width": 2, "counts": [1, 2, 3, 4, False]},
    {"entries": 1, "width": 2, "counts": "12345"},
    {"entries": 1, "width": 129, "counts": [0] * 132},
    {"entries": 2**31, "width": 2, "counts": [1, 2, 3, 4, 5]},
    {"entries": 1, "width": 2},
    [[1, 2, 3, 4, 5]],
])
def test_a_read_whose_shape_lies_is_refused(value: object) -> None:
    body = json.dumps({"status": "ok", "value": value}).encode()
    with pytest.raises(WireError):
        decode_reply(Op.READ, body)


@pytest.mark.parametrize(("op", "body"), [
    (Op.READ, b'{"status":"ok"}'), (Op.READ, b'{"status":"ok","value":null,"text":""}'),
    (Op.READ, b'{"status":"err"}'), (Op.READ, b'{"status":"fine","value":null}'),
    (Op.STALE, b'{"status":"ok","value":1}'), (Op.DROPPED, b'{"status":"ok","value":-1}'),
    (Op.DROPPED, b'{"status":"ok","value":true}'), (Op.DELETE, b'{"status":"ok","value":0}'),
    (Op.LOAD, b'{"status":"ok","value":{"attached":true,"points":[1]}}'),
    (Op.LOAD, b'{"status":"ok","value":{"attached":1,"points":[]}}'),
    (Op.LOAD, b'{"status":"ok","value":[true,[]]}'),
])
def test_wrong_answers_are_refused(op: Op, body: bytes) -> None:
    with pytest.raises(WireError):
        decode_reply(op, body)


def test_replies_that_do_not_fit_are_not_encoded() -> None:
    for op, value in ((Op.READ, {(1, 2, 3): [1], (1, 2, 4): [1, 2]}),
                      (Op.READ, {(1, 2, 3): [-1]}), (Op.READ, {(1, 2): [1]}),
                      (Op.READ, {(1, 2, 3): [2**64]}), (Op.DROPPED, True),
                      (Op.LOAD, (True, ["x"] * 65)), (Op.STALE, 1)):
        with pytest.raises(WireError):
            encode_reply(op, Reply(Status.OK, value))  # type: ignore[arg-type]
