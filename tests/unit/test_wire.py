"""vgpud.wire: the one frame format of the helpers, pinned byte for byte, and
everything that is not a frame or a body of it refused with WireError."""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpud.wire import (
    HEADER_SIZE,
    MAGIC,
    U64_MAX,
    VERSION,
    FrameReader,
    Oversized,
    WireError,
    as_bool,
    as_dict,
    as_float,
    as_int,
    as_ints,
    as_list,
    as_object,
    as_str,
    body_length,
    decode,
    encode,
    frame,
    read_frame,
)


def test_the_header_is_pinned() -> None:
    """offset 0: b"VGW" and the version byte; offset 4: the body's length,
    u32 little-endian; offset 8: the body, JSON."""
    assert (HEADER_SIZE, VERSION, MAGIC) == (8, 1, b"VGW\x01")
    out = frame(b'{"op":"read"}', 100)
    assert out[:3] == b"VGW" and out[3] == VERSION
    assert struct.unpack_from("<I", out, 4) == (13,)
    assert out == b'VGW\x01\x0d\x00\x00\x00{"op":"read"}'
    assert body_length(out[:8], 13) == 13


def test_headers_that_are_not_ours_or_too_long_are_refused() -> None:
    head = frame(b"x" * 11, 100)[:8]
    with pytest.raises(Oversized) as too_long:
        body_length(head, 10)
    assert too_long.value.length == 11
    with pytest.raises(WireError, match="version 2"):
        body_length(b"VGW\x02" + head[4:], 100)
    with pytest.raises(WireError, match="no frame header"):
        body_length(b"\0\0\0\x0b" + head[4:], 100)
    with pytest.raises(WireError, match="header of 4 bytes"):
        body_length(head[:4], 100)
    with pytest.raises(WireError):
        frame(b"x" * 11, 10)


def test_the_body_is_compact_ascii_json() -> None:
    value = {"s": "é\u2603\n\"", "n": [0, U64_MAX, -1], "f": 0.1, "b": True, "z": None}
    body = encode(value)
    assert body.isascii() and b" " not in body
    assert json.loads(body) == value == decode(body)
    assert encode((1, 2)) == b"[1,2]"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), [float("-inf")], {1j: 0},
                                   b"bytes", object()])
def test_what_json_cannot_say_is_not_encoded(value: object) -> None:
    with pytest.raises(WireError):
        encode(value)


@pytest.mark.parametrize("body", [
    b"", b"{", b"NaN", b"[Infinity]", b"-Infinity", b'{"a":1,"a":2}', b"\xff", b"'x'",
    b"[1] [2]", b"[" * 100_000 + b"]" * 100_000, b"1" * 5000, "[1]".encode("utf-16"),
])
def test_what_is_not_strict_json_is_refused(body: bytes) -> None:
    with pytest.raises(WireError):
        decode(body)


@settings(deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_wire_error(body: bytes) -> None:
    with contextlib.suppress(WireError):
        decode(body)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20)


@given(json_values)
def test_values_round_trip(value: object) -> None:
    assert decode(encode(value)) == value


def test_checked_values() -> None:
    assert as_object({"a": 1}, "x", ("a",)) == {"a": 1}
    assert as_object({"a": 1, "b": 2}, "x", ("a",), optional=("b",)) == {"a": 1, "b": 2}
    assert as_dict({"any": 1}, "x") == {"any": 1}
    assert as_list([1, 2], "x", 2) == [1, 2]
    assert as_int(U64_MAX, "x") == U64_MAX and as_int(-5, "x", lo=-5) == -5
    assert as_ints([0, U64_MAX], "x", 2) == [0, U64_MAX] and as_ints([], "x") == []
    assert as_str("s", "x", 1) == "s" and as_bool(False, "x") is False
    assert as_float(50, "x") == 50.0 and type(as_float(50, "x")) is float
    for bad in (lambda: as_object({"a": 1}, "x", ("a", "b")),
                lambda: as_object({"a": 1, "c": 0}, "x", ("a",)),
                lambda: as_object([], "x", ()),
                lambda: as_dict({"a": 1, "b": 2}, "x", most=1),
                lambda: as_list((1, 2), "x"), lambda: as_list([1], "x", 2),
                lambda: as_list([1, 2], "x", most=1),
                lambda: as_int(True, "x"), lambda: as_int(1.0, "x"), lambda: as_int(-1, "x"),
                lambda: as_int(U64_MAX + 1, "x"), lambda: as_int(3, "x", hi=2),
                lambda: as_ints([1, True], "x"), lambda: as_ints([1, -1], "x"),
                lambda: as_ints([1, 2**64], "x"), lambda: as_ints([1, 1.0], "x"),
                lambda: as_ints([1, None], "x"), lambda: as_ints([1], "x", 2),
                lambda: as_str(b"s", "x"), lambda: as_str("ss", "x", 1),
                lambda: as_bool(0, "x"), lambda: as_float(True, "x"),
                lambda: as_float("1", "x"), lambda: as_float(float("inf"), "x"),
                lambda: as_float(10**400, "x")):
        with pytest.raises(WireError):
            bad()


def recv_from(data: bytes, most: int) -> Callable[[int], bytes]:
    """A blocking stream of ``data``, handing out at most ``most`` bytes a read."""
    pending = [data]

    def recv(n: int) -> bytes:
        out, pending[0] = pending[0][:min(n, most)], pending[0][min(n, most):]
        return out
    return recv


def test_a_frame_from_one_side_reads_on_the_other() -> None:
    recv = recv_from(frame(encode({"op": "read"}), 100) + frame(encode([1, 2]), 100), 5)
    first = read_frame(recv, 100)
    assert first is not None and decode(first) == {"op": "read"}
    second = read_frame(recv, 100)
    assert second is not None and decode(second) == [1, 2]
    assert read_frame(recv, 100) is None  # the end, between frames


def test_read_frame_refuses_before_reading_a_body() -> None:
    with pytest.raises(Oversized):
        read_frame(recv_from(frame(b"x" * 11, 100), 100), 10)
    with pytest.raises(WireError, match="no frame header"):
        read_frame(recv_from(b"GET / HTTP/1.0\r\n\r\n", 100), 100)
    with pytest.raises(WireError, match="ended inside a frame"):
        read_frame(recv_from(frame(b"xyz", 100)[:-1], 100), 100)
    with pytest.raises(WireError, match="ended inside a frame"):
        read_frame(recv_from(MAGIC, 100), 100)


@given(st.lists(st.binary(max_size=40), min_size=1, max_size=4), st.binary(max_size=64),
       st.lists(st.integers(1, 50), min_size=1, max_size=10))
def test_frame_reader_in_any_chunks_after_any_garbage(bodies: list[bytes], junk: bytes,
                                                      cuts: list[int]) -> None:
    """Garbage before the first frame is skipped (never more than itself);
    the bodies come out whole, in order, however the stream is split."""
    junk = junk.replace(MAGIC[:1], b"")
    stream = junk + b"".join(frame(b, 40) for b in bodies)
    reader = FrameReader(40)
    out: list[bytes] = []
    at = i = 0
    while at < len(stream):
        step = cuts[i % len(cuts)]
        out += reader.feed(stream[at:at + step])
        at, i = at + step, i + 1
    assert out == bodies
    assert reader.skipped == len(junk)


def test_frame_reader_skips_oversized_and_other_versions_without_waiting() -> None:
    good = frame(b"[]", 10)
    reader = FrameReader(10)
    assert reader.feed(MAGIC + b"\xff\xff\xff\xff" + good) == [b"[]"]
    assert reader.skipped == 8
    assert reader.feed(b"VGW\x02\x02\x00\x00\x00[]" + good) == [b"[]"]
    assert reader.skipped == 8 + 10
