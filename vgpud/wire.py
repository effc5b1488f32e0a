"""The one wire format between vgpud and its three helpers (pure).

vgpud-probes (vgpud.probes.wire), vgpud-fsmount (vgpud.fsview.mountfd and
.helper) and vgpud-metrics (vgpud.metrics.wire) all speak frames:

    offset 0  4 bytes  MAGIC: b"VGW" then the format's version byte (1)
    offset 4  u32      the body's length in bytes, little-endian
    offset 8  body     one JSON value (RFC 8259), UTF-8

Each channel bounds its bodies (its ``limit``); a header announcing more, a
magic that is not ours or another version is a WireError, never a wait for
more bytes. ``encode`` writes plain ASCII (any other character escaped)
and refuses NaN and infinities; ``decode`` takes UTF-8 only and refuses
the NaN and Infinity literals, an object with a key twice, nesting past
Python's recursion limit and ints of over 4,300 digits (Python's own bound;
a float that overflows to inf is refused by ``as_float``).

Why JSON: it keeps any int exactly and floats to the bit (repr is the
shortest round trip), is the same in every Python 3 and every language,
and builds only dicts, lists, str, int, float, bool and None: never a
serializer that makes whatever objects the bytes name, or whose bytes
change with Python's version. Each channel's module documents its bodies'
shapes and decodes them through the checked helpers below (``as_object``,
``as_int``...), into its own dataclasses only. What it costs against the
binary encodings it replaced (tests/bench/bench_wire.py,
docs/performance.md): 2.3x the CPU of a full probes map READ (16,384
entries of 69 u64: 181 ms against 79 ms, encode and decode), under the 5x
that would have asked for another encoding there.

Two readers. ``FrameReader`` cuts a one-way stream of frames that stand
alone (the metrics snapshots): bytes in, whole bodies out; a bad header is
skipped up to the next MAGIC, so a bad frame costs that frame, never the
stream. ``read_frame`` reads one frame of a request/reply connection
(probes, fsmount): there a bad header leaves the stream out of step, so the
caller answers it (an error) and closes the connection, except a header
that is ours but too long (``Oversized``), whose bytes the caller may read
and drop to stay in step.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Collection
from typing import cast

__all__ = ["HEADER_SIZE", "MAGIC", "U64_MAX", "VERSION", "FrameReader", "Oversized",
           "WireError", "as_bool", "as_dict", "as_float", "as_int", "as_ints", "as_list",
           "as_object", "as_str", "body_length", "decode", "encode", "frame", "read_frame"]

VERSION = 1
MAGIC = b"VGW" + bytes([VERSION])
HEADER = struct.Struct("<4sI")
HEADER_SIZE = HEADER.size  # 8
U64_MAX = 2**64 - 1
_CHUNK = 1 << 20  # the most one recv is asked for


class WireError(ValueError):
    """A frame or body that is not what the channel sends (what is wrong, in words)."""


class Oversized(WireError):
    """A header of ours announcing a body over the channel's limit."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"a frame of {length} bytes (at most {limit})")
        self.length = length


# --- frames ---


def frame(body: bytes, limit: int) -> bytes:
    """``body`` with its header; WireError when it is over ``limit``."""
    if len(body) > limit:
        raise WireError(f"a body of {len(body)} bytes (at most {limit})")
    return HEADER.pack(MAGIC, len(body)) + body


def body_length(header: bytes, limit: int) -> int:
    """The body length a header announces: WireError for a header that is
    not ours (or truncated), Oversized for one over ``limit``."""
    if len(header) != HEADER_SIZE:
        raise WireError(f"a frame header of {len(header)} bytes")
    magic, length = HEADER.unpack(header)
    if magic != MAGIC:
        if magic[:3] == MAGIC[:3]:
            raise WireError(f"wire format version {magic[3]} (this side speaks {VERSION})")
        raise WireError(f"no frame header: {bytes(magic)!r}")
    if length > limit:
        raise Oversized(length, limit)
    return int(length)


def read_frame(recv: Callable[[int], bytes], limit: int) -> bytes | None:
    """One body from a blocking stream, ``recv(n)`` giving at most n bytes
    (b"" at its end): None at the end of the stream before a frame;
    WireError for a bad header (Oversized: the rest of the frame is
    unread) and for an end of stream inside a frame."""
    header = _exactly(recv, HEADER_SIZE, at_start=True)
    if header is None:
        return None
    body = _exactly(recv, body_length(header, limit), at_start=False)
    assert body is not None
    return body


def _exactly(recv: Callable[[int], bytes], n: int, at_start: bool) -> bytes | None:
    chunks: list[bytes] = []
    got = 0
    while got < n:
        chunk = recv(min(n - got, _CHUNK))
        if not chunk:
            if at_start and got == 0:
                return None
            raise WireError(f"the stream ended inside a frame ({got} of {n} bytes)")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class FrameReader:
    """Bytes of a one-way stream in, whole bodies out. A header that is not
    ours, or that announces more than ``limit``, is dropped up to the next
    MAGIC after its first byte, the bytes counted in ``skipped`` (the caller
    logs them); so at most one frame plus one read is ever held."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()
        self.skipped = 0

    def feed(self, data: bytes) -> list[bytes]:
        """The bodies ``data`` completes, oldest first."""
        self._buf += data
        out: list[bytes] = []
        while len(self._buf) >= HEADER_SIZE:
            magic, length = HEADER.unpack_from(self._buf)
            if magic != MAGIC or length > self.limit:
                self._resync()
                continue
            end = HEADER_SIZE + length
            if len(self._buf) < end:
                break
            out.append(bytes(self._buf[HEADER_SIZE:end]))
            del self._buf[:end]
        return out

    def _resync(self) -> None:
        """Drop up to the next magic after the first byte (or all but a tail
        that could start one)."""
        at = self._buf.find(MAGIC, 1)
        drop = at if at >= 0 else max(1, len(self._buf) - (len(MAGIC) - 1))
        self.skipped += drop
        del self._buf[:drop]


# --- bodies ---

_dumps = json.JSONEncoder(ensure_ascii=True, allow_nan=False, check_circular=False,
                          separators=(",", ":")).encode


def encode(value: object) -> bytes:
    """``value`` (dicts with str keys, lists, tuples, str, int, finite
    float, bool, None) as a body; WireError for anything else."""
    try:
        return _dumps(value).encode("ascii")
    except (TypeError, ValueError, RecursionError) as exc:
        raise WireError(f"cannot encode: {exc}") from None


def _refuse_constant(name: str) -> object:
    raise WireError(f"{name} is not a JSON number")


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise WireError("an object with a key twice")
    return out


_loads = json.JSONDecoder(parse_constant=_refuse_constant, object_pairs_hook=_unique).decode


def decode(body: bytes) -> object:
    """The JSON value ``body`` holds; WireError for anything else."""
    try:
        return _loads(body.decode("utf-8"))
    except WireError:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError, JSONDecodeError, digits
        raise WireError(f"not a JSON body ({exc})") from None


# --- checked values: a decoder takes each field through one of these ---


def as_object(value: object, what: str, keys: Collection[str],
              optional: Collection[str] = ()) -> dict[str, object]:
    """An object with exactly ``keys`` (and any of ``optional``)."""
    if type(value) is not dict:
        raise WireError(f"{what}: an object expected, got {_name(value)}")
    missing = [k for k in keys if k not in value]
    extra = [k for k in value if k not in keys and k not in optional]
    if missing or extra:
        raise WireError(f"{what}: keys {sorted(missing)} missing, {sorted(extra)[:8]} unknown")
    return value


def as_dict(value: object, what: str, most: int | None = None) -> dict[str, object]:
    """An object with any keys (at most ``most``): a map whose keys are data."""
    if type(value) is not dict:
        raise WireError(f"{what}: an object expected, got {_name(value)}")
    if most is not None and len(value) > most:
        raise WireError(f"{what}: {len(value)} keys (at most {most})")
    return value


def as_list(value: object, what: str, size: int | None = None,
            most: int | None = None) -> list[object]:
    """A list of ``size`` items (any number up to ``most``)."""
    if type(value) is not list:
        raise WireError(f"{what}: a list expected, got {_name(value)}")
    if (size is not None and len(value) != size) or (most is not None and len(value) > most):
        want = f"{size}" if size is not None else f"at most {most}"
        raise WireError(f"{what}: {want} items expected, got {len(value)}")
    return value


def as_int(value: object, what: str, lo: int = 0, hi: int = U64_MAX) -> int:
    """An int in [lo, hi] (a bool is no int here)."""
    if type(value) is not int:
        raise WireError(f"{what}: an integer expected, got {_name(value)}")
    if not lo <= value <= hi:
        raise WireError(f"{what}: {value} is out of [{lo}, {hi}]")
    return value


def as_ints(value: object, what: str, size: int | None = None, lo: int = 0,
            hi: int = U64_MAX) -> list[int]:
    """A list of ints in [lo, hi], checked at C speed (a map's counts)."""
    items = as_list(value, what, size)
    if not items:
        return []
    if set(map(type, items)) <= {int}:
        ints = cast(list[int], items)
        if lo <= min(ints) and max(ints) <= hi:
            return ints
    for item in items:
        as_int(item, what, lo, hi)
    raise AssertionError("unreachable: one item failed the check above")


def as_str(value: object, what: str, most: int | None = None) -> str:
    if type(value) is not str:
        raise WireError(f"{what}: a string expected, got {_name(value)}")
    if most is not None and len(value) > most:
        raise WireError(f"{what}: {len(value)} characters (at most {most})")
    return value


def as_bool(value: object, what: str) -> bool:
    if type(value) is not bool:
        raise WireError(f"{what}: true or false expected, got {_name(value)}")
    return value


def as_float(value: object, what: str) -> float:
    """A finite number (JSON writes 50.0 as 50.0, but a peer may write 50)."""
    if type(value) is int and abs(value) <= 2**53:
        value = float(value)
    if type(value) is not float or not math.isfinite(value):
        got = repr(value) if type(value) is float else _name(value)
        raise WireError(f"{what}: a finite number expected, got {got}")
    return value


def _name(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", int: "an integer",
            float: "a number", bool: "a boolean", type(None): "null"}.get(type(value),
                                                                         type(value).__name__)
