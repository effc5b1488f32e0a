"""The messages between vgpud and vgpud-probes: pure encode and decode.

Frames and bodies are vgpud.wire's (a header, then one JSON value). A
request is ``{"op": OP}``, OP one of load, stale, reattach, read, dropped,
delete; only delete has an argument, ``"keys"``: at most DELETE_MAX keys,
each ``[ctx_id, hist, call]`` (u64s). A reply is ``{"status": "ok",
"value": V}``, or ``{"status": "off" | "err", "text": WHY}`` (off: the
probes cannot run; err: the request was refused). V by op: load and
reattach ``{"attached": bool, "points": [str, ...]}`` (at most POINTS_MAX);
stale a bool; read ``{"entries": n, "width": w, "counts": [...]}``, the
flat list of each entry's key then its ``w`` counts (u64s); dropped a u64;
delete null. Texts are cut to TEXT_MAX characters. Requests are bounded by
REQUEST_MAX, replies by REPLY_MAX (a full map read: HIST_ENTRIES x 69 u64,
23.7 MB at 21 bytes each, about 3 MB as the probes leave it); anything else
raises WireError, which the helper answers ERR without acting.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from vgpud.probes.histograms import CountKey
from vgpud.wire import (
    WireError,
    as_bool,
    as_int,
    as_ints,
    as_list,
    as_object,
    as_str,
    decode,
    encode,
)

__all__ = ["DELETE_MAX", "REPLY_MAX", "REQUEST_MAX", "Op", "Reply", "Request", "Status",
           "Value", "WireError", "decode_reply", "decode_request", "encode_reply",
           "encode_request"]

DELETE_MAX = 4096  # keys in one DELETE; RemoteProbes sends more in several
KEY_TEXT_MAX = 3 * 20 + 5  # one key of three u64 in the body: "[a,b,c]," at most
REQUEST_MAX = 64 + DELETE_MAX * KEY_TEXT_MAX  # 260 KiB
REPLY_MAX = 32 << 20
POINTS_MAX = 64
TEXT_MAX = 1024  # characters of one attach point or reason (longer is cut)
WIDTH_MAX = 128  # u64s of one map value (struct vgpu_lat_val: 66)

E = TypeVar("E", bound=enum.StrEnum)


class Op(enum.StrEnum):
    LOAD = "load"
    STALE = "stale"
    REATTACH = "reattach"
    READ = "read"
    DELETE = "delete"
    DROPPED = "dropped"


class Status(enum.StrEnum):
    OK = "ok"
    OFF = "off"
    ERR = "err"


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


def encode_request(req: Request) -> bytes:
    if req.op is not Op.DELETE:
        if req.keys:
            raise WireError(f"{req.op.name} takes no keys")
        return encode({"op": req.op})
    if len(req.keys) > DELETE_MAX:
        raise WireError(f"{len(req.keys)} keys in one DELETE (at most {DELETE_MAX})")
    keys = [list(k) for k in req.keys]
    for key in keys:
        as_ints(key, "a DELETE key", 3)
    return encode({"op": req.op, "keys": keys})


def decode_request(body: bytes) -> Request:
    if len(body) > REQUEST_MAX:
        raise WireError(f"a request of {len(body)} bytes")
    top = as_object(decode(body), "request", ("op",), optional=("keys",))
    op = _enum(Op, top["op"], "op")
    if op is not Op.DELETE:
        if "keys" in top:
            raise WireError(f"{op.name} takes no keys")
        return Request(op)
    if "keys" not in top:
        raise WireError("DELETE without keys")
    keys = as_list(top["keys"], "DELETE keys", most=DELETE_MAX)
    return Request(op, tuple(_key(as_ints(k, "a DELETE key", 3)) for k in keys))


def encode_reply(op: Op, reply: Reply) -> bytes:
    """The body of ``reply`` to ``op``; WireError when it does not fit one."""
    if reply.status is not Status.OK:
        return encode({"status": reply.status, "text": reply.text[:TEXT_MAX]})
    value = reply.value
    match op:
        case Op.LOAD | Op.REATTACH if isinstance(value, tuple):
            body = encode({"status": Status.OK, "value": _points(*value)})
        case Op.STALE if isinstance(value, bool):
            body = encode({"status": Status.OK, "value": value})
        case Op.READ if isinstance(value, dict):
            body = encode({"status": Status.OK, "value": _counts(value)})
        case Op.DROPPED if type(value) is int and 0 <= value < 1 << 64:
            body = encode({"status": Status.OK, "value": value})
        case Op.DELETE if value is None:
            body = encode({"status": Status.OK, "value": None})
        case _:
            raise WireError(f"{op.name} cannot answer {value!r:.80}")
    if len(body) > REPLY_MAX:
        raise WireError(f"a reply of {len(body)} bytes (at most {REPLY_MAX})")
    return body


def _points(ok: bool, points: Sequence[str]) -> dict[str, object]:
    if len(points) > POINTS_MAX:
        raise WireError(f"{len(points)} attach points (at most {POINTS_MAX})")
    if type(ok) is not bool or any(type(p) is not str for p in points):
        raise WireError(f"attach points of {ok!r:.20}, {points!r:.80}")
    return {"attached": ok, "points": [p[:TEXT_MAX] for p in points]}


def _counts(counts: Mapping[CountKey, Sequence[int]]) -> dict[str, object]:
    widths = {len(v) for v in counts.values()}
    if len(widths) > 1:
        raise WireError(f"map values of different widths: {sorted(widths)}")
    width = widths.pop() if widths else 0
    if width > WIDTH_MAX:
        raise WireError(f"map values of {width} u64 (at most {WIDTH_MAX})")
    if any(len(k) != 3 for k in counts):
        raise WireError("a map key that is not three u64")
    flat: list[int] = []
    for k, v in counts.items():
        flat += k
        flat += v
    as_ints(flat, "map counts")
    return {"entries": len(counts), "width": width, "counts": flat}


def decode_reply(op: Op, body: bytes) -> Reply:
    if len(body) > REPLY_MAX:
        raise WireError(f"a reply of {len(body)} bytes")
    top = as_object(decode(body), "reply", ("status",), optional=("value", "text"))
    status = _enum(Status, top["status"], "status")
    if status is not Status.OK:
        as_object(top, "a refusal", ("status", "text"))
        return Reply(status, text=as_str(top["text"], "reason", TEXT_MAX))
    value = as_object(top, "an answer", ("status", "value"))["value"]
    match op:
        case Op.LOAD | Op.REATTACH:
            v = as_object(value, f"{op.name}'s answer", ("attached", "points"))
            points = as_list(v["points"], "attach points", most=POINTS_MAX)
            return Reply(status, (as_bool(v["attached"], "attached"),
                                  [as_str(p, "an attach point", TEXT_MAX) for p in points]))
        case Op.STALE:
            return Reply(status, as_bool(value, "stale"))
        case Op.READ:
            return Reply(status, _map(value))
        case Op.DROPPED:
            return Reply(status, as_int(value, "dropped"))
        case _:
            if value is not None:
                raise WireError(f"DELETE answered {value!r:.40}")
            return Reply(status)


def _map(value: object) -> dict[CountKey, list[int]]:
    v = as_object(value, "READ's answer", ("entries", "width", "counts"))
    width = as_int(v["width"], "width", hi=WIDTH_MAX)
    step = 3 + width
    n = as_int(v["entries"], "entries", hi=REPLY_MAX // step)
    flat = as_ints(v["counts"], "map counts", n * step)
    return {(flat[i], flat[i + 1], flat[i + 2]): flat[i + 3:i + step]
            for i in range(0, len(flat), step)}


def _key(k: list[int]) -> CountKey:
    return (k[0], k[1], k[2])


def _enum(kind: type[E], value: object, what: str) -> E:
    name = as_str(value, what)
    try:
        return kind(name)
    except ValueError:
        raise WireError(f"unknown {what} {value!r:.32}") from None
