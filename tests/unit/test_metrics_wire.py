"""vgpud.metrics.wire: a Snapshot through the pipe's encoding and framing,
and everything else refused with WireError (never another exception)."""

from __future__ import annotations

import contextlib
import marshal
from dataclasses import fields, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpud.kernel.uapi import Stats, Stats4
from vgpud.metrics.snapshot import DaemonFigures, Snapshot, TenantGpu
from vgpud.metrics.wire import MAGIC, FrameReader, WireError, decode, encode, frame

u64 = st.integers(min_value=0, max_value=2**64 - 1)
big = st.integers(min_value=-(2**70), max_value=2**70)  # marshal keeps any int
ratio = st.none() | st.floats(allow_nan=False) | st.integers(0, 100)
rows = st.builds(TenantGpu, st.text(), u64, st.text(), big, big, u64, st.none() | u64,
                 ratio, ratio)
daemon = st.builds(DaemonFigures, u64, st.dictionaries(st.text(), u64), u64, u64, u64,
                   st.lists(u64, max_size=64).map(tuple), u64)
stats = st.builds(Stats, *[u64 for _ in fields(Stats)])
stats4 = st.builds(Stats4, *[u64 for _ in fields(Stats4)])
snapshots = st.builds(Snapshot, st.lists(rows, max_size=20).map(tuple), daemon,
                      st.none() | stats, st.none() | stats4)


@given(snapshots)
def test_round_trip(snapshot: Snapshot) -> None:
    assert decode(encode(snapshot)) == snapshot


@given(st.lists(snapshots, min_size=1, max_size=4), st.binary(max_size=64),
       st.lists(st.integers(1, 500), min_size=1, max_size=10))
def test_frames_in_any_chunks_after_any_garbage(snapshot_list: list[Snapshot], junk: bytes,
                                                cuts: list[int]) -> None:
    """Garbage before the first frame is skipped (never more than itself);
    the frames come out whole, in order, however the pipe splits them."""
    stream = junk.replace(MAGIC[:1], b"") + b"".join(frame(encode(s)) for s in snapshot_list)
    reader = FrameReader()
    out: list[bytes] = []
    at = 0
    while at < len(stream):
        step = cuts[len(out) % len(cuts)]
        out += reader.feed(stream[at:at + step])
        at += step
    assert [decode(p) for p in out] == snapshot_list
    assert reader.skipped == len(junk.replace(MAGIC[:1], b""))


def test_an_oversized_length_is_skipped_not_awaited() -> None:
    good = frame(encode(Snapshot((), DaemonFigures(1, {}, 0, 0, 0, (), 0), None, None)))
    reader = FrameReader()
    assert reader.feed(MAGIC + b"\xff\xff\xff\xff" + good) == [good[8:]]
    assert reader.skipped == 8


@settings(deadline=None)  # b"[\0\0\0\x0c": marshal makes a list of 201M slots first
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_wire_error(data: bytes) -> None:
    with contextlib.suppress(WireError):
        decode(data)


ONE = Snapshot((TenantGpu("t", 0, "", 1, 2, 3, None, 50.0, None),),
               DaemonFigures(1, {"allow": 1}, 0, 0, 0, (0, 1), 9), None, None)


@pytest.mark.parametrize("value", [
    None, 1, (), (1, 2, 3, 4), [(), (), None, None],
    ((), (1, (), 0, 0, 0, (), 0), None),
    ((("t", 0, "", 1, 2, 3, None, 50.0),), (1, (), 0, 0, 0, (), 0), None, None),
    ((("t", True, "", 1, 2, 3, None, 50.0, None),), (1, (), 0, 0, 0, (), 0), None, None),
    ((("t", 0, b"", 1, 2, 3, None, 50.0, None),), (1, (), 0, 0, 0, (), 0), None, None),
    ((("t", 0, "", 1, 2, 3, None, "50", None),), (1, (), 0, 0, 0, (), 0), None, None),
    ((), (1, (("allow", 1.0),), 0, 0, 0, (), 0), None, None),
    ((), (1, (), 0, 0, 0, (1.5,), 0), None, None),
    ((), (1, (), 0, 0, 0, (), 0), (1, 2), None),
    ((), (1, (), 0, 0, 0, (), 0), None, tuple(range(len(fields(Stats4)) + 1))),
    ((), (1, (), 0, 0, 0, (), 0), None, frozenset()),
])
def test_wrong_shapes_are_refused(value: Any) -> None:
    with pytest.raises(WireError):
        decode(marshal.dumps(value))


def test_the_checks_accept_what_encode_writes() -> None:
    """The refusals above are of the shape, not of every snapshot."""
    assert decode(encode(ONE)) == ONE
    assert decode(encode(replace(ONE, module4=Stats4(*range(len(fields(Stats4))))))).module4
