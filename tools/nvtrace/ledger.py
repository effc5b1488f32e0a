"""A trace replayed through the vgpu module's filter and vgpud's quota policy.

The module is modelled as vgpu_filter_match does it (kmod/vgpu/upcall.c):
a call goes up when a rule names its node and escape (after XFER
unwrapping), its exact params size (or any), and its u32 key; the rule's
buffer is the one the recorder copied at the same pointer. Each selected
call becomes an IOCTL upcall to the daemon's Dispatcher; an ALLOW is
followed by what the module would send (a POST upcall when the verdict asks
for it, else a POST event when the rule does) with the driver's results from
the trace. Opens, closes and nvidia-uvm mmaps become OPEN upcalls, CLOSE
events and MMAP upcalls.

After every call the ledger's bytes are compared with the memory the trace
itself holds (model.HeldMemory, from the driver's answers).
"""

from __future__ import annotations

import itertools
import struct
from collections import Counter
from dataclasses import dataclass, field

from tools.nvtrace.calls import Closed, Ioctl, Mmap, NodeKind, Opened, events
from tools.nvtrace.fmt import OpenHow, Trace
from tools.nvtrace.model import HeldMemory
from tools.nvtrace.report import Finding, inventory_keys
from tools.nvtrace.vgpud_api import QuotaStack
from vgpud.kernel.codec import CloseEvent, Opener, PostEvent, Upcall
from vgpud.kernel.uapi import (
    FILTER_OPEN,
    FILTER_UVM_MMAP,
    MMAP_PARAMS,
    OFF_NONE,
    PARAMS_MAX,
    UPCALL_F_DATA_BIG,
    UPCALL_F_DATA_FAULT,
    UPCALL_F_XFER,
    VERDICT_F_POST,
    Filter,
    Node,
    Rule,
    UpcallKind,
    Verdict,
    VerdictAction,
)

__all__ = ["LedgerResult", "ModuleModel", "PolicyReplay"]

_NODES = {NodeKind.CTL: Node.CTL, NodeKind.GPU: Node.GPU, NodeKind.UVM: Node.UVM}
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
MAX_DIVERGENCES = 5  # reported per trace; the rest are counted


class ModuleModel:
    """vgpu_filter_match over a Filter."""

    def __init__(self, filt: Filter) -> None:
        self.filter = filt

    def match(self, node: Node, nr: int, params: bytes) -> tuple[Rule, int] | None:
        """The first rule that selects the call, and the params size under it."""
        for r in self.filter.rules:
            if not r.node_mask & (1 << node) or r.nr != nr:
                continue
            if node == Node.UVM:
                if r.size > len(params):
                    continue
                eff = r.size
            elif r.size and r.size != len(params):
                continue
            else:
                eff = len(params)
            if r.match_off == OFF_NONE:
                return r, eff
            if eff and r.match_off + 4 <= eff:
                key = _U32.unpack_from(params, r.match_off)[0]
                if key in r.match:
                    return r, eff
        return None


@dataclass(slots=True)
class LedgerResult:
    """The replay of one trace."""

    trace: str
    held_end: int = 0  # bytes the trace holds at its end (by the driver's answers)
    ledger_end: int = 0  # bytes the ledger charges then
    after_close: int = 0  # bytes the ledger charges once every file is closed
    calls_up: int = 0  # upcalls the module would send
    replies: int = 0  # POST upcalls answered with rewritten results (the FB view)
    up: Counter[tuple[str, int]] = field(default_factory=Counter)  # by inventory key
    findings: list[Finding] = field(default_factory=list)
    divergences: int = 0


class PolicyReplay:
    """Feeds traces, one after another, to one Dispatcher and QuotaPolicy."""

    def __init__(self, stack: QuotaStack) -> None:
        self.dispatcher = stack.dispatcher
        self.ledger = stack.ledger
        self.filter: Filter = stack.policy.filter()
        self.module = ModuleModel(self.filter)
        self._ids = itertools.count(1)
        self._ctxs = itertools.count(1)

    def new_id(self) -> int:
        """An upcall id, unique across the traces replayed."""
        return next(self._ids)

    def new_ctx(self) -> int:
        """A context id (an open file of vgpu), unique across the traces replayed."""
        return next(self._ctxs)

    def charged(self) -> int:
        return sum(u.charged + u.reserved for u in self.ledger.snapshot())

    def run(self, trace: Trace) -> LedgerResult:
        run = _Run(self, trace)
        for ev in events(trace):
            run.event(ev)
            run.compare(ev.record.seq)
        res = run.result
        res.held_end, res.ledger_end = run.model.held(), self.charged()
        for ctx in list(run.refs):
            run.close_ctx(ctx)
        res.after_close = self.charged()
        if res.after_close or run.model.held():
            res.findings.append(Finding(trace.name, -1, f"after every file closed the ledger "
                                        f"charges {res.after_close} bytes, the trace holds "
                                        f"{run.model.held()}"))
        return res


class _Run:
    """The state of one trace's replay: contexts by fd, the memory model."""

    def __init__(self, replay: PolicyReplay, trace: Trace) -> None:
        self.r = replay
        self.name = trace.name
        pid = trace.header.pid
        self.opener = Opener(pid, pid, 0, 0, 0, None, None)
        self.pid = pid
        self.model = HeldMemory()
        self.ctx_of: dict[int, int] = {}  # fd -> ctx
        self.refs: Counter[int] = Counter()  # ctx -> fds naming it
        self.result = LedgerResult(trace.name)

    def finding(self, seq: int, what: str) -> None:
        self.result.findings.append(Finding(self.name, seq, what))

    def compare(self, seq: int) -> None:
        held, charged = self.model.held(), self.r.charged()
        if held != charged:
            self.result.divergences += 1
            if self.result.divergences <= MAX_DIVERGENCES:
                self.finding(seq, f"ledger charges {charged} bytes, the trace holds {held}")

    def event(self, ev: Opened | Closed | Ioctl | Mmap) -> None:
        if isinstance(ev, Opened):
            self.opened(ev)
        elif isinstance(ev, Closed):
            ctx = self.ctx_of.pop(ev.fd, None)
            if ctx is not None:
                self.refs[ctx] -= 1
                if self.refs[ctx] == 0:
                    self.close_ctx(ctx)
        elif ev.fd in self.ctx_of:
            ctx = self.ctx_of[ev.fd]
            if isinstance(ev, Ioctl):
                self.ioctl(ev, ctx)
                self.model.apply(ev, ctx)
            elif ev.node.kind is NodeKind.UVM and self.r.filter.flags & FILTER_UVM_MMAP:
                self.mmap(ev, ctx)

    def opened(self, ev: Opened) -> None:
        node = _NODES.get(ev.node.kind)
        if node is None:
            return  # not emulated by vgpu: its calls go to the driver unseen
        how, old = ev.record.args[2], ev.record.args[3]
        if how == OpenHow.DUP and old in self.ctx_of:
            ctx = self.ctx_of[old]
        else:
            ctx = self.r.new_ctx()
            if how == OpenHow.CALL and self.r.filter.flags & FILTER_OPEN:
                v = self.upcall(ctx, UpcallKind.OPEN, node, ev.node.minor, 0, 0, b"",
                                cgroup="/")
                if v.action is not VerdictAction.ALLOW:
                    self.finding(ev.record.seq, f"open of {ev.node.path} refused: {v}")
        self.ctx_of[ev.fd] = ctx
        self.refs[ctx] += 1

    def close_ctx(self, ctx: int) -> None:
        del self.refs[ctx]
        self.r.dispatcher.on_event(CloseEvent(ctx))
        self.model.close(ctx)

    def upcall(self, ctx: int, kind: UpcallKind, node: Node, minor: int, cmd: int, nr: int,
               params: bytes, *, flags: int = 0, data: bytes | None = None, ret: int = 0,
               uid: int | None = None, cgroup: str | None = None) -> Verdict:
        up = Upcall(self.r.new_id() if uid is None else uid, ctx, kind, node, minor, cmd,
                    nr, flags, self.opener._replace(cgroup=cgroup), self.pid, self.pid,
                    params, data, ret)
        return self.r.dispatcher.on_upcall(up)

    def mmap(self, ev: Mmap, ctx: int) -> None:
        params = MMAP_PARAMS.struct.pack(ev.offset >> 12, ev.length, ev.prot, ev.flags)
        v = self.upcall(ctx, UpcallKind.MMAP, Node.UVM, 0, 0, 0, params)
        if v.action is not VerdictAction.ALLOW and ev.ok:
            self.finding(ev.record.seq, f"nvidia-uvm mmap of {ev.length} bytes refused: {v}")

    def ioctl(self, ev: Ioctl, ctx: int) -> None:
        node = _NODES[ev.node.kind]
        params = ev.params_in
        if params is None or (not ev.nvidia and node is not Node.UVM):
            return
        m = self.r.module.match(node, ev.nr, params)
        if m is None:
            return
        rule, eff = m
        data, flags = _rule_data(rule, params[:eff], ev)
        uid = self.r.new_id()
        res = self.result
        res.calls_up += 1
        res.up.update(inventory_keys(ev, params))
        v = self.upcall(ctx, UpcallKind.IOCTL, node, ev.node.minor, ev.request, ev.nr,
                        params[:eff], flags=flags | (UPCALL_F_XFER if ev.xfer else 0),
                        data=data, uid=uid)
        if v.action is not VerdictAction.ALLOW:
            if ev.ok:
                self.finding(ev.seq, f"escape {ev.nr:#x}: the driver did it, the policy "
                             f"answers {v.action.name} (status {v.status:#x}, errno {v.error})")
            return
        self.post(ev, ctx, rule, v, uid, eff, data)

    def post(self, ev: Ioctl, ctx: int, rule: Rule, v: Verdict, uid: int, eff: int,
             data: bytes | None) -> None:
        """What the module sends once the driver returned, with the trace's results."""
        out = (ev.params_out or b"")[:eff]
        data_out = None
        if data is not None and ev.data_out is not None and ev.data_out.whole:
            data_out = ev.data_out.data
        ret = ev.ret if ev.ret >= 0 else -ev.err
        if v.flags & VERDICT_F_POST:
            node = _NODES[ev.node.kind]
            pv = self.upcall(ctx, UpcallKind.POST, node, ev.node.minor, ev.request, ev.nr, out,
                             data=data_out, ret=ret, uid=uid)
            if pv.action is VerdictAction.REPLY:
                self.result.replies += 1
        elif rule.post:
            self.r.dispatcher.on_event(PostEvent(ctx, uid, ev.nr, ret, out, data_out))


def _rule_data(rule: Rule, params: bytes, ev: Ioctl) -> tuple[bytes | None, int]:
    """The rule's buffer as the module would copy it (vgpu_copy_data), and flags."""
    eff = len(params)
    if rule.ptr_off == OFF_NONE or eff < 8 or rule.ptr_off > eff - 8 or (
            not rule.data_size and rule.len_off > eff - 4):
        return None, 0
    ptr = _U64.unpack_from(params, rule.ptr_off)[0]
    if rule.data_size and not ptr:
        return None, 0
    length = rule.data_size or _U32.unpack_from(params, rule.len_off)[0]
    if length > PARAMS_MAX:
        return None, UPCALL_F_DATA_BIG
    if not length:
        return None, 0
    b = ev.data_in
    if b is None or b.addr != ptr or b.want != length or not b.whole:
        return None, UPCALL_F_DATA_FAULT
    return b.data, 0

