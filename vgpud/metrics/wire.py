"""A Snapshot on the connection from the daemon to its metrics exporter (pure).

The daemon first sends ``HELLO``, one byte that carries the listening socket
(SCM_RIGHTS), then frames. A frame is ``MAGIC``, the payload's length (u32, little-endian) and the
payload: marshal of plain tuples of ints, floats, strs and None (never
pickle: decoding builds only the Snapshot's own dataclasses, from values
whose every type is checked). ``encode`` runs on the event loop, once per
refresh: tuples of the fields, one marshal.dumps. ``FrameReader`` cuts a
byte stream into payloads; a frame that does not start with the magic or
is longer than MAX_PAYLOAD is skipped up to the next magic, so a bad frame
costs that frame, never the stream.
"""

from __future__ import annotations

import marshal
import struct
from dataclasses import fields

from vgpud.kernel.uapi import Stats, Stats4
from vgpud.metrics.snapshot import DaemonFigures, Snapshot, TenantGpu

__all__ = ["HELLO", "MAGIC", "MAX_PAYLOAD", "FrameReader", "WireError", "decode", "encode", "frame"]

HELLO = b"L"
MAGIC = b"VGM1"
_HEADER = struct.Struct("<4sI")
MAX_PAYLOAD = 64 << 20  # 8 GPUs x 4096 tenants is about 3 MiB
_MARSHAL_VERSION = 4
_STATS_FIELDS = len(fields(Stats))
_STATS4_FIELDS = len(fields(Stats4))
_ROW_FIELDS = len(fields(TenantGpu))


class WireError(ValueError):
    """A payload that is not an encoded Snapshot (what is wrong, in words)."""


def encode(snapshot: Snapshot) -> bytes:
    """The payload of ``snapshot`` (without the frame header)."""
    d = snapshot.daemon
    m, m4 = snapshot.module, snapshot.module4
    return marshal.dumps((
        tuple([(r.tenant, r.gpu, r.gpu_uuid, r.used_bytes, r.limit_bytes, r.denied,
                r.gpu_time_ns, r.share_target, r.share_measured) for r in snapshot.tenants]),
        (d.upcalls, tuple(d.verdicts.items()), d.malformed, d.policy_errors, d.overruns,
         d.latency, d.latency_sum_ns),
        None if m is None else tuple([getattr(m, f.name) for f in fields(m)]),
        None if m4 is None else tuple([getattr(m4, f.name) for f in fields(m4)]),
    ), _MARSHAL_VERSION)


def frame(payload: bytes) -> bytes:
    """``payload`` with its header, ready for the pipe."""
    return _HEADER.pack(MAGIC, len(payload)) + payload


def decode(payload: bytes) -> Snapshot:
    """The Snapshot ``payload`` encodes; WireError for anything else."""
    try:
        value = marshal.loads(payload)
    except Exception as exc:  # EOFError, ValueError, TypeError, RecursionError...
        raise WireError(f"not marshal data ({exc!r})") from None
    top = _tuple(value, 4, "snapshot")
    rows = _tuple(top[0], None, "tenants")
    tenants = tuple(_row(row) for row in rows)
    d = _tuple(top[1], 7, "daemon figures")
    verdicts = {}
    for pair in _tuple(d[1], None, "verdicts"):
        name, count = _tuple(pair, 2, "verdict")
        verdicts[_str(name)] = _int(count)
    latency = tuple(_int(v) for v in _tuple(d[5], None, "latency"))
    daemon = DaemonFigures(upcalls=_int(d[0]), verdicts=verdicts, malformed=_int(d[2]),
                           policy_errors=_int(d[3]), overruns=_int(d[4]), latency=latency,
                           latency_sum_ns=_int(d[6]))
    module = None if top[2] is None else Stats(*_ints(top[2], _STATS_FIELDS, "vgpu_stats"))
    module4 = None if top[3] is None else Stats4(*_ints(top[3], _STATS4_FIELDS, "vgpu_stats4"))
    return Snapshot(tenants, daemon, module, module4)


class FrameReader:
    """Bytes from the pipe in, whole payloads out; skipped bytes counted in
    ``skipped`` (the caller logs them)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.skipped = 0

    def feed(self, data: bytes) -> list[bytes]:
        """The payloads ``data`` completes, oldest first."""
        self._buf += data
        out: list[bytes] = []
        while len(self._buf) >= _HEADER.size:
            magic, length = _HEADER.unpack_from(self._buf)
            if magic != MAGIC or length > MAX_PAYLOAD:
                self._resync()
                continue
            end = _HEADER.size + length
            if len(self._buf) < end:
                break
            out.append(bytes(self._buf[_HEADER.size:end]))
            del self._buf[:end]
        return out

    def _resync(self) -> None:
        """Drop up to the next magic after the first byte (or all but a tail
        that could start one)."""
        at = self._buf.find(MAGIC, 1)
        drop = at if at >= 0 else max(1, len(self._buf) - (len(MAGIC) - 1))
        self.skipped += drop
        del self._buf[:drop]


def _tuple(value: object, size: int | None, what: str) -> tuple[object, ...]:
    if type(value) is not tuple or (size is not None and len(value) != size):
        want = "a tuple" if size is None else f"a {size}-tuple"
        raise WireError(f"{what}: {want} expected, got {type(value).__name__}")
    return value


def _int(value: object) -> int:
    if type(value) is not int:
        raise WireError(f"an int expected, got {type(value).__name__}")
    return value


def _str(value: object) -> str:
    if type(value) is not str:
        raise WireError(f"a str expected, got {type(value).__name__}")
    return value


def _opt_int(value: object) -> int | None:
    return None if value is None else _int(value)


def _opt_float(value: object) -> float | None:
    if value is None:
        return None
    if type(value) not in (float, int):
        raise WireError(f"a number expected, got {type(value).__name__}")
    return value  # type: ignore[return-value]


def _ints(value: object, size: int, what: str) -> list[int]:
    return [_int(v) for v in _tuple(value, size, what)]


def _row(value: object) -> TenantGpu:
    r = _tuple(value, _ROW_FIELDS, "tenant row")
    return TenantGpu(_str(r[0]), _int(r[1]), _str(r[2]), _int(r[3]), _int(r[4]), _int(r[5]),
                     _opt_int(r[6]), _opt_float(r[7]), _opt_float(r[8]))
