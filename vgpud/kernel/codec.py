"""Sans-I/O codec of the vgpu generic netlink family, with `struct` only.

Kernel -> daemon: ``decode_datagram`` turns one received datagram into typed
messages (Upcall, PostEvent, CloseEvent, Reply, NlAck), reporting a malformed
message as a DecodeError value in its place so that one bad message never hides
the others. Daemon -> kernel: ``encode_*`` build requests; ``VerdictEncoder``
builds a verdict with a single ``struct.pack`` (the hot path).

Decoding is strict: a message must carry only the attributes its command
defines in the protocol version of uapi.PROTO_VERSION (fixed at registration,
so anything else means the module and the daemon disagree on the contract),
reserved fields must be zero and enum values known.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from vgpud.kernel import uapi
from vgpud.kernel.cstruct import DecodeError
from vgpud.kernel.uapi import (
    Attr,
    Cmd,
    Context,
    EventKind,
    Filter,
    Node,
    ObjOp,
    ObjResult,
    RevokeReason,
    Sched,
    SchedResult,
    Stats,
    Stats4,
    UpcallKind,
    Verdict,
)

__all__ = [
    "AbandonedEvent",
    "CloseEvent",
    "DecodeError",
    "Event",
    "Message",
    "NlAck",
    "Opener",
    "PostEvent",
    "Reply",
    "RevokedEvent",
    "Upcall",
    "VerdictEncoder",
    "decode_contexts",
    "decode_datagram",
    "decode_family_id",
    "decode_obj_results",
    "decode_sched_results",
    "decode_stats",
    "decode_stats4",
    "encode_get_family",
    "encode_get_stats",
    "encode_list_contexts",
    "encode_object",
    "encode_register",
    "encode_request",
    "encode_schedule",
    "encode_set_filter",
    "encode_unregister",
]

NLMSG_HDR = struct.Struct("=IHHII")
GENL_HDR = struct.Struct("=BBH")
NLA_HDR = struct.Struct("=HH")
_I32 = struct.Struct("=i")
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")

NLMSG_NOOP = 1
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLMSG_OVERRUN = 4
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_CAPPED = 0x100
NLM_F_ACK_TLVS = 0x200
NLA_TYPE_MASK = 0x3FFF  # drops NLA_F_NESTED and NLA_F_NET_BYTEORDER
NLMSGERR_ATTR_MSG = 1
# nlctrl, the generic netlink controller (<linux/genetlink.h>): its family id
# is fixed; the others' are assigned at registration and looked up by name.
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY = 3
CTRL_ATTR_FAMILY_ID = 1
CTRL_ATTR_FAMILY_NAME = 2

_HDRS = NLMSG_HDR.size + GENL_HDR.size
_U16 = struct.Struct("=H")


class Opener(NamedTuple):
    """Who opened the emulated file (recorded by the module at open)."""

    pid: int
    tgid: int
    uid: int
    gid: int
    cgroup_id: int
    cgroup: str | None  # cgroup v2 path; only OPEN upcalls carry it
    start_ns: int | None  # the process's start (boot clock, ns); only OPEN upcalls


class Upcall(NamedTuple):
    """VGPU_CMD_UPCALL: a call waiting for a verdict.

    OPEN (may this opener open?), IOCTL (may this call go to the driver?),
    POST (the driver returned: keep its results or REPLY with others; same id
    as the IOCTL upcall it follows, params/data as the driver left them) and
    MMAP (may this nvidia-uvm mapping be made? params: struct vgpu_mmap_params).
    """

    id: int
    ctx_id: int
    kind: UpcallKind
    node: Node
    minor: int
    cmd: int
    nr: int
    flags: int
    opener: Opener
    caller_pid: int
    caller_tgid: int
    params: bytes  # the ioctl params block (empty for OPEN, or when the module sent none)
    data: bytes | None  # the buffer the matching rule points to, when copied
    ret: int  # POST: the driver's return value; else 0
    data2: bytes | None = None  # the nested list in that buffer (VGPU_A_DATA2), when copied


class PostEvent(NamedTuple):
    """VGPU_EVENT_POST: an allowed slow-path call returned."""

    ctx_id: int
    upcall_id: int
    nr: int
    ret: int
    params: bytes
    data: bytes | None


class CloseEvent(NamedTuple):
    """VGPU_EVENT_CLOSE: the last reference to a context is gone."""

    ctx_id: int


class AbandonedEvent(NamedTuple):
    """VGPU_EVENT_ABANDONED: the module gave up on an upcall (its caller timed
    out or was killed); a verdict for it is never taken. What was reserved
    for it is free, and an abandoned OPEN's context never existed."""

    ctx_id: int
    upcall_id: int
    kind: UpcallKind
    errno: int  # why: ETIMEDOUT, EINTR...


class RevokedEvent(NamedTuple):
    """VGPU_EVENT_REVOKED: the module revoked a context (every later call on it
    fails); it stays until its CLOSE event, with what it holds."""

    ctx_id: int
    reason: RevokeReason


class Reply(NamedTuple):
    """A kernel reply to one of our requests (e.g. GET_STATS)."""

    seq: int
    cmd: int
    attrs: dict[int, bytes]


class NlAck(NamedTuple):
    """NLMSG_ERROR: an ACK (errno 0) or an error for request ``seq``.

    ``request`` is the echoed request payload after its nlmsghdr (genl header
    and attributes) unless the kernel capped it; ``message`` is the extended
    ACK text when the socket asked for it.
    """

    seq: int
    errno: int
    request_type: int
    request: bytes
    message: str | None

    def upcall_id(self) -> int | None:
        """The upcall id of an echoed VERDICT request, if there is one."""
        if len(self.request) < GENL_HDR.size or self.request[0] != Cmd.VERDICT:
            return None
        try:
            attrs = _attrs(self.request, GENL_HDR.size, len(self.request), _ANY_ATTR)
        except DecodeError:
            return None
        verdict = attrs.get(Attr.VERDICT)
        if verdict is None or len(verdict) < 8:
            return None
        return _U64.unpack_from(verdict)[0]


Event = PostEvent | CloseEvent | AbandonedEvent | RevokedEvent
Message = Upcall | PostEvent | CloseEvent | AbandonedEvent | RevokedEvent | Reply | NlAck

_KINDS = {int(k): k for k in UpcallKind}
_REVOKE_REASONS = frozenset(int(r) for r in RevokeReason)
_NODES = {int(n): n for n in Node}
_ATTR_MAX = int(uapi.ATTR_MAX)
_ANY_ATTR = frozenset(range(1, _ATTR_MAX + 1))
_ALL_ATTRS = frozenset(range(1, NLA_TYPE_MASK + 1))  # any netlink attribute type
# The attributes each upcall kind may carry, as bit masks (1 << attribute type).
_UPCALL_ATTR_BITS = {
    int(kind): sum(1 << attr for attr in attrs) for kind, attrs in {
        UpcallKind.OPEN: (Attr.UPCALL, Attr.CGROUP, Attr.OPENER),
        UpcallKind.IOCTL: (Attr.UPCALL, Attr.PARAMS, Attr.DATA, Attr.DATA2),
        UpcallKind.POST: (Attr.UPCALL, Attr.PARAMS, Attr.DATA, Attr.DATA2),
        UpcallKind.MMAP: (Attr.UPCALL, Attr.PARAMS),
    }.items()
}
_A_UPCALL, _A_PARAMS, _A_DATA, _A_CGROUP, _A_OPENER, _A_DATA2 = (
    int(a) for a in (Attr.UPCALL, Attr.PARAMS, Attr.DATA, Attr.CGROUP, Attr.OPENER,
                     Attr.DATA2))
_CMD_UPCALL, _CMD_EVENT = int(Cmd.UPCALL), int(Cmd.EVENT)
_NLA_UNPACK = NLA_HDR.unpack_from
_NLMSG_UNPACK = NLMSG_HDR.unpack_from
_new = tuple.__new__  # builds a NamedTuple without its Python-level __new__
_EVENT_ATTRS = frozenset({Attr.EVENT, Attr.PARAMS, Attr.DATA})
_UPCALL_UNPACK = uapi.UPCALL.struct.unpack_from
_UPCALL_SIZE = uapi.UPCALL.size
_UPCALL_ATTR_LEN = NLA_HDR.size + _UPCALL_SIZE
_UPCALL_NLA = (_UPCALL_ATTR_LEN, _A_UPCALL)  # the header of VGPU_A_UPCALL
_NL_LEN_TYPE = struct.Struct("=IH").unpack_from
_EVENT_UNPACK = uapi.EVENT.struct.unpack_from
# After the genl header: VGPU_A_UPCALL (header + struct) and the next attribute's header.
_CALL_HEAD = struct.Struct("=HH" + uapi.UPCALL.struct.format[1:] + "HH")
_CALL_HEAD_UNPACK = _CALL_HEAD.unpack_from
_CALL_HEAD_SIZE = _HDRS + _CALL_HEAD.size
_CALL_KINDS = frozenset({int(UpcallKind.IOCTL), int(UpcallKind.POST)})
_KIND_LIST = [_KINDS.get(i) for i in range(max(_KINDS) + 1)]
_NODE_LIST = [Node(i) for i in range(len(Node))]
_NODE_MAX = len(_NODE_LIST) - 1


def _align(n: int) -> int:
    return (n + 3) & ~3


def _attrs(buf: bytes, off: int, end: int, allowed: frozenset[int]) -> dict[int, bytes]:
    """Parse netlink attributes in ``buf[off:end]``; each type at most once."""
    attrs: dict[int, bytes] = {}
    while off < end:
        nla_len, kind = _attr_header(buf, off, end)
        if kind not in allowed:
            raise DecodeError(f"unexpected attribute {kind}")
        if kind in attrs:
            raise DecodeError(f"duplicate attribute {kind}")
        attrs[kind] = buf[off + 4 : off + nla_len]
        off += (nla_len + 3) & ~3
    return attrs


def _attr_header(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """The length and type of the attribute at ``pos``, which must fit before ``end``."""
    if end - pos < 4:
        raise DecodeError(f"truncated attribute header at {pos}")
    nla_len, nla_type = _NLA_UNPACK(buf, pos)
    nla_type &= NLA_TYPE_MASK
    if nla_len < 4 or pos + nla_len > end:
        raise DecodeError(f"attribute {nla_type} length {nla_len} at {pos}")
    return nla_len, nla_type


def _cgroup(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _decode_upcall(buf: bytes, off: int, end: int) -> Upcall:
    """One walk over the attributes into locals: no dict, no slice of the header."""
    head = params = data = data2 = cgroup = start_ns = None
    seen = 0
    pos = off
    if end - off >= _UPCALL_ATTR_LEN and _NLA_UNPACK(buf, off) == _UPCALL_NLA:  # the module's order
        head, seen, pos = off + 4, 1 << _A_UPCALL, off + _UPCALL_ATTR_LEN
    try:
        while pos < end:
            nla_len, nla_type = _attr_header(buf, pos, end)
            if not 0 < nla_type <= _ATTR_MAX:
                raise DecodeError(f"unexpected attribute {nla_type}")
            bit = 1 << nla_type
            if seen & bit:
                raise DecodeError(f"duplicate attribute {nla_type}")
            seen |= bit
            if nla_type == _A_UPCALL:
                if nla_len != _UPCALL_ATTR_LEN:
                    raise DecodeError(f"VGPU_A_UPCALL is {nla_len - 4} bytes, "
                                      f"expected {_UPCALL_SIZE}")
                head = pos + 4
            elif nla_type == _A_PARAMS:
                params = buf[pos + 4 : pos + nla_len]
            elif nla_type == _A_DATA:
                data = buf[pos + 4 : pos + nla_len]
            elif nla_type == _A_DATA2:
                data2 = buf[pos + 4 : pos + nla_len]
            elif nla_type == _A_CGROUP:
                cgroup = buf[pos + 4 : pos + nla_len]
            elif nla_type == _A_OPENER:
                if nla_len - 4 != uapi.OPENER.size:
                    raise DecodeError(f"VGPU_A_OPENER is {nla_len - 4} bytes, "
                                      f"expected {uapi.OPENER.size}")
                start_ns = uapi.Opener.unpack(buf[pos + 4 : pos + nla_len]).start_boottime_ns
            pos += (nla_len + 3) & ~3
        if head is None:
            raise DecodeError("upcall without VGPU_A_UPCALL")
    except DecodeError as exc:
        exc.upcall_id = _salvage_id(buf, off, end)
        raise
    (uid_, ctx_id, cgroup_id, kind, node, minor, cmd, nr, flags, pid, tgid, uid, gid,
     caller_pid, caller_tgid, ret, reserved) = _UPCALL_UNPACK(buf, head)
    kind_e = _KINDS.get(kind)
    node_e = _NODES.get(node)
    if kind_e is None or node_e is None:
        raise DecodeError(f"unknown upcall kind {kind} or node {node}", upcall_id=uid_)
    if reserved:
        raise DecodeError("nonzero reserved field in upcall", upcall_id=uid_)
    extra = seen & ~_UPCALL_ATTR_BITS[kind]  # int keys: an IntEnum hashes in Python
    if extra:
        raise DecodeError(
            f"unexpected attributes {[a for a in range(_ATTR_MAX + 1) if extra >> a & 1]}",
            upcall_id=uid_)
    opener = _new(Opener, (pid, tgid, uid, gid, cgroup_id,
                           None if cgroup is None else _cgroup(cgroup), start_ns))
    return _new(Upcall, (uid_, ctx_id, kind_e, node_e, minor, cmd, nr, flags, opener,
                         caller_pid, caller_tgid, params or b"", data, ret, data2))


def _decode_call_upcall(buf: bytes, size: int) -> Upcall | None:
    """IOCTL and POST upcalls in the module's own layout, with one unpack.

    Headers, VGPU_A_UPCALL and the VGPU_A_PARAMS header that follows it, then
    params, optionally VGPU_A_DATA, and nothing else (a DATA2 goes to the general
    decoder). None: anything unusual,
    which the general decoder then reads (and reports).
    """
    (nla_len, nla_type, upcall_id, ctx_id, cgroup_id, kind, node, minor, cmd, nr, flags,
     pid, tgid, uid, gid, caller_pid, caller_tgid, ret, reserved, p_len, p_type,
     ) = _CALL_HEAD_UNPACK(buf, _HDRS)
    if (nla_len != _UPCALL_ATTR_LEN or nla_type != _A_UPCALL or p_type != _A_PARAMS
            or reserved or node > _NODE_MAX or kind not in _CALL_KINDS):
        return None
    p_end = _CALL_HEAD_SIZE - 4 + p_len
    d_pos = (p_end + 3) & ~3
    if p_len < 4 or d_pos > size:
        return None
    data = None
    if d_pos != size:
        if size - d_pos < 4:
            return None
        d_len, d_type = _NLA_UNPACK(buf, d_pos)
        if d_type != _A_DATA or d_len < 4 or (d_pos + d_len + 3) & ~3 != size:
            return None
        data = buf[d_pos + 4 : d_pos + d_len]
    opener = _new(Opener, (pid, tgid, uid, gid, cgroup_id, None, None))
    return _new(Upcall, (upcall_id, ctx_id, _KIND_LIST[kind], _NODE_LIST[node], minor, cmd, nr,
                         flags, opener, caller_pid, caller_tgid, buf[_CALL_HEAD_SIZE:p_end],
                         data, ret, None))


def _salvage_id(buf: bytes, off: int, end: int) -> int | None:
    """Find the upcall id in a malformed upcall, walking attributes leniently."""
    while end - off >= NLA_HDR.size:
        nla_len, nla_type = NLA_HDR.unpack_from(buf, off)
        if nla_len < NLA_HDR.size or off + nla_len > end:
            return None
        if nla_type & NLA_TYPE_MASK == Attr.UPCALL and nla_len >= NLA_HDR.size + 8:
            return _U64.unpack_from(buf, off + NLA_HDR.size)[0]
        off += _align(nla_len)
    return None


def _decode_event(buf: bytes, off: int, end: int) -> Event:
    attrs = _attrs(buf, off, end, _EVENT_ATTRS)
    head = attrs.get(Attr.EVENT)
    if head is None or len(head) != uapi.EVENT.size:
        raise DecodeError("event without a well-sized VGPU_A_EVENT")
    ctx_id, upcall_id, kind, nr, ret, reserved = _EVENT_UNPACK(head)
    if reserved:
        raise DecodeError("nonzero reserved field in event")
    if kind == EventKind.POST:
        return PostEvent(ctx_id, upcall_id, nr, ret, attrs.get(Attr.PARAMS, b""),
                         attrs.get(Attr.DATA))
    if kind == EventKind.CLOSE:
        if len(attrs) != 1:
            raise DecodeError("CLOSE event with extra attributes")
        return CloseEvent(ctx_id)
    if kind == EventKind.ABANDONED:
        upcall_kind = _KINDS.get(nr)
        if len(attrs) != 1 or upcall_kind is None or not -4095 <= ret < 0:
            raise DecodeError("ABANDONED event with extra attributes, an unknown upcall "
                              "kind or an errno out of range")
        return AbandonedEvent(ctx_id, upcall_id, upcall_kind, -ret)
    if kind == EventKind.REVOKED:
        if len(attrs) != 1 or upcall_id or ret or nr not in _REVOKE_REASONS:
            raise DecodeError("REVOKED event with extra attributes or fields, or an unknown "
                              "reason")
        return RevokedEvent(ctx_id, RevokeReason(nr))
    raise DecodeError(f"unknown event kind {kind}")


def _decode_ack(buf: bytes, off: int, end: int, seq: int, flags: int) -> NlAck:
    if end - off < _I32.size + NLMSG_HDR.size:
        raise DecodeError("truncated NLMSG_ERROR")
    (error,) = _I32.unpack_from(buf, off)
    req_len, req_type, _f, _s, _p = NLMSG_HDR.unpack_from(buf, off + _I32.size)
    req_off = off + _I32.size + NLMSG_HDR.size
    if flags & NLM_F_CAPPED or error == 0:
        req_end = req_off
    else:
        req_end = off + _I32.size + req_len
        if req_len < NLMSG_HDR.size or req_end > end:
            raise DecodeError(f"NLMSG_ERROR echoes a request of bad length {req_len}")
    message = None
    if flags & NLM_F_ACK_TLVS:
        tlvs = _attrs(buf, _align(req_end), end, _ALL_ATTRS)
        text = tlvs.get(NLMSGERR_ATTR_MSG)
        if text is not None:
            message = text.split(b"\0", 1)[0].decode("utf-8", "replace")
    return NlAck(seq, -error, req_type, buf[req_off:req_end], message)


def encode_get_family(name: str, seq: int) -> bytes:
    """nlctrl's CTRL_CMD_GETFAMILY for the family called ``name``."""
    raw = name.encode() + b"\0"
    nla = NLA_HDR.pack(NLA_HDR.size + len(raw), CTRL_ATTR_FAMILY_NAME) + raw
    body = GENL_HDR.pack(CTRL_CMD_GETFAMILY, 1, 0) + nla.ljust(_align(len(nla)), b"\0")
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), GENL_ID_CTRL, NLM_F_REQUEST, seq,
                          0) + body


def decode_family_id(buf: bytes, seq: int) -> int | NlAck:
    """The family id in nlctrl's answer to ``encode_get_family(name, seq)``,
    or the kernel's NLMSG_ERROR (ENOENT: no such family)."""
    if len(buf) < NLMSG_HDR.size:
        raise DecodeError(f"nlctrl reply of {len(buf)} bytes")
    length, kind, flags, got, _pid = NLMSG_HDR.unpack_from(buf)
    if length < NLMSG_HDR.size or length > len(buf) or got != seq:
        raise DecodeError(f"nlctrl reply of length {length}, sequence {got} (asked {seq})")
    if kind == NLMSG_ERROR:
        return _decode_ack(buf, NLMSG_HDR.size, length, got, flags)
    if kind != GENL_ID_CTRL or length < _HDRS:
        raise DecodeError(f"nlctrl reply of type {kind}, length {length}")
    family = _attrs(buf, _HDRS, length, _ALL_ATTRS).get(CTRL_ATTR_FAMILY_ID, b"")
    if len(family) < _U16.size:
        raise DecodeError("nlctrl reply without a family id")
    return int(_U16.unpack_from(family)[0])


def decode_datagram(buf: bytes, family_id: int) -> list[Message | DecodeError]:
    """Decode every netlink message of one datagram, in order.

    A malformed message becomes a DecodeError in the list; a framing error
    (bad nlmsg_len) ends the list, since nothing after it can be located.
    NLMSG_NOOP/DONE/OVERRUN carry nothing for us and are skipped.
    """
    size = len(buf)
    if size >= _HDRS:  # fast path: a datagram holding one upcall, as the module sends them
        length, nl_type = _NL_LEN_TYPE(buf)
        if length == size and nl_type == family_id and buf[16] == _CMD_UPCALL:
            if size >= _CALL_HEAD_SIZE:
                upcall = _decode_call_upcall(buf, size)
                if upcall is not None:
                    return [upcall]
            try:
                return [_decode_upcall(buf, _HDRS, size)]
            except DecodeError as exc:
                return [exc]
    out: list[Message | DecodeError] = []
    off = 0
    unpack = _NLMSG_UNPACK
    while off < size:
        if size - off < 16:
            out.append(DecodeError(f"truncated nlmsghdr at {off}"))
            break
        length, nl_type, flags, seq, _pid = unpack(buf, off)
        end = off + length
        if length < 16 or end > size:
            out.append(DecodeError(f"nlmsg_len {length} at {off} of {size}"))
            break
        msg: Message | DecodeError | None
        try:
            if nl_type == family_id:
                msg = _decode_genl(buf, off, end, seq)
            elif nl_type == NLMSG_ERROR:
                msg = _decode_ack(buf, off + NLMSG_HDR.size, end, seq, flags)
            elif nl_type in (NLMSG_NOOP, NLMSG_DONE, NLMSG_OVERRUN):
                msg = None
            else:
                raise DecodeError(f"netlink message type {nl_type} is not family {family_id}")
        except DecodeError as exc:
            msg = exc
        if msg is not None:
            out.append(msg)
        off += _align(length)
    return out


def _decode_genl(buf: bytes, off: int, end: int, seq: int) -> Message:
    if end - off < _HDRS:
        raise DecodeError("truncated genlmsghdr")
    cmd = buf[off + 16]
    start = off + _HDRS
    if cmd == _CMD_UPCALL:
        return _decode_upcall(buf, start, end)
    if cmd == _CMD_EVENT:
        return _decode_event(buf, start, end)
    if 0 < cmd <= uapi.CMD_MAX:
        return Reply(seq, cmd, _attrs(buf, start, end, _ANY_ATTR))
    raise DecodeError(f"unknown command {cmd}")


def decode_stats(reply: Reply) -> Stats:
    """The struct vgpu_stats of a GET_STATS reply."""
    raw = reply.attrs.get(Attr.STATS)
    if reply.cmd != Cmd.GET_STATS or raw is None:
        raise DecodeError("not a GET_STATS reply with VGPU_A_STATS")
    return Stats.unpack(raw)


def decode_stats4(reply: Reply) -> Stats4 | None:
    """The struct vgpu_stats4 of a GET_STATS reply; None from a module without it."""
    if reply.cmd != Cmd.GET_STATS:
        raise DecodeError("not a GET_STATS reply")
    raw = reply.attrs.get(Attr.STATS4)
    return None if raw is None else Stats4.unpack(raw)


def decode_contexts(reply: Reply) -> tuple[list[Context], int]:
    """The contexts of one LIST_CONTEXTS reply and the cursor to ask for next (0: done)."""
    raw, cursor = reply.attrs.get(Attr.CONTEXTS), reply.attrs.get(Attr.CURSOR)
    if reply.cmd != Cmd.LIST_CONTEXTS or raw is None or cursor is None:
        raise DecodeError("not a LIST_CONTEXTS reply with VGPU_A_CONTEXTS and VGPU_A_CURSOR")
    size = uapi.CONTEXT.size
    if len(raw) % size or len(raw) // size > uapi.LIST_MAX or len(cursor) != _U64.size:
        raise DecodeError(f"LIST_CONTEXTS reply of {len(raw)} context bytes, "
                          f"cursor of {len(cursor)}")
    try:
        contexts = [Context.unpack(raw[i : i + size]) for i in range(0, len(raw), size)]
    except ValueError as exc:  # an unknown node kind
        raise DecodeError(f"bad context: {exc}") from None
    (after,) = _U64.unpack(cursor)
    ids = [c.ctx_id for c in contexts]
    if ids != sorted(set(ids)) or (after and (not ids or after <= ids[-1])):
        raise DecodeError("LIST_CONTEXTS reply out of ctx_id order")
    return contexts, after


def decode_sched_results(reply: Reply, count: int) -> list[SchedResult]:
    """The SCHED_RESULT of a SCHEDULE reply to ``count`` entries."""
    raw = reply.attrs.get(Attr.SCHED_RESULT)
    if reply.cmd != Cmd.SCHEDULE or raw is None:
        raise DecodeError("not a SCHEDULE reply with VGPU_A_SCHED_RESULT")
    size = uapi.SCHED_RESULT.size
    if len(raw) != count * size:
        raise DecodeError(f"SCHED_RESULT of {len(raw)} bytes for {count} entries")
    return [SchedResult.unpack(raw[i : i + size]) for i in range(0, len(raw), size)]


def decode_obj_results(reply: Reply, count: int) -> list[ObjResult]:
    """The OBJ_RESULT of an OBJECT reply to ``count`` operations."""
    raw = reply.attrs.get(Attr.OBJ_RESULT)
    if reply.cmd != Cmd.OBJECT or raw is None:
        raise DecodeError("not an OBJECT reply with VGPU_A_OBJ_RESULT")
    size = uapi.OBJ_RESULT.size
    if len(raw) != count * size:
        raise DecodeError(f"OBJ_RESULT of {len(raw)} bytes for {count} operations")
    return [ObjResult.unpack(raw[i : i + size]) for i in range(0, len(raw), size)]


def _attr(kind: int, payload: bytes) -> bytes:
    head = NLA_HDR.pack(NLA_HDR.size + len(payload), kind)
    return head + payload + b"\0" * (_align(len(payload)) - len(payload))


def encode_request(
    family_id: int, cmd: int, seq: int, attrs: Iterable[tuple[int, bytes]] = (),
    flags: int = NLM_F_REQUEST | NLM_F_ACK,
) -> bytes:
    """A generic netlink request of our family (reserved genl field zero)."""
    body = b"".join(_attr(kind, payload) for kind, payload in attrs)
    return (NLMSG_HDR.pack(_HDRS + len(body), family_id, flags, seq, 0)
            + GENL_HDR.pack(cmd, uapi.GENL_VERSION, 0) + body)


def encode_register(family_id: int, seq: int, version: int = uapi.PROTO_VERSION) -> bytes:
    return encode_request(family_id, Cmd.REGISTER, seq, [(Attr.VERSION, _U32.pack(version))])


def encode_set_filter(family_id: int, seq: int, filt: Filter) -> bytes:
    """SET_FILTER with FILTER_FLAGS and RULES (always sent, empty for no rules),
    and NESTED when a rule has a nested list."""
    rules = b"".join(rule.pack() for rule in filt.rules)
    attrs = [(Attr.FILTER_FLAGS, _U32.pack(filt.flags)), (Attr.RULES, rules)]
    if filt.nested:
        attrs.append((Attr.NESTED, b"".join(n.pack() for n in filt.nested)))
    return encode_request(family_id, Cmd.SET_FILTER, seq, attrs)


def encode_get_stats(family_id: int, seq: int) -> bytes:
    return encode_request(family_id, Cmd.GET_STATS, seq)


def encode_unregister(family_id: int, seq: int) -> bytes:
    return encode_request(family_id, Cmd.UNREGISTER, seq)


def encode_list_contexts(family_id: int, seq: int, cursor: int = 0) -> bytes:
    """LIST_CONTEXTS from ctx id ``cursor`` on."""
    return encode_request(family_id, Cmd.LIST_CONTEXTS, seq, [(Attr.CURSOR, _U64.pack(cursor))])


def encode_schedule(family_id: int, seq: int, entries: Sequence[Sched]) -> bytes:
    """SCHEDULE with 1..SCHED_MAX entries, applied by the module in this order."""
    if not 0 < len(entries) <= uapi.SCHED_MAX:
        raise ValueError(f"a SCHEDULE request holds 1 to {uapi.SCHED_MAX} entries, "
                         f"not {len(entries)}")
    return encode_request(family_id, Cmd.SCHEDULE, seq,
                          [(Attr.SCHED, b"".join(entry.pack() for entry in entries))])


def encode_object(family_id: int, seq: int, ops: Sequence[ObjOp]) -> bytes:
    """OBJECT with 1..OBJ_MAX operations, run by the module in this order."""
    if not 0 < len(ops) <= uapi.OBJ_MAX:
        raise ValueError(f"an OBJECT request holds 1 to {uapi.OBJ_MAX} operations, "
                         f"not {len(ops)}")
    return encode_request(family_id, Cmd.OBJECT, seq,
                          [(Attr.OBJ, b"".join(op.pack() for op in ops))])


class VerdictEncoder:
    """Builds VERDICT messages: nlmsghdr + genlmsghdr + nlattr + struct in one pack.

    Sent with NLM_F_REQUEST only and seq 0: the hot path asks for no ACK; the
    kernel still reports a refused verdict as an NLMSG_ERROR echoing it. A
    REPLY appends its VGPU_A_PARAMS / VGPU_A_DATA / VGPU_A_DATA2 attributes after
    the struct.
    """

    __slots__ = ("_allow_head", "_allow_tail", "_family_id", "_pack")

    _STRUCT = struct.Struct("=IHHIIBBHHH" + uapi.VERDICT.struct.format[1:])
    _ID_AT = _STRUCT.size - uapi.VERDICT.size  # offset of vgpu_verdict.id

    def __init__(self, family_id: int) -> None:
        self._family_id = family_id
        self._pack = self._STRUCT.pack
        allow = self._encode(0, _ALLOW)  # ALLOW, the common answer: only the id varies
        self._allow_head, self._allow_tail = allow[: self._ID_AT], allow[self._ID_AT + 8 :]

    def encode(self, upcall_id: int, verdict: Verdict) -> bytes:
        if verdict is _ALLOW and upcall_id <= _U64_MAX:
            return self._allow_head + upcall_id.to_bytes(8, _BYTEORDER) + self._allow_tail
        return self._encode(upcall_id, verdict)

    def _encode(self, upcall_id: int, verdict: Verdict) -> bytes:
        action, error, status, status_off, flags, params, data, data2 = verdict
        if params is None and data is None and data2 is None:
            return self._pack(
                _VERDICT_MSG_LEN, self._family_id, NLM_F_REQUEST, 0, 0,
                _CMD_VERDICT, _GENL_VERSION, 0, _VERDICT_ATTR_LEN, _A_VERDICT,
                upcall_id, action, error, status, status_off, flags, 0,
            )
        blocks = b""
        if params is not None:
            blocks += _attr(_A_PARAMS, params)
        if data is not None:
            blocks += _attr(_A_DATA, data)
        if data2 is not None:
            blocks += _attr(_A_DATA2, data2)
        return self._pack(
            _VERDICT_MSG_LEN + len(blocks), self._family_id, NLM_F_REQUEST, 0, 0,
            _CMD_VERDICT, _GENL_VERSION, 0, _VERDICT_ATTR_LEN, _A_VERDICT,
            upcall_id, action, error, status, status_off, flags, 0,
        ) + blocks


_VERDICT_MSG_LEN = VerdictEncoder._STRUCT.size
_ALLOW = uapi.ALLOW
_U64_MAX = (1 << 64) - 1
_BYTEORDER = sys.byteorder  # the "=" of the struct formats: native order
_VERDICT_ATTR_LEN = NLA_HDR.size + uapi.VERDICT.size
_CMD_VERDICT, _A_VERDICT = int(Cmd.VERDICT), int(Attr.VERDICT)
_GENL_VERSION = uapi.GENL_VERSION
