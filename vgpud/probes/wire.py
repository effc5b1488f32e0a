"""The messages between vgpud and vgpud-probes: pure encode and decode.

A frame is a big-endian u32 length, then that many bytes of body. A request
body is one op byte, then its arguments; only DELETE has any (a u32 count,
then that many keys of three u64). A reply body is one status byte (OK, OFF:
the probes cannot run, with why; ERR: the request was refused, with why),
then for OK the op's answer: LOAD and REATTACH a flag and the attach points
(u16 count, each a u16 length and UTF-8), STALE a flag, READ a u32 count and
a u32 width then per entry the key and ``width`` counts (u64 each), DROPPED a
u64, DELETE nothing. Requests are bounded by REQUEST_MAX, replies by
REPLY_MAX (a full map read: HIST_ENTRIES x 69 u64, 9 MiB); anything else
raises WireError, which the helper answers ERR without acting.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vgpud.probes.histograms import CountKey

__all__ = ["DELETE_MAX", "REPLY_MAX", "REQUEST_MAX", "Op", "Reply", "Request", "Status",
           "Value", "WireError", "decode_reply", "decode_request", "encode_reply", "encode_request",
           "frame", "frame_length"]

HEADER = struct.Struct("!I")
KEY = struct.Struct("!QQQ")
DELETE_MAX = 4096  # keys in one DELETE; RemoteProbes sends more in several
REQUEST_MAX = 5 + DELETE_MAX * KEY.size
REPLY_MAX = 16 << 20
POINTS_MAX = 64
TEXT_MAX = 1024  # bytes of one attach point or reason (longer is cut)
WIDTH_MAX = 128  # u64s of one map value (struct vgpu_lat_val: 66)


class WireError(ValueError):
    """A malformed or oversized message."""


class Op(enum.IntEnum):
    LOAD = 1
    STALE = 2
    REATTACH = 3
    READ = 4
    DELETE = 5
    DROPPED = 6


class Status(enum.IntEnum):
    OK = 0
    OFF = 1
    ERR = 2


@dataclass(frozen=True)
class Request:
    op: Op
    keys: tuple[CountKey, ...] = ()


# An OK reply's value: LOAD, REATTACH (attached?, the attach points); STALE
# a flag; READ the map; DROPPED a count; DELETE None.
Value = tuple[bool, list[str]] | bool | dict[CountKey, list[int]] | int | None


@dataclass(frozen=True)
class Reply:
    """``value`` by op for OK (see the module doc); ``text`` for OFF and ERR."""

    status: Status
    value: Value = None
    text: str = ""


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes, limit: int) -> int:
    """The body length a frame header announces; WireError above ``limit``."""
    if len(header) != HEADER.size:
        raise WireError("a truncated frame header")
    (n,) = HEADER.unpack(header)
    if n > limit:
        raise WireError(f"a frame of {n} bytes (at most {limit})")
    return n


def encode_request(req: Request) -> bytes:
    if req.op is not Op.DELETE:
        if req.keys:
            raise WireError(f"{req.op.name} takes no keys")
        return bytes([req.op])
    if len(req.keys) > DELETE_MAX:
        raise WireError(f"{len(req.keys)} keys in one DELETE (at most {DELETE_MAX})")
    return bytes([req.op]) + struct.pack("!I", len(req.keys)) + b"".join(
        KEY.pack(*k) for k in req.keys)


def decode_request(body: bytes) -> Request:
    if not body or len(body) > REQUEST_MAX:
        raise WireError(f"a request of {len(body)} bytes")
    try:
        op = Op(body[0])
    except ValueError:
        raise WireError(f"unknown op {body[0]}") from None
    rest = body[1:]
    if op is not Op.DELETE:
        if rest:
            raise WireError(f"{op.name} takes no arguments ({len(rest)} bytes follow)")
        return Request(op)
    if len(rest) < 4:
        raise WireError("DELETE without a count")
    (n,) = struct.unpack_from("!I", rest)
    if n > DELETE_MAX or len(rest) != 4 + n * KEY.size:
        raise WireError(f"DELETE of {n} keys in {len(rest) - 4} bytes")
    return Request(op, tuple(KEY.iter_unpack(rest[4:])))


def _text(s: str) -> bytes:
    raw = s.encode("utf-8", errors="replace")[:TEXT_MAX]
    return struct.pack("!H", len(raw)) + raw


def _points(ok: bool, points: Sequence[str]) -> bytes:
    if len(points) > POINTS_MAX:
        raise WireError(f"{len(points)} attach points (at most {POINTS_MAX})")
    return bytes([ok]) + struct.pack("!H", len(points)) + b"".join(map(_text, points))


def _counts(counts: Mapping[CountKey, Sequence[int]]) -> bytes:
    widths = {len(v) for v in counts.values()}
    if len(widths) > 1:
        raise WireError(f"map values of different widths: {sorted(widths)}")
    width = widths.pop() if widths else 0
    if width > WIDTH_MAX:
        raise WireError(f"map values of {width} u64 (at most {WIDTH_MAX})")
    flat = [x for k, v in counts.items() for x in (*k, *v)]
    return struct.pack(f"!II{len(flat)}Q", len(counts), width, *flat)


def encode_reply(op: Op, reply: Reply) -> bytes:
    if reply.status is not Status.OK:
        return bytes([reply.status]) + _text(reply.text)
    head, value = bytes([Status.OK]), reply.value
    match op:
        case Op.LOAD | Op.REATTACH if isinstance(value, tuple):
            return head + _points(*value)
        case Op.STALE if isinstance(value, bool):
            return head + bytes([value])
        case Op.READ if isinstance(value, dict):
            return head + _counts(value)
        case Op.DROPPED if isinstance(value, int) and 0 <= value < 1 << 64:
            return head + struct.pack("!Q", value)
        case Op.DELETE if value is None:
            return head
    raise WireError(f"{op.name} cannot answer {value!r:.80}")


class _Reader:
    def __init__(self, body: bytes) -> None:
        self.body = memoryview(body)
        self.at = 0

    def take(self, n: int) -> memoryview:
        if self.at + n > len(self.body):
            raise WireError("a truncated reply")
        out = self.body[self.at:self.at + n]
        self.at += n
        return out

    def unpack(self, fmt: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def text(self) -> str:
        (n,) = self.unpack("!H")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def flag(self) -> bool:
        (b,) = self.unpack("!B")
        if b > 1:
            raise WireError(f"a flag of {b}")
        return bool(b)

    def end(self) -> None:
        if self.at != len(self.body):
            raise WireError(f"{len(self.body) - self.at} bytes after the reply")


def decode_reply(op: Op, body: bytes) -> Reply:
    if len(body) > REPLY_MAX:
        raise WireError(f"a reply of {len(body)} bytes")
    r = _Reader(body)
    (status_byte,) = r.unpack("!B")
    try:
        status = Status(status_byte)
    except ValueError:
        raise WireError(f"unknown status {status_byte}") from None
    if status is not Status.OK:
        text = r.text()
        r.end()
        return Reply(status, text=text)
    value: Value = None
    match op:
        case Op.LOAD | Op.REATTACH:
            ok = r.flag()
            (n,) = r.unpack("!H")
            if n > POINTS_MAX:
                raise WireError(f"{n} attach points")
            value = (ok, [r.text() for _ in range(n)])
        case Op.STALE:
            value = r.flag()
        case Op.READ:
            n, width = r.unpack("!II")
            if width > WIDTH_MAX:
                raise WireError(f"map values of {width} u64")
            if n * (3 + width) * 8 != len(r.body) - r.at:
                raise WireError(f"{n} entries of {width} u64 in {len(r.body) - r.at} bytes")
            flat = r.unpack(f"!{n * (3 + width)}Q")
            step = 3 + width
            value = {(flat[i], flat[i + 1], flat[i + 2]): list(flat[i + 3:i + step])
                     for i in range(0, len(flat), step)}
        case Op.DROPPED:
            (value,) = r.unpack("!Q")
    r.end()
    return Reply(status, value)
