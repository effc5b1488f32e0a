"""vgpud.metrics.wire: a Snapshot through the pipe's encoding and framing,
and everything else refused with WireError (never another exception)."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import fields, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpud.kernel.uapi import Stats, Stats4
from vgpud.metrics.snapshot import DaemonFigures, Snapshot, TenantGpu
from vgpud.metrics.wire import (
    HELLO,
    MAX_PAYLOAD,
    FrameReader,
    WireError,
    decode,
    decode_hello,
    encode,
    frame,
)
from vgpud.wire import HEADER_SIZE, MAGIC, body_length

u64 = st.integers(min_value=0, max_value=2**64 - 1)
big = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # byte figures: 64 bits
ratio = st.none() | st.floats(allow_nan=False, allow_infinity=False) | st.integers(0, 100)
rows = st.builds(TenantGpu, st.text(), st.integers(0, 2**32 - 1), st.text(), big, big, u64,
                 st.none() | u64, ratio, ratio)
daemon = st.builds(DaemonFigures, u64, st.dictionaries(st.text(), u64, max_size=8), u64, u64, u64,
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


def test_the_frames_are_vgpud_wires() -> None:
    """HELLO first (the frame the listening socket comes with), then
    snapshots: the magic with its version byte, the length, the JSON body."""
    assert HELLO == b'VGW\x01\x11\x00\x00\x00{"listener":true}'
    decode_hello(HELLO[HEADER_SIZE:])
    for bad in (b'{"listener":false}', b'{"listener":true,"x":1}', b"[]", b"L"):
        with pytest.raises(WireError):
            decode_hello(bad)
    out = frame(encode(ONE))
    assert body_length(out[:HEADER_SIZE], MAX_PAYLOAD) == len(out) - HEADER_SIZE
    assert json.loads(out[HEADER_SIZE:]) == {
        "tenants": [["t", 0, "", 1, 2, 3, None, 50.0, None]],
        "daemon": {"upcalls": 1, "verdicts": {"allow": 1}, "malformed": 0, "policy_errors": 0,
                   "overruns": 0, "latency": [0, 1], "latency_sum_ns": 9},
        "module": None, "module4": None}
    with pytest.raises(WireError):
        frame(b" " * (MAX_PAYLOAD + 1))


@settings(deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_wire_error(data: bytes) -> None:
    with contextlib.suppress(WireError):
        decode(data)


ONE = Snapshot((TenantGpu("t", 0, "", 1, 2, 3, None, 50.0, None),),
               DaemonFigures(1, {"allow": 1}, 0, 0, 0, (0, 1), 9), None, None)
DAEMON = {"upcalls": 1, "verdicts": {}, "malformed": 0, "policy_errors": 0, "overruns": 0,
          "latency": [], "latency_sum_ns": 0}
ROW = ["t", 0, "", 1, 2, 3, None, 50.0, None]


def snap(**changes: Any) -> dict[str, Any]:
    return {"tenants": [], "daemon": DAEMON, "module": None, "module4": None, **changes}


@pytest.mark.parametrize("value", [
    None, 1, [], [[], DAEMON, None, None], snap(extra=1),
    {k: v for k, v in snap().items() if k != "module4"},
    snap(tenants=[ROW[:8]]), snap(tenants=[[*ROW, None]]), snap(tenants=[{"t": ROW}]),
    snap(tenants=[["t", True, *ROW[2:]]]), snap(tenants=[["t", 0, 1, *ROW[3:]]]),
    snap(tenants=[[*ROW[:7], "50", None]]), snap(tenants=[[*ROW[:3], 2**64, *ROW[4:]]]),
    snap(tenants=[[*ROW[:5], -1, *ROW[6:]]]), snap(tenants=[["t", -1, *ROW[2:]]]),
    snap(tenants=[[*ROW[:6], 1.5, *ROW[7:]]]),
    snap(daemon={**DAEMON, "verdicts": {"allow": 1.0}}),
    snap(daemon={**DAEMON, "verdicts": [["allow", 1]]}),
    snap(daemon={**DAEMON, "latency": [1.5]}), snap(daemon={**DAEMON, "upcalls": -1}),
    snap(daemon={k: v for k, v in DAEMON.items() if k != "overruns"}),
    snap(module=[1, 2]), snap(module={"version": 1}),
    snap(module4={f.name: 0 for f in fields(Stats4)} | {"extra": 0}),
    snap(module4={f.name: True for f in fields(Stats4)}),
])
def test_wrong_shapes_are_refused(value: Any) -> None:
    with pytest.raises(WireError):
        decode(json.dumps(value).encode())


def test_the_checks_accept_what_encode_writes() -> None:
    """The refusals above are of the shape, not of every snapshot."""
    assert decode(encode(ONE)) == ONE
    assert decode(json.dumps(snap(tenants=[ROW])).encode()).tenants == ONE.tenants
    assert decode(encode(replace(ONE, module4=Stats4(*range(len(fields(Stats4))))))).module4


def test_a_share_that_is_no_number_is_sent_as_none() -> None:
    """JSON has no NaN nor infinity: such a share is no sample, never a
    refresh that raises on the loop."""
    row = replace(ONE.tenants[0], share_target=math.nan, share_measured=math.inf)
    back = decode(encode(replace(ONE, tenants=(row, ONE.tenants[0]))))
    assert back.tenants == (replace(row, share_target=None, share_measured=None),
                            ONE.tenants[0])
