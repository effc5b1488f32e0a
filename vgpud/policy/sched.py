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

The owner's other scheduling controls on a known group never reach the driver
either (shadowed rules like GPFIFO_SCHEDULE's): the daemon owns the group's
timeslice, interleave level and preemption, so that a tenant cannot lengthen
its slices or preempt others. Each is answered as the driver answers an
unprivileged client (NVIDIA's open-gpu-kernel-modules: the exported method
table of src/nvidia/generated/g_kernel_channel_group_api_nvoc.c, the handlers
in src/nvidia/src/kernel/gpu/fifo/kernel_channel_group_api.c, the params and
statuses in src/common/sdk/nvidia/inc/ctrl/ctrla06c.h), after the driver's
own checks in its order: a params block that cannot be read is
NV_ERR_INVALID_ADDRESS, one of another size NV_ERR_INVALID_PARAM_STRUCT
(resControlLookup, src/nvidia/src/libraries/resserv/src/rs_resource.c):
- SET_TIMESLICE: below the driver's minimum, NV_ERR_NOT_SUPPORTED
  (kfifoChannelGroupSetTimeslice, src/nvidia/src/kernel/gpu/fifo/kernel_fifo.c);
  otherwise the value is recorded as the group's requested timeslice and
  answered NV_OK. The group's real timeslice stays the daemon's.
- GET_TIMESLICE: the requested timeslice (the driver returns the exact value
  last set, ctrla06c.h), NVIDIA's default (1024 us) until one is set.
- SET_INTERLEAVE_LEVEL: NV_ERR_INSUFFICIENT_PERMISSIONS, what the driver
  answers a client without RS_ACCESS_NICE (the control's access right; only
  an administrator or a CAP_SYS_NICE process holds it: control.c
  serverControl_ValidateCookie, client_resource.c cliresAccessCallback).
- GET_INTERLEAVE_LEVEL: NV_ERR_NOT_SUPPORTED: KEPLER_CHANNEL_GROUP_A does not
  export it (the method table has no 0xa06c0108), so the driver's lookup
  fails before it reads the params.
- PREEMPT: NV_OK and nothing issued (preempting its own group gains a
  tenant nothing, and the daemon owns preemption); a manual timeout above
  NVA06C_CTRL_CMD_PREEMPT_MAX_MANUAL_TIMEOUT_US (1 s) is
  NV_ERR_INVALID_ARGUMENT.
Another tenant's group: EPERM. A duplicate of a known group (RM_DUP_OBJECT,
which the driver allows for channel groups) is refused with EPERM: under a
handle the daemon does not know, the controls above would reach the driver.
"""

from __future__ import annotations

import errno
import struct
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
from vgpud.nvidia.layouts import (
    DecodeError,
    RmAlloc,
    RmControl,
    RmDupObject,
    RmFree,
    decode_call,
    decode_preempt,
    decode_timeslice,
    encode_timeslice,
)
from vgpud.policy.base import Policy, Request
from vgpud.policy.handles import new_handle
from vgpud.policy.rules import rm_alloc_channel_groups, rm_control_cmds, rm_dup_object, rm_free

__all__ = ["DEFAULT_TIMESLICE_US", "MAX_PREEMPT_TIMEOUT_US", "MIN_TIMESLICE_US", "SchedPolicy",
           "TenantPolicy"]

_TSG = NvClass.KEPLER_CHANNEL_GROUP_A
_CONTROL_STATUS = L.NVOS54.offsets["status"]
_SCHEDULE_SIZE = 3  # NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS: bEnable, bSkipSubmit, bSkipEnable
_OWNER_OK = Verdict.fail_status(NvStatus.OK, _CONTROL_STATUS)
_U32 = struct.Struct("=I")
# The owner's controls on its known groups that the daemon answers itself.
_OWNER_CONTROLS = frozenset({Ctrl.GPFIFO_SCHEDULE, Ctrl.SET_TIMESLICE, Ctrl.GET_TIMESLICE,
                             Ctrl.PREEMPT, Ctrl.SET_INTERLEAVE_LEVEL,
                             Ctrl.GET_INTERLEAVE_LEVEL})
# Each control's params size, as the driver's method table has it.
_PARAMS_SIZE: dict[int, int] = {
    Ctrl.GPFIFO_SCHEDULE: _SCHEDULE_SIZE,
    Ctrl.SET_TIMESLICE: L.NVA06C_CTRL_TIMESLICE_PARAMS.size,
    Ctrl.GET_TIMESLICE: L.NVA06C_CTRL_TIMESLICE_PARAMS.size,
    Ctrl.PREEMPT: L.NVA06C_CTRL_PREEMPT_PARAMS.size,
    Ctrl.SET_INTERLEAVE_LEVEL: L.NVA06C_CTRL_INTERLEAVE_LEVEL_PARAMS.size,
}
# NVA06C_DEFAULT_TIMESLICE_US: a group's timeslice until one is set
# (kfifoChannelGroupGetDefaultTimeslice_GV100: 128 << 3 us).
DEFAULT_TIMESLICE_US = 1024
# The least timeslice SET_TIMESLICE takes: the driver refuses one below
# kfifoRunlistGetMinTimeSlice_HAL, which is 0 in the open modules
# (src/nvidia/generated/g_kernel_fifo_nvoc.h; the physical RM's check runs in
# GSP firmware); 1 us, as nvsim, since a slice of 0 would run nothing.
MIN_TIMESLICE_US = 1
# NVA06C_CTRL_CMD_PREEMPT_MAX_MANUAL_TIMEOUT_US (ctrla06c.h).
MAX_PREEMPT_TIMEOUT_US = 1_000_000


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
        self._timeslices: dict[int, int] = {}  # group id -> the owner's requested timeslice (us)

    def filter(self) -> Filter:
        filt = self.inner.filter()
        extra = [*rm_alloc_channel_groups(post=True),
                 rm_control_cmds(_OWNER_CONTROLS, shadow=True)]
        if not any(r.nr == Escape.RM_FREE and r.post for r in filt.rules):
            extra.append(rm_free(post=True))
        if not any(r.nr == Escape.RM_DUP_OBJECT for r in filt.rules):
            extra.append(rm_dup_object(shadow=True))
        return filt + Filter(rules=tuple(extra))

    def requested_timeslice(self, group: Group) -> int:
        """The timeslice (us) the group's owner last set, as GET_TIMESLICE answers it."""
        return self._timeslices.get(group.id, DEFAULT_TIMESLICE_US)

    def decide(self, request: Request) -> Verdict:
        upcall = request.upcall
        nr = upcall.nr
        if upcall.kind is UpcallKind.IOCTL:
            call = request.call
            if isinstance(call, RmControl) and call.cmd in _OWNER_CONTROLS:
                group = self.tracker.get(call.h_client, call.h_object)
                if group is not None:
                    return self._owner_control(upcall, call, group)
            elif (isinstance(call, RmDupObject)
                  and self.tracker.get(call.h_client_src, call.h_object_src) is not None):
                return Verdict.deny(errno.EPERM)
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

    def _owner_control(self, upcall: Upcall, call: RmControl, group: Group) -> Verdict:
        """A scheduling control on a group the scheduler knows: answered here, never
        forwarded (see the module docstring for each answer)."""
        if self.inner.context_tenant(upcall.ctx_id) != group.tenant:
            return Verdict.deny(errno.EPERM)
        cmd, data = call.cmd, call.data
        if upcall.flags & UPCALL_F_DATA_FAULT:
            return Verdict.fail_status(NvStatus.INVALID_ADDRESS, _CONTROL_STATUS)
        size = _PARAMS_SIZE.get(cmd)
        if size is None:  # GET_INTERLEAVE_LEVEL: not a control of the class
            return Verdict.fail_status(NvStatus.NOT_SUPPORTED, _CONTROL_STATUS)
        if data is None or call.params_size != size or len(data) != size:
            return Verdict.fail_status(NvStatus.INVALID_PARAM_STRUCT, _CONTROL_STATUS)
        match cmd:
            case Ctrl.GPFIFO_SCHEDULE:
                self.tracker.set_paused(group, paused=not data[0])
            case Ctrl.SET_TIMESLICE:
                us = decode_timeslice(data)
                if us < MIN_TIMESLICE_US:
                    return Verdict.fail_status(NvStatus.NOT_SUPPORTED, _CONTROL_STATUS)
                self._timeslices[group.id] = us
            case Ctrl.GET_TIMESLICE:
                params = bytearray(upcall.params)  # the driver's copy-out: status NV_OK
                _U32.pack_into(params, _CONTROL_STATUS, NvStatus.OK)
                return Verdict.reply(bytes(params),
                                     encode_timeslice(self.requested_timeslice(group)))
            case Ctrl.PREEMPT:
                preempt = decode_preempt(data)
                if preempt.manual_timeout and preempt.timeout_us > MAX_PREEMPT_TIMEOUT_US:
                    return Verdict.fail_status(NvStatus.INVALID_ARGUMENT, _CONTROL_STATUS)
            case _:  # SET_INTERLEAVE_LEVEL
                return Verdict.fail_status(NvStatus.INSUFFICIENT_PERMISSIONS, _CONTROL_STATUS)
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
                self._forget(self.tracker.freed(pending.client, pending.handle))
            case _NewGroup(), RmAlloc(status=NvStatus.OK, h_new=made):
                p = pending
                if handle := p.handle or made:
                    group = Group(p.ctx, p.tenant, p.gpu, p.client, handle, p.parent, p.tgid)
                    self._timeslices.pop(group.id, None)  # a new group starts at the default
                    self.tracker.add(group)

    def _close(self, ctx: int) -> None:
        for upcall_id in [i for i, p in self._pending.items() if p.ctx == ctx]:
            del self._pending[upcall_id]
        self._forget(self.tracker.closed(ctx))

    def _forget(self, groups: list[Group]) -> None:
        for group in groups:
            self._timeslices.pop(group.id, None)

