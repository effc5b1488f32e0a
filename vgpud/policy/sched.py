"""SchedPolicy: the quota policy plus channel-group tracking (sans-I/O).

Every upcall and event goes to the inner policy first, unchanged; this layer
only watches:
- RM_ALLOC of KEPLER_CHANNEL_GROUP_A (NVOS21 / NVOS64, the rule
  rm_alloc_channel_groups, POST events): on success the new group (client
  hRoot, device hObjectParent, the handle decided on: the caller's hObjectNew,
  or the one the inner policy named where the driver would generate it, never
  the results' copy) is added to the tracker with its context's tenant and
  its device's GPU, both as the inner policy knows them (it tracks clients
  and devices per context);
- RM_FREE that succeeded, of a client that owns groups: the group, its device
  or its client;
- CLOSE events: the context's groups.
The tracker tells its sinks (the scheduler service).

Two answers make sure that no group runs outside its tenant's slot:
- a channel-group alloc is allowed with VERDICT_F_SCHED_OFF: the module turns
  the new group off before the call returns, so it is off before its owner
  has its handle; the scheduler turns it on in its tenant's slots;
- the owner's own GPFIFO_SCHEDULE on a known group never reaches the driver
  (the rule is shadowed, so the driver could only act on the checked copy):
  the daemon answers NV_OK and records the owner's wish. "Off" pauses the
  group (the scheduler turns it off for good, VGPU_SCHED_OWNER_OFF, and lets
  it be), "on" hands it back to the scheduler. Another tenant's group: EPERM.
  A group the daemon does not know (not a tenant's) is the driver's business.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Protocol

from vgpud.core.groups import Group, GroupTracker
from vgpud.core.ledger import Key
from vgpud.kernel.codec import AbandonedEvent, CloseEvent, Event, PostEvent, Upcall
from vgpud.kernel.uapi import (
    UPCALL_F_DATA_FAULT,
    VERDICT_F_SCHED_OFF,
    Filter,
    ObjQuery,
    UpcallKind,
    Verdict,
    VerdictAction,
)
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import Ctrl, Escape, NvClass, NvStatus
from vgpud.nvidia.layouts import DecodeError, RmAlloc, RmControl, RmFree, decode_call
from vgpud.policy.base import Policy, Request
from vgpud.policy.handles import new_handle
from vgpud.policy.rules import rm_alloc_channel_groups, rm_control_cmds, rm_free

__all__ = ["SchedPolicy", "TenantPolicy"]

_TSG = NvClass.KEPLER_CHANNEL_GROUP_A
_CONTROL_STATUS = L.NVOS54.offsets["status"]
_SCHEDULE_SIZE = 3  # NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS: bEnable, bSkipSubmit, bSkipEnable
_OWNER_OK = Verdict.fail_status(NvStatus.OK, _CONTROL_STATUS)


class TenantPolicy(Policy, Protocol):
    """A policy that resolves contexts to tenants and objects to GPUs (QuotaPolicy)."""

    def context_tenant(self, ctx: int) -> str | None: ...

    def gpu_for(self, parent: Key, tenant: str, upcall: Upcall) -> int: ...


@dataclass(frozen=True, slots=True)
class _NewGroup:
    ctx: int
    tenant: str
    gpu: int
    client: int
    parent: int
    tgid: int
    handle: int  # decided on (0: the driver's, known only from the results)


@dataclass(frozen=True, slots=True)
class _Free:
    ctx: int
    client: int
    handle: int


class SchedPolicy:
    def __init__(self, inner: TenantPolicy, tracker: GroupTracker) -> None:
        self.inner = inner
        self.tracker = tracker
        self._pending: dict[int, _NewGroup | _Free] = {}  # upcall id -> what its POST completes

    def filter(self) -> Filter:
        filt = self.inner.filter()
        extra = [*rm_alloc_channel_groups(post=True),
                 rm_control_cmds([Ctrl.GPFIFO_SCHEDULE], shadow=True)]
        if not any(r.nr == Escape.RM_FREE and r.post for r in filt.rules):
            extra.append(rm_free(post=True))
        return filt + Filter(rules=tuple(extra))

    def decide(self, request: Request) -> Verdict:
        upcall = request.upcall
        nr = upcall.nr
        if upcall.kind is UpcallKind.IOCTL and nr == Escape.RM_CONTROL:
            call = request.call
            if isinstance(call, RmControl) and call.cmd == Ctrl.GPFIFO_SCHEDULE:
                group = self.tracker.get(call.h_client, call.h_object)
                if group is not None:
                    return self._owner_schedule(upcall, call, group)
        verdict = self.inner.decide(request)
        if (verdict.action is VerdictAction.ALLOW and upcall.kind is UpcallKind.IOCTL
                and (nr == Escape.RM_ALLOC or nr == Escape.RM_FREE)
                and self._watch(upcall, request.call, verdict)):
            return verdict._replace(flags=verdict.flags | VERDICT_F_SCHED_OFF)
        return verdict

    def decide_post(self, request: Request) -> Verdict | ObjQuery:
        upcall = request.upcall
        self._complete(upcall.id, upcall.ret, upcall.params)
        return self.inner.decide_post(request)

    def on_event(self, event: Event) -> None:
        try:
            self.inner.on_event(event)
        finally:
            match event:
                case PostEvent():
                    self._complete(event.upcall_id, event.ret, event.params)
                case CloseEvent():
                    self._close(event.ctx_id)
                case AbandonedEvent() if event.kind is not UpcallKind.POST:
                    self._pending.pop(event.upcall_id, None)  # the call did not happen
                    if event.kind is UpcallKind.OPEN:
                        self._close(event.ctx_id)

    def _watch(self, upcall: Upcall, call: object, verdict: Verdict) -> bool:
        """Note an allowed alloc or free; True for a tenant's channel-group alloc."""
        match call:
            case RmAlloc(h_class=h_class) if h_class == _TSG:
                tenant = self.inner.context_tenant(upcall.ctx_id)
                if tenant is not None:
                    gpu = self.inner.gpu_for(Key(call.h_root, call.h_parent), tenant, upcall)
                    # The params the driver reads: the verdict's, if it named the handle.
                    handle = (new_handle(upcall.nr, verdict.params) if verdict.params
                              else call.h_new)
                    self._pending[upcall.id] = _NewGroup(upcall.ctx_id, tenant, gpu, call.h_root,
                                                         call.h_parent, upcall.opener.tgid,
                                                         handle)
                    return True
            case RmFree(h_root=client) if self.tracker.has_client(client):
                self._pending[upcall.id] = _Free(upcall.ctx_id, client, call.h_object)
        return False

    def _owner_schedule(self, upcall: Upcall, call: RmControl, group: Group) -> Verdict:
        """GPFIFO_SCHEDULE on a group the scheduler knows: answered here, never forwarded."""
        if self.inner.context_tenant(upcall.ctx_id) != group.tenant:
            return Verdict.deny(errno.EPERM)
        data = call.data
        if data is None or call.params_size != _SCHEDULE_SIZE or len(data) != _SCHEDULE_SIZE:
            bad = (NvStatus.INVALID_ADDRESS if upcall.flags & UPCALL_F_DATA_FAULT
                   else NvStatus.INVALID_PARAM_STRUCT)
            return Verdict.fail_status(bad, _CONTROL_STATUS)
        self.tracker.set_paused(group, paused=not data[0])
        return _OWNER_OK

    def _complete(self, upcall_id: int, ret: int, params: bytes) -> None:
        """The POST of a watched call: its results, as the driver left them."""
        pending = self._pending.pop(upcall_id, None)
        if pending is None or ret != 0:
            return
        nr = Escape.RM_FREE if isinstance(pending, _Free) else Escape.RM_ALLOC
        try:
            result = decode_call(nr, params)
        except DecodeError:
            return
        match pending, result:
            case _Free(), RmFree(status=NvStatus.OK):
                self.tracker.freed(pending.client, pending.handle)
            case _NewGroup(), RmAlloc(status=NvStatus.OK, h_new=made):
                p = pending
                if handle := p.handle or made:
                    self.tracker.add(Group(p.ctx, p.tenant, p.gpu, p.client, handle, p.parent,
                                           p.tgid))

    def _close(self, ctx: int) -> None:
        for upcall_id in [i for i, p in self._pending.items() if p.ctx == ctx]:
            del self._pending[upcall_id]
        self.tracker.closed(ctx)

