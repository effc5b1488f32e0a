"""The kernel's side of the vgpu family, for host tests.

Builds messages byte for byte as the module would (nlmsghdr + genlmsghdr +
attributes padded to 4 bytes) and plays the module on one end of a
socketpair(AF_UNIX, SOCK_DGRAM) that stands in for the netlink socket.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
from dataclasses import dataclass, field

from vgpud.kernel import uapi
from vgpud.kernel.uapi import Attr, Cmd, Filter, Rule, Stats

FAMILY = 0x1F
NLMSG_HDR = struct.Struct("=IHHII")
NLMSG_ERROR = 2


def attr(kind: int, payload: bytes) -> bytes:
    pad = (-len(payload)) % 4
    return struct.pack("=HH", 4 + len(payload), kind) + payload + b"\0" * pad


def nlmsg(nl_type: int, payload: bytes, *, flags: int = 0, seq: int = 0, pid: int = 0) -> bytes:
    return NLMSG_HDR.pack(16 + len(payload), nl_type, flags, seq, pid) + payload


def genl(cmd: int, *attrs: bytes, family: int = FAMILY, seq: int = 0) -> bytes:
    return nlmsg(family, struct.pack("=BBH", cmd, 1, 0) + b"".join(attrs), seq=seq)


def upcall_struct(**kw: int) -> bytes:
    fields = dict(id=1, ctx_id=7, cgroup_id=0x100, kind=uapi.UpcallKind.IOCTL,
                  node=uapi.Node.CTL, minor=0, cmd=0, nr=0, flags=0, pid=100, tgid=100,
                  uid=1000, gid=1000, caller_pid=101, caller_tgid=100, ret=0, reserved=0)
    fields.update(kw)
    return uapi.UPCALL.struct.pack(*(fields[name] for name in uapi.UPCALL.offsets))


def upcall_msg(params: bytes = b"", data: bytes | None = None, cgroup: str | None = None,
               start_ns: int | None = None, data2: bytes | None = None, **kw: int) -> bytes:
    attrs = [attr(Attr.UPCALL, upcall_struct(**kw))]
    if kw.get("kind", uapi.UpcallKind.IOCTL) != uapi.UpcallKind.OPEN:
        attrs.append(attr(Attr.PARAMS, params))
    if data is not None:
        attrs.append(attr(Attr.DATA, data))
    if data2 is not None:
        attrs.append(attr(Attr.DATA2, data2))
    if cgroup is not None:
        attrs.append(attr(Attr.CGROUP, cgroup.encode() + b"\0"))
    if start_ns is not None:
        attrs.append(attr(Attr.OPENER, uapi.OPENER.struct.pack(start_ns, 0)))
    return genl(Cmd.UPCALL, *attrs)


def mmap_params(length: int, pgoff: int = 0, prot: int = 3, flags: int = 1) -> bytes:
    return uapi.MMAP_PARAMS.struct.pack(pgoff, length, prot, flags)


def post_event_msg(ctx_id: int, upcall_id: int, nr: int, ret: int, params: bytes,
                   data: bytes | None = None) -> bytes:
    head = uapi.EVENT.struct.pack(ctx_id, upcall_id, uapi.EventKind.POST, nr, ret, 0)
    attrs = [attr(Attr.EVENT, head), attr(Attr.PARAMS, params)]
    if data is not None:
        attrs.append(attr(Attr.DATA, data))
    return genl(Cmd.EVENT, *attrs)


def close_event_msg(ctx_id: int) -> bytes:
    head = uapi.EVENT.struct.pack(ctx_id, 0, uapi.EventKind.CLOSE, 0, 0, 0)
    return genl(Cmd.EVENT, attr(Attr.EVENT, head))


def abandoned_event_msg(ctx_id: int, upcall_id: int, kind: uapi.UpcallKind,
                        err: int = errno.ETIMEDOUT) -> bytes:
    head = uapi.EVENT.struct.pack(ctx_id, upcall_id, uapi.EventKind.ABANDONED, kind, -err, 0)
    return genl(Cmd.EVENT, attr(Attr.EVENT, head))


def ack_msg(request: bytes, err: int = 0, message: str | None = None) -> bytes:
    """NLMSG_ERROR for ``request``: the header only on success, all of it on error;
    ``message`` as the extended ACK's text."""
    _len, _type, _flags, seq, _pid = NLMSG_HDR.unpack_from(request)
    echoed = request[:16] if err == 0 else request
    body = struct.pack("=i", -err) + echoed
    flags = 0x100 if err == 0 else 0
    if message is not None:
        body += b"\0" * ((-len(body)) % 4) + attr(1, message.encode() + b"\0")
        flags |= 0x200  # NLM_F_ACK_TLVS
    return nlmsg(NLMSG_ERROR, body, flags=flags, seq=seq)


STATS4_FIELDS = [n for n in uapi.STATS4.offsets if n != "reserved"]


def stats_msg(seq: int, stats: Stats, stats4: uapi.Stats4 | None = None) -> bytes:
    values = [getattr(stats, n) for n in uapi.STATS.offsets]
    attrs = [attr(Attr.STATS, uapi.STATS.struct.pack(*values))]
    if stats4 is not None:
        raw4 = uapi.STATS4.struct.pack(*(getattr(stats4, n) for n in STATS4_FIELDS), 0, 0)
        attrs.append(attr(Attr.STATS4, raw4))
    return genl(Cmd.GET_STATS, *attrs, seq=seq)


def make_stats4(**kw: int) -> uapi.Stats4:
    return uapi.Stats4(**(dict.fromkeys(STATS4_FIELDS, 0) | kw))


def make_stats(**kw: int) -> Stats:
    values = dict.fromkeys(uapi.STATS.offsets, 0) | {"version": uapi.PROTO_VERSION} | kw
    return Stats(**values)


def contexts_msg(seq: int, contexts: list[uapi.Context], cursor: int) -> bytes:
    raw = b"".join(uapi.CONTEXT.struct.pack(*c) for c in contexts)
    return genl(Cmd.LIST_CONTEXTS, attr(Attr.CONTEXTS, raw),
                attr(Attr.CURSOR, struct.pack("=Q", cursor)), seq=seq)


def sched_results_msg(seq: int, results: list[uapi.SchedResult]) -> bytes:
    raw = b"".join(uapi.SCHED_RESULT.struct.pack(*r) for r in results)
    return genl(Cmd.SCHEDULE, attr(Attr.SCHED_RESULT, raw), seq=seq)


def obj_results_msg(seq: int, results: list[uapi.ObjResult]) -> bytes:
    raw = b"".join(uapi.OBJ_RESULT.struct.pack(*r) for r in results)
    return genl(Cmd.OBJECT, attr(Attr.OBJ_RESULT, raw), seq=seq)


def make_context(ctx_id: int, node: uapi.Node = uapi.Node.CTL, **kw: int) -> uapi.Context:
    values = dict(cgroup_id=0x100, minor=0, pid=100 + ctx_id, tgid=100 + ctx_id, uid=1000,
                  gid=1000) | kw
    return uapi.Context(ctx_id=ctx_id, node=node, **values)


def parse_request(buf: bytes) -> tuple[int, int, int, dict[int, bytes]]:
    """(seq, flags, cmd, attrs) of one daemon request."""
    length, nl_type, flags, seq, _pid = NLMSG_HDR.unpack_from(buf)
    assert nl_type == FAMILY and length == len(buf)
    cmd, _version, reserved = struct.unpack_from("=BBH", buf, 16)
    assert reserved == 0
    attrs, off = {}, 20
    while off < length:
        alen, kind = struct.unpack_from("=HH", buf, off)
        attrs[kind] = buf[off + 4 : off + alen]
        off += (alen + 3) & ~3
    return seq, flags, cmd, attrs


def parse_filter(attrs: dict[int, bytes]) -> Filter:
    raw = attrs[Attr.RULES]
    rules = tuple(Rule.unpack(raw[i : i + uapi.RULE.size])
                  for i in range(0, len(raw), uapi.RULE.size))
    raw = attrs.get(Attr.NESTED, b"")
    nested = tuple(uapi.RuleNested.unpack(raw[i : i + uapi.RULE_NESTED.size])
                   for i in range(0, len(raw), uapi.RULE_NESTED.size))
    return Filter(struct.unpack("=I", attrs[Attr.FILTER_FLAGS])[0], rules, nested)


@dataclass
class FakeKernel:
    """Answers control requests and records verdicts, on the event loop."""

    sock: socket.socket
    errors: dict[int, int] = field(default_factory=dict)  # cmd -> errno to answer
    silent: set[int] = field(default_factory=set)  # cmds left unanswered
    stats: Stats = field(default_factory=make_stats)
    stats4: uapi.Stats4 | None = field(default_factory=make_stats4)
    requests: list[int] = field(default_factory=list)
    filters: list[Filter] = field(default_factory=list)
    verdicts: asyncio.Queue = field(default_factory=asyncio.Queue)  # struct vgpu_verdict tuples
    # REPLY: (PARAMS, DATA, DATA2)
    blocks: dict[int, tuple[bytes | None, ...]] = field(default_factory=dict)
    late: bool = False  # answer every verdict with -ENOENT
    contexts: list[uapi.Context] = field(default_factory=list)  # live, for LIST_CONTEXTS
    list_page: int = uapi.LIST_MAX  # contexts per LIST_CONTEXTS reply
    cursors: list[int] = field(default_factory=list)  # LIST_CONTEXTS cursors asked for
    schedules: list[list[uapi.Sched]] = field(default_factory=list)  # SCHEDULE requests
    statuses: dict[tuple[int, int], int] = field(default_factory=dict)  # (client, object)
    # The driver's objects for OBJECT: (client, handle) -> (class, parent, size).
    objects: dict[tuple[int, int], tuple[int, int, int]] = field(default_factory=dict)
    obj_requests: list[list[uapi.ObjOp]] = field(default_factory=list)  # OBJECT requests
    registered: bool = False

    def start(self) -> None:
        self.sock.setblocking(False)
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._on_readable)

    def stop(self) -> None:
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.sock.close()

    def send(self, msg: bytes) -> None:
        self.sock.send(msg)

    def _on_readable(self) -> None:
        try:
            buf = self.sock.recv(1 << 16)
        except BlockingIOError:
            return
        seq, _flags, cmd, attrs = parse_request(buf)
        if cmd == Cmd.VERDICT:
            verdict = uapi.VERDICT.struct.unpack(attrs[Attr.VERDICT])
            if Attr.PARAMS in attrs or Attr.DATA in attrs:
                self.blocks[verdict[0]] = (attrs.get(Attr.PARAMS), attrs.get(Attr.DATA),
                                           attrs.get(Attr.DATA2))
            self.verdicts.put_nowait(verdict)
            if self.late:
                self.send(ack_msg(buf, 2))
            return
        self.requests.append(cmd)
        if cmd in self.silent:
            return
        if cmd in self.errors:
            self.send(ack_msg(buf, self.errors[cmd]))
            return
        if cmd == Cmd.REGISTER:
            self.registered = True
        if cmd == Cmd.UNREGISTER:
            self.registered = False
        if cmd == Cmd.SET_FILTER:
            self.filters.append(parse_filter(attrs))
        if cmd == Cmd.GET_STATS:
            self.send(stats_msg(seq, self.stats, self.stats4))
        if cmd == Cmd.LIST_CONTEXTS:
            self._list_contexts(seq, attrs)
        if cmd == Cmd.SCHEDULE:
            err, message = self._schedule(seq, attrs)
            if err:
                self.send(ack_msg(buf, err, message))
                return
        if cmd == Cmd.OBJECT:
            err, message = self._object(seq, attrs)
            if err:
                self.send(ack_msg(buf, err, message))
                return
        self.send(ack_msg(buf))

    def _object(self, seq: int, attrs: dict[int, bytes]) -> tuple[int, str | None]:
        """As the module: registered port only, 1..OBJ_MAX well-formed ops, each
        answered from `objects` as the driver would (0x33: no such object)."""
        if not self.registered:
            return errno.EPERM, "vgpu: OBJECT is for the registered daemon only"
        raw = attrs.get(Attr.OBJ, b"")
        size = uapi.OBJ_OP.size
        if not raw or len(raw) % size or len(raw) // size > uapi.OBJ_MAX:
            return errno.EINVAL, "vgpu: OBJ must hold 1 to VGPU_OBJ_MAX struct vgpu_obj_op"
        fields = list(uapi.OBJ_OP.struct.iter_unpack(raw))
        if any(not 1 <= op <= 4 or (op != 4 and parent) for _c, _h, parent, _o, op in fields):
            return errno.EINVAL, "vgpu: bad OBJ operation"
        ops = [uapi.ObjOp(c, h, p, o, uapi.ObjOpKind(op)) for c, h, p, o, op in fields]
        self.obj_requests.append(ops)
        nodes = {c.ctx_id: c.node for c in self.contexts}
        results = []
        for op in ops:
            node = nodes.get(op.ctx_id)
            obj = self.objects.get((op.h_client, op.h_object))
            if node is None:
                results.append(uapi.ObjResult(-errno.ENOENT, 0, 0))
            elif node != uapi.Node.CTL:
                results.append(uapi.ObjResult(-errno.EINVAL, 0, 0))
            elif obj is None:
                results.append(uapi.ObjResult(0, 0x33, 0))
            elif op.op is uapi.ObjOpKind.FREE:
                del self.objects[op.h_client, op.h_object]
                results.append(uapi.ObjResult(0, 0, 0))
            else:
                results.append(uapi.ObjResult(0, 0, obj[op.op - 1]))
        self.send(obj_results_msg(seq, results))
        return 0, None

    def _list_contexts(self, seq: int, attrs: dict[int, bytes]) -> None:
        (cursor,) = struct.unpack("=Q", attrs.get(Attr.CURSOR, bytes(8)))
        self.cursors.append(cursor)
        live = sorted((c for c in self.contexts if c.ctx_id >= cursor), key=lambda c: c.ctx_id)
        page, rest = live[: self.list_page], live[self.list_page :]
        self.send(contexts_msg(seq, page, rest[0].ctx_id if rest else 0))

    def _schedule(self, seq: int, attrs: dict[int, bytes]) -> tuple[int, str | None]:
        """As the module: registered port only, 1..SCHED_MAX well-formed entries."""
        if not self.registered:
            return errno.EPERM, "vgpu: SCHEDULE is for the registered daemon only"
        raw = attrs.get(Attr.SCHED, b"")
        size = uapi.SCHED.size
        if not raw or len(raw) % size or len(raw) // size > uapi.SCHED_MAX:
            return errno.EINVAL, "vgpu: SCHED must hold 1 to VGPU_SCHED_MAX struct vgpu_sched"
        fields = list(uapi.SCHED.struct.iter_unpack(raw))
        takes_arg = (uapi.SchedState.TIMESLICE, uapi.SchedState.INTERLEAVE)
        if any(enable > uapi.SchedState.INTERLEAVE or (arg and enable not in takes_arg)
               for _c, _h, _o, enable, arg in fields):
            return errno.EINVAL, "vgpu: bad SCHED entry"
        entries = [uapi.Sched(c, h, o, e, a) for c, h, o, e, a in fields]
        self.schedules.append(entries)
        nodes = {c.ctx_id: c.node for c in self.contexts}
        results = []
        for e in entries:
            node = nodes.get(e.ctx_id)
            if node is None:
                results.append(uapi.SchedResult(-errno.ENOENT, 0))
            elif node != uapi.Node.CTL:
                results.append(uapi.SchedResult(-errno.EINVAL, 0))
            else:
                results.append(uapi.SchedResult(0, self.statuses.get((e.h_client, e.h_object), 0)))
        self.send(sched_results_msg(seq, results))
        return 0, None
