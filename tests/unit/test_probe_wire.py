"""vgpud.probes.wire: what is encoded decodes to itself; anything else is a WireError."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpud.probes.layout import LAT_SLOTS
from vgpud.probes.wire import (
    DELETE_MAX,
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
    frame,
    frame_length,
)

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
    assert encode_request(req) == body


@given(st.binary(max_size=300), st.sampled_from(Op))
def test_any_reply_bytes_decode_or_raise_wire_error(body: bytes, op: Op) -> None:
    with contextlib.suppress(WireError):
        decode_reply(op, body)


def test_delete_count_must_match_its_bytes() -> None:
    body = encode_request(Request(Op.DELETE, ((1, 2, 3), (4, 5, 6))))
    for bad in (body[:-1], body + b"\0", body[:1] + struct.pack("!I", 3) + body[5:],
                body[:1] + struct.pack("!I", DELETE_MAX + 1) + body[5:]):
        with pytest.raises(WireError):
            decode_request(bad)
    with pytest.raises(WireError):
        encode_request(Request(Op.DELETE, ((0, 0, 0),) * (DELETE_MAX + 1)))
    with pytest.raises(WireError):
        decode_request(bytes([Op.READ, 0]))
    with pytest.raises(WireError):
        decode_request(bytes([0]))


def test_frames_are_bounded() -> None:
    assert frame_length(frame(b"x" * 10)[:4], 10) == 10
    with pytest.raises(WireError):
        frame_length(frame(b"x" * 11)[:4], 10)
    with pytest.raises(WireError):
        frame_length(b"\0\0", REQUEST_MAX)
    # The largest DELETE fits in a request.
    assert len(encode_request(Request(Op.DELETE, ((2**64 - 1,) * 3,) * DELETE_MAX))) \
        <= REQUEST_MAX


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


def test_a_read_whose_count_lies_is_refused() -> None:
    body = encode_reply(Op.READ, Reply(Status.OK, {(1, 2, 3): [0] * 66}))
    lie = body[:1] + struct.pack("!I", 2**31) + body[5:]
    with pytest.raises(WireError):
        decode_reply(Op.READ, lie)
    with pytest.raises(WireError):
        decode_reply(Op.READ, body + b"\0")
