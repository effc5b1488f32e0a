"""A Snapshot on the connection from the daemon to its metrics exporter (pure).

Frames and bodies are vgpud.wire's (a header, then one JSON value), cut by
its FrameReader: bytes that are no frame are skipped up to the next magic,
so a bad frame costs that frame, never the stream. The first frame,
``HELLO`` (``{"listener": true}``), carries the listening socket
(SCM_RIGHTS, in the same sendmsg); every later one is a snapshot:

    {"tenants": [[tenant, gpu, gpu_uuid, used_bytes, limit_bytes, denied,
                  gpu_time_ns | null, share_target | null,
                  share_measured | null], ...],
     "daemon": {"upcalls": n, "verdicts": {action: n, ...}, "malformed": n,
                "policy_errors": n, "overruns": n, "latency": [n, ...],
                "latency_sum_ns": n},
     "module": {vgpu_stats field: n, ...} | null,
     "module4": {vgpu_stats4 field: n, ...} | null}

Counts are u64, byte figures 64-bit ints (signed or not), shares finite
numbers: a share that is not (NaN, inf) is sent as null, no sample.
``encode`` runs on the event loop, once per refresh; ``decode`` checks
every value's type and builds only the Snapshot's own dataclasses.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace

from vgpud import wire
from vgpud.kernel.uapi import Stats, Stats4
from vgpud.metrics.snapshot import DaemonFigures, Snapshot, TenantGpu
from vgpud.wire import WireError, as_dict, as_float, as_int, as_ints, as_list, as_object, as_str

__all__ = ["HELLO", "MAX_PAYLOAD", "FrameReader", "WireError", "decode", "decode_hello",
           "encode", "frame"]

MAX_PAYLOAD = 64 << 20  # 8 GPUs x 4096 tenants is about 5 MiB
HELLO = wire.frame(wire.encode({"listener": True}), MAX_PAYLOAD)
I64_MIN = -(2**63)
VERDICTS_MAX = 64  # actions in DaemonFigures.verdicts (VerdictAction has 5)
_STATS = tuple(f.name for f in fields(Stats))
_STATS4 = tuple(f.name for f in fields(Stats4))
_ROW_FIELDS = len(fields(TenantGpu))
_DAEMON = ("upcalls", "verdicts", "malformed", "policy_errors", "overruns", "latency",
           "latency_sum_ns")


class FrameReader(wire.FrameReader):
    """vgpud.wire.FrameReader at this connection's bound (MAX_PAYLOAD)."""

    def __init__(self) -> None:
        super().__init__(MAX_PAYLOAD)


def frame(payload: bytes) -> bytes:
    """``payload`` with its header, ready for the connection."""
    return wire.frame(payload, MAX_PAYLOAD)


def decode_hello(payload: bytes) -> None:
    """Returns when ``payload`` is HELLO's body; WireError otherwise."""
    hello = as_object(wire.decode(payload), "the first frame", ("listener",))
    if hello["listener"] is not True:
        raise WireError(f"the first frame: listener is {hello['listener']!r:.20}")


def encode(snapshot: Snapshot) -> bytes:
    """The payload of ``snapshot`` (without the frame header)."""
    try:
        return wire.encode(_value(snapshot))
    except WireError:  # a share that is no finite number: none
        return wire.encode(_value(replace(snapshot, tenants=tuple(
            replace(r, share_target=_finite(r.share_target),
                    share_measured=_finite(r.share_measured)) for r in snapshot.tenants))))


def _value(snapshot: Snapshot) -> dict[str, object]:
    d = snapshot.daemon
    m, m4 = snapshot.module, snapshot.module4
    return {
        "tenants": [[r.tenant, r.gpu, r.gpu_uuid, r.used_bytes, r.limit_bytes, r.denied,
                     r.gpu_time_ns, r.share_target, r.share_measured]
                    for r in snapshot.tenants],
        "daemon": {"upcalls": d.upcalls, "verdicts": dict(d.verdicts), "malformed": d.malformed,
                   "policy_errors": d.policy_errors, "overruns": d.overruns,
                   "latency": list(d.latency), "latency_sum_ns": d.latency_sum_ns},
        "module": None if m is None else {name: getattr(m, name) for name in _STATS},
        "module4": None if m4 is None else {name: getattr(m4, name) for name in _STATS4},
    }


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def decode(payload: bytes) -> Snapshot:
    """The Snapshot ``payload`` encodes; WireError for anything else."""
    top = as_object(wire.decode(payload), "snapshot", ("tenants", "daemon", "module", "module4"))
    tenants = tuple(map(_row, as_list(top["tenants"], "tenants")))
    d = as_object(top["daemon"], "daemon figures", _DAEMON)
    verdicts = {name: as_int(n, "a verdict count")
                for name, n in as_dict(d["verdicts"], "verdicts", VERDICTS_MAX).items()}
    daemon = DaemonFigures(
        upcalls=as_int(d["upcalls"], "upcalls"), verdicts=verdicts,
        malformed=as_int(d["malformed"], "malformed"),
        policy_errors=as_int(d["policy_errors"], "policy_errors"),
        overruns=as_int(d["overruns"], "overruns"),
        latency=tuple(as_ints(d["latency"], "latency")),
        latency_sum_ns=as_int(d["latency_sum_ns"], "latency_sum_ns"))
    module = None if top["module"] is None else Stats(*_stats(top["module"], _STATS, "module"))
    module4 = (None if top["module4"] is None
               else Stats4(*_stats(top["module4"], _STATS4, "module4")))
    return Snapshot(tenants, daemon, module, module4)


def _stats(value: object, names: tuple[str, ...], what: str) -> list[int]:
    v = as_object(value, what, names)
    return [as_int(v[name], f"{what}.{name}") for name in names]


def _row(value: object) -> TenantGpu:
    """One tenant row, every field checked: the fast test first, then, for a
    row that fails it, the precise one, which says what is wrong."""
    if type(value) is list and len(value) == _ROW_FIELDS:
        t, g, u, used, limit, denied, gtime, target, measured = value
        if (type(t) is str and type(g) is int and type(u) is str and type(used) is int
                and type(limit) is int and type(denied) is int
                and (gtime is None or type(gtime) is int)
                and (target is None or type(target) is float)
                and (measured is None or type(measured) is float)
                and 0 <= g < 1 << 32 and I64_MIN <= used < 1 << 64
                and I64_MIN <= limit < 1 << 64 and 0 <= denied < 1 << 64
                and (gtime is None or 0 <= gtime < 1 << 64)
                and (target is None or math.isfinite(target))
                and (measured is None or math.isfinite(measured))):
            return TenantGpu(t, g, u, used, limit, denied, gtime, target, measured)
    r = as_list(value, "a tenant row", _ROW_FIELDS)
    return TenantGpu(
        as_str(r[0], "tenant"), as_int(r[1], "gpu", hi=2**32 - 1), as_str(r[2], "gpu_uuid"),
        as_int(r[3], "used_bytes", I64_MIN), as_int(r[4], "limit_bytes", I64_MIN),
        as_int(r[5], "denied"), None if r[6] is None else as_int(r[6], "gpu_time_ns"),
        None if r[7] is None else as_float(r[7], "share_target"),
        None if r[8] is None else as_float(r[8], "share_measured"))
