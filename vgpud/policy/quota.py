"""The quota policy: per-tenant GPU memory limits enforced on the upcall path.

Sans-I/O: the Dispatcher hands it decoded upcalls and events and sends the
verdicts it returns; it reads tenants from a TenantDirectory (the admin side
serves it and owns the ledger's limits, so live changes need nothing here),
keeps the ledger's contexts, reservations, charges and object tree up to date,
and publishes what changed (vgpud.policy.events) on ``observers``.

Why it works this way: an allocation is reserved before the driver sees it
(so two concurrent ones cannot pass on the same free bytes) and committed or
released on its POST event; every rule whose call it charges, tracks or frees
asks for shadow calls, so a caller's thread cannot change a size, handle or
device id between the decision and the driver's read; a refusal looks like a
real out-of-memory (FAIL_STATUS NV_ERR_NO_MEMORY); a tenant with a limit sees
its limit as the GPU's memory. What each call does is in docs/architecture.md
(The quota policy, call by call).
"""

from __future__ import annotations

import errno
import logging
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from typing import Any

from vgpud.core.ledger import (
    Denied,
    Key,
    Ledger,
    LedgerError,
    Usage,
)
from vgpud.core.observers import Topic
from vgpud.core.tenants import (
    ObjectLimits,
    Opener,
    Tenant,
    TenantDirectory,
    UvmPolicy,
    resolve,
    start_ticks,
)
from vgpud.kernel.codec import AbandonedEvent, CloseEvent, Event, PostEvent, Upcall
from vgpud.kernel.uapi import (
    ALLOW,
    ALLOW_POST,
    FILTER_OPEN,
    FILTER_UVM_MMAP,
    UPCALL_F_DATA2_BIG,
    UPCALL_F_DATA2_FAULT,
    Context,
    Filter,
    MmapParams,
    Node,
    ObjOp,
    ObjOpKind,
    ObjQuery,
    ObjResult,
    UpcallKind,
    Verdict,
)
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import (
    DEVICE_MEMORY_CLASSES,
    LIMITED_CLASS_KIND,
    NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED,
    NVOS32_ALLOC_FLAGS_VIRTUAL,
    Ctrl,
    Escape,
    NvClass,
    NvStatus,
    VidHeapFunction,
)
from vgpud.nvidia.layouts import (
    DeviceAllocParams,
    MemoryAllocParams,
    RmAlloc,
    RmAllocMemory,
    RmControl,
    RmDupObject,
    RmFree,
    VidHeapControl,
)
from vgpud.nvidia.pages import granule, page_round
from vgpud.policy import fbview
from vgpud.policy.base import Request
from vgpud.policy.classes import (
    ALLOC_MEMORY_PASS,
    TREE_CLASSES,
    UVM_ALLOCATING,
    VID_HEAP_HARMLESS,
    params_status,
    refused_class,
)
from vgpud.policy.events import (
    ContextClosed,
    ContextOpened,
    QuotaEvent,
    QuotaExceeded,
    UsageChanged,
)
from vgpud.policy.handles import name_handle, new_handle, with_handle
from vgpud.policy.objects import ObjectCounts
from vgpud.policy.pending import Charge, Counted, Dup, FbView, Free, HeapInfo, Pending, Track
from vgpud.policy.rules import (
    rm_alloc_any,
    rm_alloc_classes,
    rm_alloc_classes_bare,
    rm_alloc_memory_any,
    rm_alloc_memory_classes,
    rm_control_cmds,
    rm_control_fb_get_info,
    rm_dup_object,
    rm_free,
    rm_vid_heap,
    uvm_cmds,
)

__all__ = ["QuotaPolicy"]

log = logging.getLogger(__name__)

DENY_EACCES = Verdict.deny(errno.EACCES)
DENY_ENOMEM = Verdict.deny(errno.ENOMEM)
DENY_EINVAL = Verdict.deny(errno.EINVAL)

_MISSING = object()
_U32 = struct.Struct("=I")
# Closed contexts whose tenant is remembered (a few hundred KiB at most).
CLOSED_KEPT = 4096


class QuotaPolicy:
    """Memory quotas, the virtualized FB view and the UVM policy (see the module doc)."""

    def __init__(
        self,
        directory: TenantDirectory,
        ledger: Ledger,
        *,
        cgroup_path: Callable[[int], str | None] | None = None,
        truth: bool = True,
    ) -> None:
        """``truth``: an allocation is charged what the driver says it made (a
        POST upcall and VGPU_CMD_OBJECT); without it (a trace replayed with no
        driver to ask), what its results say, on its POST event."""
        self._truth_check = truth
        self.directory = directory
        self.ledger = ledger
        self.observers: Topic[QuotaEvent] = Topic()
        self._cgroup_path = cgroup_path
        # ctx -> tenant (None: refused); contexts already in the ledger were
        # restored from the charge journal.
        self._contexts: dict[int, str | None] = dict(ledger.contexts())
        # The tenants of the last CLOSED_KEPT contexts closed, for readers that
        # learn of a context after it closed (the latency probes).
        self._closed: OrderedDict[int, str] = OrderedDict()
        # Contexts opened before this daemon and missing from its journal:
        # their devices may be unknown, so their GPU is guessed (_gpu_for).
        self._learned: set[int] = set()
        self.restored = frozenset(self._contexts)
        self._pending: dict[int, Pending] = {}  # upcall id -> what its POST completes
        self._tenants_seen: Sequence[Tenant] | None = None
        self._by_name: dict[str, Tenant] = {}
        self._gpu_indexes = frozenset(gpu.index for gpu in directory.gpus)
        # Objects under a tenant object limit (their in-flight allocations
        # are in _pending).
        self.objects = ObjectCounts()
        # What a POST upcall of each record answers, and what its POST event
        # (or a POST upcall with nothing to ask) completes.
        self._post_upcall: dict[type, Callable[[Upcall, Any], Verdict | ObjQuery]] = {
            Charge: self._truth, Counted: self._object_truth, FbView: self._fb_view,
            HeapInfo: self._heap_info, Track: self._as_event, Free: self._as_event,
            Dup: self._as_event}
        self._post_event: dict[type, Callable[[Any, bool, int, bytes], None]] = {
            Charge: self._commit, Track: self._track, Counted: self._count,
            Free: self._free, Dup: self._dup, FbView: _nothing, HeapInfo: _nothing}

    # --- Policy ---

    def filter(self) -> Filter:
        charged = sorted(DEVICE_MEMORY_CLASSES)
        return Filter(
            flags=FILTER_OPEN | FILTER_UVM_MMAP,
            rules=(
                # POST events commit, track and free: the ledger needs results.
                # Shadow calls: the driver acts on the sizes, handles and
                # device ids decided on here, whatever the caller's threads
                # write meanwhile.
                *rm_alloc_classes([*TREE_CLASSES, *charged], post=True, shadow=True),
                rm_free(post=True, shadow=True),
                rm_dup_object(post=True, shadow=True),
                rm_alloc_memory_classes(charged, post=True, shadow=True),
                # Every function: the unknown ones are refused here. INFO's
                # results come back in a POST upcall (ALLOW_POST), not an event.
                rm_vid_heap(post=True, shadow=True),
                rm_control_cmds([Ctrl.FB_GET_INFO_V2]),
                # Objects that make video memory implicitly: counted per
                # tenant (POST). Then every other class: the memory classes
                # not known to pass are refused (docs/architecture.md).
                *rm_alloc_classes_bare(sorted(LIMITED_CLASS_KIND), post=True, shadow=True),
                *rm_alloc_any(shadow=True),
                rm_alloc_memory_any(shadow=True),
                # nvidia-uvm calls that make UVM allocate video memory:
                # refused to tenants with uvm = "deny".
                *uvm_cmds(UVM_ALLOCATING),
            ),
            # FB_GET_INFO (v1): its list, behind a pointer in the control
            # params, comes up as VGPU_A_DATA2 and is rewritten by a REPLY.
        ) + rm_control_fb_get_info()

    def decide(self, request: Request) -> Verdict:
        upcall = request.upcall
        if upcall.kind is UpcallKind.OPEN:
            return self._open(upcall)
        tenant = self._tenant_of(upcall)
        if tenant is None:
            return DENY_EACCES
        if upcall.kind is UpcallKind.MMAP:
            return self._mmap(upcall, tenant, request.call)
        if upcall.node is Node.UVM:
            return self._uvm_ioctl(upcall, tenant)
        match request.call:
            case RmAlloc() as call:
                return self._rm_alloc(upcall, tenant, call)
            case RmFree() as call:
                return self._rm_free(upcall, call)
            case RmDupObject() as call:
                return self._rm_dup(upcall, call)
            case RmAllocMemory() as call:
                return self._rm_alloc_memory(upcall, tenant, call)
            case VidHeapControl() as call:
                return self._vid_heap(upcall, tenant, call)
            case RmControl() as call:
                return self._control(upcall, tenant, call)
            case None if upcall.nr == Escape.RM_ALLOC:
                return self._undecodable_alloc(upcall)
        return ALLOW

    def decide_post(self, request: Request) -> Verdict | ObjQuery:
        """A POST upcall: the FB view is rewritten, an allocation is charged what
        the driver says it holds (an ObjQuery); anything else completes as on an
        event."""
        upcall = request.upcall
        pending = self._pending.pop(upcall.id, None)
        if pending is None:
            return ALLOW
        return self._post_upcall[type(pending)](upcall, pending)

    def _as_event(self, upcall: Upcall, pending: Pending) -> Verdict:
        self._complete(pending, upcall.nr, upcall.ret, upcall.params)
        return ALLOW

    def reconcile(self, live: Iterable[Context]) -> list[int]:
        """After a restart: contexts restored from the charge journal that the
        module no longer lists were closed while no daemon ran; their charges
        go. Returns those contexts."""
        alive = {c.ctx_id for c in live}
        gone = [ctx for ctx in sorted(self.restored - alive) if ctx in self._contexts]
        for ctx in gone:
            self._close(ctx)
        log.info("restored contexts: %d live, %d closed while the daemon was down",
                 len(self.restored) - len(gone), len(gone))
        return gone

    def on_event(self, event: Event) -> None:
        match event:
            case PostEvent():
                pending = self._pending.pop(event.upcall_id, None)
                if pending is not None:
                    self._complete(pending, event.nr, event.ret, event.params)
            case CloseEvent():
                self._close(event.ctx_id)
            case AbandonedEvent():
                self._abandon(event)

    def _abandon(self, event: AbandonedEvent) -> None:
        """The caller stopped waiting: what its upcall reserved goes back.

        An abandoned POST upcall follows a call that did happen: what it
        reserved is settled by the call's POST event, as without it."""
        if event.kind is UpcallKind.POST:
            return
        pending = self._pending.pop(event.upcall_id, None)
        if pending is not None:
            self._complete(pending, 0, -event.errno, b"")  # the call did not happen
        if event.kind is UpcallKind.OPEN:
            self._close(event.ctx_id)
        elif event.kind is UpcallKind.MMAP and (key := Key(0, event.upcall_id)) in self.ledger:
            self.ledger.free(key)
            tenant = self._contexts.get(event.ctx_id)
            if tenant is not None:
                self.observers.notify(UsageChanged(tenant))

    # --- what other policies built on this one read (vgpud.sched) ---

    def context_tenant(self, ctx: int) -> str | None:
        """The tenant of a context seen so far; None if unknown or refused."""
        return self._contexts.get(ctx)

    def closed_context_tenant(self, ctx: int) -> str | None:
        """The tenant of a context among the last CLOSED_KEPT closed; else None."""
        return self._closed.get(ctx)

    def gpu_for(self, parent: Key, tenant: str, upcall: Upcall) -> int:
        """The GPU of an object allocated under ``parent``, as for a charge."""
        return self._gpu_for(parent, tenant, upcall)

    # --- contexts ---

    def _open(self, upcall: Upcall) -> Verdict:
        o = upcall.opener
        start = None if o.start_ns is None else start_ticks(o.start_ns)
        name = self._resolve(o.pid, o.tgid, o.uid, o.gid, o.cgroup_id, o.cgroup or "", start)
        if name is None:
            log.info("open refused: pid %d uid %d cgroup %s matches no tenant",
                     o.tgid, o.uid, o.cgroup)
            return DENY_EACCES
        if upcall.node is Node.GPU and not self._allows(name, upcall.minor):
            log.info("open refused: %s may not use GPU %d (pid %d)", name, upcall.minor, o.tgid)
            return DENY_EACCES
        if upcall.ctx_id in self._contexts:  # a stale context of the same id
            self._close(upcall.ctx_id)
        self._start_context(upcall.ctx_id, name)
        return ALLOW

    def _tenant_of(self, upcall: Upcall) -> str | None:
        try:
            return self._contexts[upcall.ctx_id]
        except KeyError:
            pass
        # Opened before this daemon started: learn it from the header.
        o = upcall.opener
        path = self._cgroup_path(o.cgroup_id) if self._cgroup_path is not None else None
        name = self._resolve(o.pid, o.tgid, o.uid, o.gid, o.cgroup_id, path or "")
        log.info("context %d (pid %d uid %d cgroup %s) opened before this daemon: tenant %s",
                 upcall.ctx_id, o.tgid, o.uid, path or f"id {o.cgroup_id}", name)
        self._learned.add(upcall.ctx_id)
        if name is None:
            self._contexts[upcall.ctx_id] = None
        else:
            self._start_context(upcall.ctx_id, name)
        return name

    def _resolve(self, pid: int, tgid: int, uid: int, gid: int, cgroup_id: int,
                 path: str, start: int | None = None) -> str | None:
        """`start` (ticks): None for a context opened before this daemon,
        which no pid binding can then claim."""
        d = self.directory
        return resolve(Opener(pid, tgid, uid, gid, cgroup_id, path, start), d.tenants,
                       d.bindings, d.default_tenant, d.cgroup_bindings, d.cgroup_id_of)

    def _start_context(self, ctx: int, name: str) -> None:
        self._contexts[ctx] = name
        try:
            self.ledger.open(ctx, name)
        except LedgerError as exc:  # a tenant without accounts (no GPUs in the inventory)
            log.warning("context %d of %s not accounted: %r", ctx, name, exc)
            return
        self.observers.notify(ContextOpened(ctx, name))

    def _close(self, ctx: int) -> None:
        name = self._contexts.pop(ctx, _MISSING)
        if isinstance(name, str):
            self._closed[ctx] = name
            if len(self._closed) > CLOSED_KEPT:
                self._closed.popitem(last=False)
        self._learned.discard(ctx)
        for upcall_id in [i for i, p in self._pending.items() if p.ctx == ctx]:
            del self._pending[upcall_id]
        self.objects.discard(self.objects.of_context(ctx))
        if not isinstance(name, str):
            return
        try:
            self.ledger.close(ctx)
        except LedgerError:  # never accounted (a tenant without accounts)
            return
        self.observers.notify(ContextClosed(ctx, name))

    def _tenant(self, name: str) -> Tenant | None:
        tenants = self.directory.tenants
        if tenants is not self._tenants_seen:
            self._by_name = {t.name: t for t in tenants}
            self._tenants_seen = tenants
        return self._by_name.get(name)

    # --- allocations ---

    def _rm_alloc(self, upcall: Upcall, tenant: str, call: RmAlloc) -> Verdict:
        h_class = call.h_class
        if h_class in DEVICE_MEMORY_CLASSES:
            alloc = call.alloc
            if not isinstance(alloc, MemoryAllocParams):
                return Verdict.fail_status(params_status(upcall, call.p_alloc_params),
                                           call.status_off)
            return self._reserve(upcall, tenant, call.h_root, call.h_parent, call.h_new,
                                 page_round(alloc.size, granule(alloc.attr, alloc.attr2,
                                                                alloc.alignment)),
                                 call.status_off, frozenset({h_class}))
        if h_class in TREE_CLASSES:
            gpu = None
            if h_class == NvClass.DEVICE_0:
                gpu = self._device_gpu(upcall, call)
                if gpu is None:
                    return Verdict.fail_status(params_status(upcall, call.p_alloc_params),
                                               call.status_off)
                if not self._allows(tenant, gpu):
                    # As the driver answers a device instance that does not exist.
                    log.info("%s may not use GPU %d: device refused", tenant, gpu)
                    return Verdict.fail_status(NvStatus.INVALID_CLASS, call.status_off)
            elif isinstance(call.alloc, DeviceAllocParams):
                gpu = call.alloc.device_id
            self._pending[upcall.id] = Track(upcall.ctx_id, h_class, call.h_root,
                                              call.h_parent, gpu)
            return ALLOW
        return self._other_class(upcall, tenant, call)

    @staticmethod
    def _device_gpu(upcall: Upcall, call: RmAlloc) -> int | None:
        """The GPU an NV01_DEVICE_0 alloc names, as the driver reads it (no
        alloc params: device 0), or None when its params did not decode."""
        if isinstance(call.alloc, DeviceAllocParams):
            return call.alloc.device_id
        if not call.p_alloc_params:
            return 0
        return None

    def _allows(self, tenant: str, gpu: int) -> bool:
        t = self._tenant(tenant)
        return t is not None and t.allows_gpu(gpu)

    def _undecodable_alloc(self, upcall: Upcall) -> Verdict:
        """RM_ALLOC whose params or alloc params did not decode: no charged class passes."""
        params = upcall.params
        status_off = L.status_offset(Escape.RM_ALLOC, len(params))
        if status_off is None:
            return ALLOW  # not NVOS21/NVOS64: the driver refuses it
        h_class = _U32.unpack_from(params, L.NVOS21.offsets["hClass"])[0]
        if refused_class(h_class):
            return Verdict.fail_status(NvStatus.INVALID_CLASS, status_off)
        if h_class not in DEVICE_MEMORY_CLASSES:
            return ALLOW
        return Verdict.fail_status(params_status(upcall, 1), status_off)

    def _rm_alloc_memory(self, upcall: Upcall, tenant: str, call: RmAllocMemory) -> Verdict:
        if call.h_class not in DEVICE_MEMORY_CLASSES and call.h_class not in ALLOC_MEMORY_PASS:
            log.info("upcall %d: %s calls RM_ALLOC_MEMORY of class %#x: refused", upcall.id,
                     tenant, call.h_class)
            return Verdict.fail_status(NvStatus.INVALID_CLASS, L.NVOS02_WITH_FD.offsets["status"])
        if call.h_class not in DEVICE_MEMORY_CLASSES or call.limit >= 2**64 - 1:
            return ALLOW  # the driver refuses an all-ones limit (NV_ERR_INVALID_LIMIT)
        return self._reserve(upcall, tenant, call.h_root, call.h_parent, call.h_new,
                             call.limit + 1, L.NVOS02_WITH_FD.offsets["status"],
                             frozenset({call.h_class}))

    def _vid_heap(self, upcall: Upcall, tenant: str, call: VidHeapControl) -> Verdict:
        """ALLOC_SIZE, ALLOC_TILED_PITCH_HEIGHT and ALLOC_SIZE_RANGE are charged
        (a virtual range is not), FREE and INFO as RM_FREE and FB_GET_INFO are;
        the rest pass only when known not to make video memory (VID_HEAP_HARMLESS)."""
        function = call.function
        if function == VidHeapFunction.FREE:
            return self._rm_free(upcall, RmFree(call.h_root, call.h_parent, call.h_memory, 0))
        if function == VidHeapFunction.INFO:
            return self._view(upcall, tenant, Key(call.h_root, call.h_parent), HeapInfo)
        if function in VID_HEAP_HARMLESS:
            return ALLOW
        alloc = call.alloc
        if alloc is None:
            log.info("upcall %d: %s calls VID_HEAP function %d: refused", upcall.id, tenant,
                     function)
            return Verdict.fail_status(NvStatus.INVALID_ARGUMENT, L.NVOS32.offsets["status"])
        if alloc.flags & NVOS32_ALLOC_FLAGS_VIRTUAL:
            return ALLOW
        # hMemory is the caller's only with MEMORY_HANDLE_PROVIDED; else the driver's.
        handle = alloc.h_memory if alloc.flags & NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED else 0
        return self._reserve(upcall, tenant, call.h_root, call.h_parent, handle,
                             page_round(alloc.size, granule(alloc.attr, alloc.attr2,
                                                            alloc.alignment)),
                             L.NVOS32.offsets["status"], DEVICE_MEMORY_CLASSES)

    def _reserve(self, upcall: Upcall, tenant: str, client: int, h_parent: int, h_new: int,
                 size: int, status_off: int, classes: frozenset[int]) -> Verdict:
        parent = Key(client, h_parent)
        ledger = self.ledger
        gpu = ledger.gpu_of(parent)
        if gpu is None and upcall.ctx_id in self._learned:
            gpu = self._gpu_for(parent, tenant, upcall)
        if gpu is None or not self._allows(tenant, gpu):
            # Video memory is made under a device or subdevice, and this
            # daemon saw every device its contexts made: under anything else
            # the GPU it would land on is unknown (or not the tenant's).
            log.info("upcall %d: %s allocates under %s, not a device of its GPUs: refused",
                     upcall.id, tenant, parent)
            return Verdict.fail_status(NvStatus.INVALID_OBJECT_PARENT, status_off)
        verdict = ALLOW
        if self._truth_check:
            verdict, h_new = self._named(upcall, client, h_new)
        try:
            result = ledger.reserve(upcall.ctx_id, gpu, page_round(size),
                                    parent if parent in ledger else None,
                                    Key(client, h_new) if h_new else None)
        except LedgerError as exc:
            log.warning("upcall %d: %s on GPU %d not accounted (%r): refused",
                        upcall.id, tenant, gpu, exc)
            return Verdict.fail_status(NvStatus.NO_MEMORY, status_off)
        if isinstance(result, Denied):
            log.info("quota: %s asked %d bytes on GPU %d, %d of %d used: refused",
                     tenant, result.size, gpu, result.used, result.limit)
            self.observers.notify(QuotaExceeded(result))
            return Verdict.fail_status(NvStatus.NO_MEMORY, status_off)
        self._pending[upcall.id] = Charge(upcall.ctx_id, result, client, h_new, h_parent,
                                           classes, status_off)
        # The results come back in a POST upcall: the charge is the driver's truth.
        return verdict

    # --- the driver's truth (POST upcall of a reserved allocation) ---

    def _truth(self, upcall: Upcall, pending: Charge) -> Verdict | ObjQuery:
        """Ask the driver what the allocation made, whatever its results say.

        The results lie in the tenant's memory (the shadow, then its own
        params): a sibling thread can rewrite the status or the new handle
        there. So the handle is the one decided on from the checked upcall
        (or named by the daemon where the driver would have generated one:
        vgpud.policy.handles), and the status is not read: the object's
        class, parent and size come from the driver (VGPU_CMD_OBJECT)."""
        handle = pending.handle
        ctx, client = pending.ctx, pending.client
        ops = tuple(ObjOp(ctx, client, 0, handle, op)
                    for op in (ObjOpKind.CLASS, ObjOpKind.PARENT, ObjOpKind.MEM_SIZE))

        def resume(results: Sequence[ObjResult] | None) -> Verdict | ObjQuery:
            if results is None:  # no truth to be had: the results, as before
                self._complete(pending, upcall.nr, upcall.ret, upcall.params)
                return ALLOW
            return self._charge_truth(pending, handle, results, upcall)

        return ObjQuery(ops, resume)

    def _charge_truth(self, pending: Charge, handle: int, results: Sequence[ObjResult],
                      upcall: Upcall) -> Verdict | ObjQuery:
        klass, parent, size = results
        known = all(not r.error and r.status == NvStatus.OK for r in results)
        key = Key(pending.client, handle)
        if not known or key in self.ledger:
            # No such object (the call failed, whatever its status says), or not
            # the one reserved for (a handle already taken): nothing to charge.
            self._settle(pending, None, upcall)
            return ALLOW
        if klass.value not in pending.classes or parent.value != pending.parent:
            if klass.value not in DEVICE_MEMORY_CLASSES:
                self._settle(pending, None, upcall)  # not memory: not this charge's
                return ALLOW
            # Video memory, uncharged, under the decided handle, but of another
            # class or parent than decided on: the params changed under the
            # driver (a sibling writing the shadow). Undone, as if over quota.
            log.warning("upcall %d: %s is class %#x under %#x, decided %s under %#x: freed",
                        upcall.id, key, klass.value, parent.value,
                        sorted(hex(c) for c in pending.classes), pending.parent)
            return self._undo(pending, key, parent.value, size.value, upcall)
        r = pending.reservation
        try:
            over = self.ledger.commit(r, key, size.value)
        except LedgerError as exc:  # the context closed meanwhile
            log.info("upcall %d: allocation not charged: %r", upcall.id, exc)
            return ALLOW
        if over is None:
            if size.value != r.size:
                log.debug("upcall %d: %s holds %d bytes, %d reserved", upcall.id, key,
                          size.value, r.size)
            self.observers.notify(UsageChanged(r.tenant))
            return ALLOW
        log.info("quota: %s got %d bytes on GPU %d (%d reserved), %d of %d used: freed",
                 r.tenant, size.value, r.gpu, r.size, over.used, over.limit)
        self.observers.notify(QuotaExceeded(over))
        return self._undo(pending, key, pending.parent, size.value, upcall)

    def _undo(self, pending: Charge, key: Key, parent: int, size: int,
              upcall: Upcall) -> ObjQuery:
        """Free what the driver made and answer out-of-memory; what cannot be
        freed is charged, over the limit if need be."""
        free = (ObjOp(pending.ctx, key.client, parent, key.handle, ObjOpKind.FREE),)

        def freed(results: Sequence[ObjResult] | None) -> Verdict:
            ok = results is not None and not results[0].error and results[0].status == 0
            if ok:
                self._settle(pending, None, upcall)
                return Verdict.fail_status(NvStatus.NO_MEMORY, pending.status_off)
            log.warning("upcall %d: %s could not be freed: charged", upcall.id, key)
            with suppress(LedgerError):
                self.ledger.commit(pending.reservation, key, size, force=True)
                self.observers.notify(UsageChanged(pending.reservation.tenant))
            return ALLOW

        return ObjQuery(free, freed)

    def _settle(self, pending: Charge, key: Key | None, upcall: Upcall) -> None:
        """Nothing to charge: the reservation goes back."""
        r = pending.reservation
        try:
            self.ledger.release(r)
        except LedgerError as exc:  # released already (the context closed)
            log.debug("upcall %d: %r", upcall.id, exc)
            return
        self.observers.notify(UsageChanged(r.tenant))

    def _gpu_for(self, parent: Key, tenant: str, upcall: Upcall) -> int:
        gpu = self.ledger.gpu_of(parent)
        if gpu is not None:
            return gpu
        if upcall.node is Node.GPU:
            return upcall.minor
        return self._first_gpu(tenant)

    def _first_gpu(self, tenant: str) -> int:
        t = self._tenant(tenant)
        for gpu in self.directory.gpus:
            if t is None or t.allows_gpu(gpu.index):
                return gpu.index
        return 0

    # --- classes other than the charged and the tree's ---

    def _other_class(self, upcall: Upcall, tenant: str, call: RmAlloc) -> Verdict:
        """Memory classes not known to pass are refused as the driver refuses a
        class it has no constructor for; objects that make video memory
        implicitly are counted against the tenant's object limits."""
        h_class = call.h_class
        if refused_class(h_class):
            log.info("upcall %d: %s allocates class %#x: refused", upcall.id, tenant, h_class)
            return Verdict.fail_status(NvStatus.INVALID_CLASS, call.status_off)
        kind = LIMITED_CLASS_KIND.get(h_class)
        if kind is None:
            return ALLOW
        return self._admit(upcall, tenant, kind, call.h_root, call.h_parent, call.h_new,
                           call.status_off)

    def _admit(self, upcall: Upcall, tenant: str, kind: str, client: int, parent: int,
               handle: int, status_off: int) -> Verdict:
        t = self._tenant(tenant)
        limit = (t.limits if t is not None else ObjectLimits()).limit(kind)
        in_flight = sum(1 for p in self._pending.values()
                        if isinstance(p, Counted) and p.tenant == tenant and p.kind == kind)
        held = self.objects.held(tenant, kind)
        if held + in_flight >= limit:
            log.info("upcall %d: %s holds %d %s (%d in flight), its limit is %d: refused",
                     upcall.id, tenant, held, kind, in_flight, limit)
            return Verdict.fail_status(NvStatus.INSUFFICIENT_RESOURCES, status_off)
        verdict = ALLOW
        if self._truth_check:
            # Counted when the driver holds it, whatever the results say.
            verdict, handle = self._named(upcall, client, handle)
        self._pending[upcall.id] = Counted(upcall.ctx_id, tenant, kind, client, parent, handle)
        return verdict

    def _named(self, upcall: Upcall, client: int, handle: int) -> tuple[Verdict, int]:
        """ALLOW_POST and the new object's handle: the caller's, or where the
        driver would generate one, a handle the daemon names (v5: the driver
        reads the verdict's params), since the driver would report its own
        only in the tenant-writable results."""
        if handle:
            return ALLOW_POST, handle
        ledger = self.ledger
        handle = name_handle(upcall.id, lambda h: Key(client, h) in ledger)
        return ALLOW_POST._replace(params=with_handle(upcall, handle)), handle

    def _object_truth(self, upcall: Upcall, pending: Counted) -> Verdict | ObjQuery:
        """POST upcall of a counted object: counted if the driver holds an
        object of its kind under the handle decided on."""
        if not pending.handle:  # the driver's handle (no truth check): the results
            return self._as_event(upcall, pending)
        op = ObjOp(pending.ctx, pending.client, 0, pending.handle, ObjOpKind.CLASS)

        def resume(results: Sequence[ObjResult] | None) -> Verdict:
            if results is None:  # no truth to be had: the results, as before
                self._complete(pending, upcall.nr, upcall.ret, upcall.params)
                return ALLOW
            (klass,) = results
            if (not klass.error and klass.status == NvStatus.OK
                    and LIMITED_CLASS_KIND.get(klass.value) == pending.kind):
                self._object_made(pending, pending.handle)
            return ALLOW

        return ObjQuery((op,), resume)

    def _object_made(self, pending: Counted, handle: int) -> None:
        """POST of a counted object: it exists from now on, until freed (with
        its parent, its client or its file). It joins the ledger's tree so
        that a free of anything above it is seen."""
        if not handle:
            return
        key, parent = Key(pending.client, handle), Key(pending.client, pending.parent)
        ledger = self.ledger
        if key not in ledger:
            try:
                ledger.track(pending.ctx, key, parent if parent in ledger else None,
                             ledger.gpu_of(parent))
            except LedgerError as exc:  # counted all the same: a limit errs on the safe side
                log.warning("object %s of %s not in the tree: %r", key, pending.tenant, exc)
        self.objects.add(key, pending)

    # --- frees and dups ---

    def _rm_free(self, upcall: Upcall, call: RmFree) -> Verdict:
        key = Key(call.h_root, call.h_object)
        if key in self.ledger:
            self._pending[upcall.id] = Free(upcall.ctx_id, key)
        return ALLOW

    def _rm_dup(self, upcall: Upcall, call: RmDupObject) -> Verdict:
        source = Key(call.h_client_src, call.h_object_src)
        counted = self.objects.get(source)
        if counted is not None:  # a second handle keeps the object: counted as one more
            return self._admit(upcall, counted.tenant, counted.kind, call.h_client,
                               call.h_parent, call.h_object, L.NVOS55.offsets["status"])
        if source in self.ledger:
            self._pending[upcall.id] = Dup(upcall.ctx_id, call.h_client, call.h_parent, source)
        return ALLOW

    # --- completion (POST) ---

    def _complete(self, pending: Pending, nr: int, ret: int, params: bytes) -> None:
        status_off = L.status_offset(nr, len(params))
        ok = (ret == 0 and status_off is not None
              and _U32.unpack_from(params, status_off)[0] == NvStatus.OK)
        try:
            self._post_event[type(pending)](pending, ok, nr, params)
        except LedgerError as exc:
            log.warning("POST of %s: %r", type(pending).__name__, exc)

    def _commit(self, pending: Charge, ok: bool, nr: int, params: bytes) -> None:
        r, ledger = pending.reservation, self.ledger
        handle = new_handle(nr, params) if ok else 0
        if handle:
            try:
                ledger.commit(r, Key(pending.client, handle))
            except LedgerError:
                ledger.release(r)
                raise
        else:
            ledger.release(r)
        self.observers.notify(UsageChanged(r.tenant))

    def _count(self, pending: Counted, ok: bool, nr: int, params: bytes) -> None:
        self._object_made(pending, new_handle(nr, params) if ok else 0)

    def _free(self, pending: Free, ok: bool, nr: int, params: bytes) -> None:
        if not ok:
            return
        freed = self.ledger.free(pending.key)
        self.objects.discard(freed.keys)
        for tenant in {r.tenant for r in freed.released}:
            self.observers.notify(UsageChanged(tenant))

    def _dup(self, pending: Dup, ok: bool, nr: int, params: bytes) -> None:
        handle = new_handle(nr, params) if ok else 0
        if not handle:
            return
        ledger = self.ledger
        key, parent = Key(pending.client, handle), Key(pending.client, pending.parent)
        ledger.dup(pending.ctx, key, pending.source, parent if parent in ledger else None)

    def _track(self, pending: Track, ok: bool, nr: int, params: bytes) -> None:
        handle = new_handle(nr, params) if ok else 0
        if not handle:
            return
        ledger = self.ledger
        gpu = None
        if pending.h_class == NvClass.ROOT_CLIENT:
            key, parent = Key(handle, handle), None
        else:
            key, parent = Key(pending.client, handle), Key(pending.client, pending.parent)
            if parent not in ledger:
                parent = None
        if pending.h_class == NvClass.DEVICE_0:
            gpu = pending.gpu if pending.gpu in self._gpu_indexes else None
            if gpu is None:
                log.warning("device %s on GPU %s, not in the inventory", key, pending.gpu)
        elif pending.h_class == NvClass.SUBDEVICE_0 and parent is not None:
            gpu = ledger.gpu_of(parent)
        ledger.track(pending.ctx, key, parent, gpu)

    # --- the virtualized FB view ---

    def _control(self, upcall: Upcall, tenant: str, call: RmControl) -> Verdict:
        cmd = call.cmd
        if (cmd != Ctrl.FB_GET_INFO_V2 and cmd != Ctrl.FB_GET_INFO) or upcall.data is None:
            return ALLOW
        if cmd == Ctrl.FB_GET_INFO and upcall.flags & (UPCALL_F_DATA2_BIG | UPCALL_F_DATA2_FAULT):
            # The module has no copy of the list: the driver must not read the
            # caller's. Refused as the driver refuses such a list.
            status_off = L.status_offset(upcall.nr, len(upcall.params))
            if status_off is not None:
                bad = (NvStatus.INVALID_ARGUMENT if upcall.flags & UPCALL_F_DATA2_BIG
                       else NvStatus.INVALID_ADDRESS)
                return Verdict.fail_status(bad, status_off)
            return DENY_EINVAL
        return self._view(upcall, tenant, Key(call.h_client, call.h_object), FbView)

    def _view(self, upcall: Upcall, tenant: str, target: Key,
              kind: type[FbView] | type[HeapInfo]) -> Verdict:
        """A memory query of a tenant with a limit, on a GPU we can name: its
        results come back in a POST upcall to be rewritten."""
        t = self._tenant(tenant)
        gpu = self.ledger.gpu_of(target)
        if t is None or t.memory is None or gpu is None:
            return ALLOW  # no limit (or a GPU we cannot name): the driver's answer stands
        self._pending[upcall.id] = kind(upcall.ctx_id, tenant, gpu)
        return ALLOW_POST

    def _usage(self, upcall: Upcall, pending: FbView | HeapInfo) -> Usage | None:
        """The tenant's account, when the driver answered the query with success."""
        if not fbview.answered(upcall):
            return None
        try:
            return self.ledger.usage(pending.tenant, pending.gpu)
        except LedgerError:
            return None

    def _fb_view(self, upcall: Upcall, pending: FbView) -> Verdict:
        usage = self._usage(upcall, pending)
        return ALLOW if usage is None else fbview.fb_view(upcall, usage)

    def _heap_info(self, upcall: Upcall, pending: HeapInfo) -> Verdict:
        usage = self._usage(upcall, pending)
        return ALLOW if usage is None else fbview.heap_info(upcall, usage)

    # --- nvidia-uvm ---

    def _uvm_ioctl(self, upcall: Upcall, tenant: str) -> Verdict:
        """A UVM call that makes video memory (UVM_ALLOCATING): refused to a
        tenant whose managed memory is refused, with the errno of its refused
        mmap; a tenant with "count" or "allow" goes on (what "count" counts:
        docs/architecture.md)."""
        t = self._tenant(tenant)
        if upcall.nr in UVM_ALLOCATING and t is not None and t.uvm is UvmPolicy.DENY:
            log.info("upcall %d: %s calls UVM command %d: refused (uvm = deny)", upcall.id,
                     tenant, upcall.nr)
            return DENY_ENOMEM
        return ALLOW

    def _mmap(self, upcall: Upcall, tenant: str, call: object) -> Verdict:
        t = self._tenant(tenant)
        uvm = UvmPolicy.COUNT if t is None else t.uvm
        if uvm is UvmPolicy.ALLOW:
            return ALLOW
        if uvm is UvmPolicy.DENY:
            return DENY_ENOMEM
        if not isinstance(call, MmapParams):
            return DENY_EINVAL
        gpu = self._first_gpu(tenant)
        ledger = self.ledger
        try:
            result = ledger.reserve(upcall.ctx_id, gpu, page_round(call.length))
            if isinstance(result, Denied):
                self.observers.notify(QuotaExceeded(result))
                return DENY_ENOMEM
            # Key(0, id): client handle 0 is never an RM client; upcall ids are unique.
            ledger.commit(result, Key(0, upcall.id))
        except LedgerError as exc:
            log.warning("uvm mmap of %s not accounted: %r", tenant, exc)
            return DENY_ENOMEM
        self.observers.notify(UsageChanged(tenant))
        return ALLOW


def _nothing(pending: Pending, ok: bool, nr: int, params: bytes) -> None:
    """A POST event of a view: its POST upcall, if any, rewrote the answer."""
