"""The D-Bus admin API: org.vgpud1 on the system bus.

/org/vgpud1                   org.vgpud1.Manager  (methods, signals)
/org/vgpud1/tenant/<label>    org.vgpud1.Tenant   (read-only properties)

docs/org.vgpud1.xml is the introspection of these interfaces and
docs/dbus-api.md describes them; regenerate the XML with
`python -m vgpud.admin.dbus > docs/org.vgpud1.xml` (a test checks it).

Reads are open to everyone; changes need root or the admin group, checked
from the caller's bus credentials. Property changes are coalesced into one
PropertiesChanged per tenant every FLUSH_DELAY seconds, QuotaExceeded is
sent at most once per QUOTA_INTERVAL per (tenant, GPU), and the scheduler
publishes Share / MeasuredShare at most once a second, so a busy data path
cannot flood the bus.
"""

from __future__ import annotations

import asyncio
import sys
import xml.etree.ElementTree as ET
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Annotated, Any, Protocol

from dbus_fast import DBusError, Message, MessageType, RequestNameReply, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.annotations import DBusObjectPath, DBusSignature, DBusStr, DBusUInt32
from dbus_fast.constants import NameFlag, PropertyAccess
from dbus_fast.introspection import Node
from dbus_fast.service import ServiceInterface, dbus_method, dbus_property, dbus_signal

from vgpud import __version__
from vgpud.admin.auth import caller_of, is_admin
from vgpud.admin.manager import (
    BINDINGS,
    CONTEXTS,
    USAGE,
    AdminError,
    InvalidArgument,
    InvalidConfig,
    Manager,
    ManagerEvent,
    NoSuchTenant,
    SettingsChanged,
    TenantBusy,
    TenantChanged,
    TenantsChanged,
)
from vgpud.admin.names import (
    BUS_NAME,
    ERROR,
    MANAGER_INTERFACE,
    MANAGER_PATH,
    TENANT_INTERFACE,
    tenant_path,
)
from vgpud.core.ledger import Denied
from vgpud.core.shares import SharesChanged
from vgpud.policy.events import QuotaEvent, QuotaExceeded
from vgpud.probes.histograms import Histogram

__all__ = ["BUS_NAME", "MANAGER_PATH", "AdminService", "introspection_xml", "tenant_path"]

FLUSH_DELAY = 0.05
QUOTA_INTERVAL = 1.0
SHARES = "shares"  # a change field of the scheduler's, beside the Manager's
_DOCTYPE = (
    '<!DOCTYPE node PUBLIC "-//freedesktop//DTD D-BUS Object Introspection 1.0//EN"\n'
    '"http://www.freedesktop.org/standards/dbus/1.0/introspect.dtd">\n'
)

_ERRORS: dict[type[AdminError], str] = {
    NoSuchTenant: "NoSuchTenant",
    InvalidArgument: "InvalidArgument",
    TenantBusy: "TenantBusy",
    InvalidConfig: "InvalidConfig",
}

GpuBytes = Annotated[dict[int, int], DBusSignature("a{ut}")]
GpuPercent = Annotated[dict[int, float], DBusSignature("a{ud}")]
GpuText = Annotated[dict[int, str], DBusSignature("a{us}")]
GpuSlices = Annotated[dict[int, list[int]], DBusSignature("a{uau}")]
GpuCounts = Annotated[dict[int, int], DBusSignature("a{ut}")]
TenantList = Annotated[list[list[Any]], DBusSignature("a(so)")]
GpuList = Annotated[list[list[Any]], DBusSignature("a(ustt)")]
Options = Annotated[dict[str, Variant], DBusSignature("a{sv}")]
Rules = Annotated[list[dict[str, Variant]], DBusSignature("aa{sv}")]
Indexes = Annotated[list[int], DBusSignature("au")]
Paths = Annotated[list[str], DBusSignature("as")]
ObjectCounts = Annotated[dict[str, int], DBusSignature("a{su}")]
TenantRef = Annotated[list[str], DBusSignature("so")]
QuotaBody = Annotated[list[Any], DBusSignature("suttt")]
LatencyList = Annotated[list[list[Any]], DBusSignature("a(ssatt)")]
NoReply = Annotated[None, DBusSignature("")]

# CreateTenant / UpdateTenant options: key -> (variant signature, Tenant field).
_OPTIONS = {
    "memory": ("s", "memory"),
    "match-cgroup": ("as", "match"),
    "match-uid": ("au", "match"),
    "gpus": ("au", "gpus"),
    "uvm": ("s", "uvm"),
    "weight": ("u", "weight"),
    "cap": ("u", "cap"),
    "priority": ("s", "priority"),
    "limits": ("a{su}", "limits"),
}
_UPDATE_OPTIONS = ("memory", "weight", "cap", "priority", "limits")

# Manager change fields -> the Tenant properties they affect.
_PROPERTIES = {
    "memory": ("MemoryLimit", "MemoryLimitBytes"),
    "gpus": ("Gpus", "MemoryLimitBytes"),
    "uvm": ("Uvm",),
    "weight": ("Weight",),
    "cap": ("Cap",),
    "priority": ("Priority",),
    "limits": ("Limits",),
    "match": ("Match",),
    "pids": ("Pids",),
    BINDINGS: ("Pids", "Cgroups"),
    USAGE: ("MemoryUsed",),
    CONTEXTS: ("Contexts",),
    SHARES: ("Share", "MeasuredShare", "Timeslices", "Preemptions"),
}

class Latency(Protocol):
    """What the Manager object reads of the latency probes (ProbeService)."""

    status: str

    @property
    def on(self) -> bool: ...

    def latency(self, tenant: str, kind: str = "") -> dict[tuple[str, str], Histogram]: ...


class Shares(Protocol):
    """What the Tenant objects read of the scheduler (SchedulerService)."""

    def share(self, tenant: str) -> dict[int, float]: ...

    def measured_share(self, tenant: str) -> dict[int, float]: ...

    def modes(self) -> dict[int, str]: ...

    def timeslices(self, tenant: str) -> dict[int, list[int]]: ...

    def preemptions(self, tenant: str) -> dict[int, int]: ...


# The sender of the method call being dispatched: set by a message handler
# that runs just before dbus-fast dispatches the call, captured by the task
# that runs an async method (tasks copy the context they are created in).
_sender: ContextVar[str | None] = ContextVar("vgpud_dbus_sender", default=None)


@contextmanager
def _dbus_errors() -> Iterator[None]:
    try:
        yield
    except AdminError as e:
        raise DBusError(ERROR + _ERRORS.get(type(e), "Failed"), str(e)) from e


def _fields(options: Mapping[str, Variant], known: Collection[str]) -> dict[str, object]:
    """Manager fields from D-Bus options: memory "" and cap 0 mean none."""
    fields: dict[str, Any] = {}
    for key, variant in options.items():
        if key not in known:
            raise InvalidArgument(f"unknown option {key!r} (known: {', '.join(known)})")
        signature, field = _OPTIONS[key]
        if variant.signature != signature:
            raise InvalidArgument(f"option {key!r} must have type {signature!r}")
        value = variant.value
        if key == "match-cgroup":
            fields.setdefault("match", []).extend({"cgroup": glob} for glob in value)
        elif key == "match-uid":
            fields.setdefault("match", []).extend({"uid": uid} for uid in value)
        elif key in ("memory", "cap"):
            fields[field] = value or None
        else:
            fields[field] = value
    return fields


class ManagerInterface(ServiceInterface):
    def __init__(self, service: AdminService) -> None:
        super().__init__(MANAGER_INTERFACE)
        self._service = service
        self._manager = service.manager

    @dbus_property(access=PropertyAccess.READ)
    def Version(self) -> DBusStr:
        return __version__

    @dbus_property(access=PropertyAccess.READ)
    def DefaultTenant(self) -> DBusStr:
        """Empty when openers that match no tenant are refused."""
        return self._manager.default_tenant or ""

    @dbus_method()
    def ListTenants(self) -> TenantList:
        return [[t.name, tenant_path(t.name)] for t in self._manager.tenants]

    @dbus_method()
    def GetTenant(self, name: DBusStr) -> DBusObjectPath:
        with _dbus_errors():
            return tenant_path(self._manager.tenant(name).name)

    @dbus_method()
    def GetGpus(self) -> GpuList:
        used = dict.fromkeys((g.index for g in self._manager.gpus), 0)
        for tenant in self._manager.tenants:
            for usage in self._manager.usage(tenant.name):
                used[usage.gpu] += usage.used
        return [[g.index, g.name, g.total, used[g.index]] for g in self._manager.gpus]

    @dbus_method()
    async def CreateTenant(self, name: DBusStr, options: Options) -> DBusObjectPath:
        await self._service.authorize()
        with _dbus_errors():
            self._manager.create_tenant(name, _fields(options, _OPTIONS))
        return tenant_path(name)

    @dbus_method()
    async def DeleteTenant(self, name: DBusStr) -> NoReply:
        await self._service.authorize()
        with _dbus_errors():
            self._manager.delete_tenant(name)

    @dbus_method()
    async def UpdateTenant(self, name: DBusStr, changes: Options) -> NoReply:
        """Several of memory, weight, cap, priority, limits at once (all or nothing)."""
        await self._service.authorize()
        with _dbus_errors():
            self._manager.update_tenant(name, _fields(changes, _UPDATE_OPTIONS))

    @dbus_method()
    async def SetMemoryLimit(self, name: DBusStr, limit: DBusStr) -> NoReply:
        """limit: 8GiB, 512MiB, 50%, bytes; "" for the whole device."""
        await self._update(name, {"memory": limit or None})

    @dbus_method()
    async def SetWeight(self, name: DBusStr, weight: DBusUInt32) -> NoReply:
        await self._update(name, {"weight": weight})

    @dbus_method()
    async def SetCap(self, name: DBusStr, cap: DBusUInt32) -> NoReply:
        """cap: percent of GPU time, 1..100; 0 removes the cap."""
        await self._update(name, {"cap": cap or None})

    @dbus_method()
    async def SetPriority(self, name: DBusStr, priority: DBusStr) -> NoReply:
        await self._update(name, {"priority": priority})

    @dbus_method()
    async def BindProcess(self, pid: DBusUInt32, name: DBusStr) -> NoReply:
        await self._service.authorize()
        with _dbus_errors():
            self._manager.bind(pid, name)

    @dbus_method()
    async def UnbindProcess(self, pid: DBusUInt32) -> NoReply:
        await self._service.authorize()
        with _dbus_errors():
            self._manager.unbind(pid)

    @dbus_method()
    async def BindCgroup(self, path: DBusStr, name: DBusStr) -> NoReply:
        """path: a cgroup v2 path from the cgroup2 root, as /proc/PID/cgroup's
        "0::" line has it on the host; its processes and those of the cgroups
        below it, forked ones too, belong to the tenant (while that cgroup exists)."""
        await self._service.authorize()
        with _dbus_errors():
            self._manager.bind_cgroup(path, name)

    @dbus_method()
    async def UnbindCgroup(self, path: DBusStr) -> NoReply:
        await self._service.authorize()
        with _dbus_errors():
            self._manager.unbind_cgroup(path)

    @dbus_method()
    async def Reload(self) -> NoReply:
        await self._service.authorize()
        with _dbus_errors():
            self._manager.reload()

    @dbus_property(access=PropertyAccess.READ)
    def Probes(self) -> DBusStr:
        """"on: <attach points>", "loading", or "off: <why>"."""
        probes = self._service.probes
        return probes.status if probes is not None else "off: not part of this daemon"

    @dbus_property(access=PropertyAccess.READ)
    def SchedMode(self) -> GpuText:
        """GPU index -> "runlist", "frame", or "frame (runlist refused: <why>)"."""
        scheduler = self._service.scheduler
        return {} if scheduler is None else scheduler.modes()

    @dbus_method()
    def GetLatency(self, tenant: DBusStr, kind: DBusStr) -> LatencyList:
        """(call kind, histogram, counts by log2 bucket, sum of ns) of the tenant's
        calls of ``kind``."""
        probes = self._service.probes
        if probes is None or not probes.on:
            status = probes.status if probes is not None else "off"
            raise DBusError(ERROR + "ProbesOff", f"latency probes are {status}")
        with _dbus_errors():
            self._service.manager.tenant(tenant)
        hists = probes.latency(tenant, kind)
        return [[call, hist, list(h.counts), h.sum_ns]
                for (call, hist), h in sorted(hists.items())]

    async def _update(self, name: str, changes: Mapping[str, object]) -> None:
        await self._service.authorize()
        with _dbus_errors():
            self._manager.update_tenant(name, changes)

    @dbus_signal()
    def TenantAdded(self, name: str) -> TenantRef:
        return [name, tenant_path(name)]

    @dbus_signal()
    def TenantRemoved(self, name: str) -> TenantRef:
        return [name, tenant_path(name)]

    @dbus_signal()
    def QuotaExceeded(self, denied: Denied) -> QuotaBody:
        """tenant, gpu, requested bytes, used bytes, limit bytes."""
        return [denied.tenant, denied.gpu, denied.size, denied.used, denied.limit]


class TenantInterface(ServiceInterface):
    def __init__(self, manager: Manager, name: str,
                 scheduler: Shares | None = None) -> None:
        super().__init__(TENANT_INTERFACE)
        self._manager = manager
        self._name = name
        self._scheduler = scheduler

    @dbus_property(access=PropertyAccess.READ)
    def Name(self) -> DBusStr:
        return self._name

    @dbus_property(access=PropertyAccess.READ)
    def MemoryLimit(self) -> DBusStr:
        """As set: 8GiB, 50%...; "" means the whole device."""
        memory = self._manager.tenant(self._name).memory
        return "" if memory is None else str(memory)

    @dbus_property(access=PropertyAccess.READ)
    def MemoryLimitBytes(self) -> GpuBytes:
        """GPU index -> bytes the tenant may hold there (0: not allowed on it)."""
        return self._manager.limits(self._name)

    @dbus_property(access=PropertyAccess.READ)
    def MemoryUsed(self) -> GpuBytes:
        """GPU index -> bytes charged or reserved."""
        return {u.gpu: u.used for u in self._manager.usage(self._name)}

    @dbus_property(access=PropertyAccess.READ)
    def Contexts(self) -> DBusUInt32:
        return self._manager.contexts(self._name)

    @dbus_property(access=PropertyAccess.READ)
    def Gpus(self) -> Indexes:
        tenant = self._manager.tenant(self._name)
        return [g.index for g in self._manager.gpus if tenant.allows_gpu(g.index)]

    @dbus_property(access=PropertyAccess.READ)
    def Weight(self) -> DBusUInt32:
        return self._manager.tenant(self._name).weight

    @dbus_property(access=PropertyAccess.READ)
    def Cap(self) -> DBusUInt32:
        """Percent of GPU time; 0: no cap."""
        return self._manager.tenant(self._name).cap or 0

    @dbus_property(access=PropertyAccess.READ)
    def Priority(self) -> DBusStr:
        return str(self._manager.tenant(self._name).priority)

    @dbus_property(access=PropertyAccess.READ)
    def Limits(self) -> ObjectCounts:
        """Object kind -> most objects of it the tenant may hold at once (ObjectLimits)."""
        return self._manager.tenant(self._name).limits.model_dump()

    @dbus_property(access=PropertyAccess.READ)
    def Share(self) -> GpuPercent:
        """GPU index -> percent of GPU time the scheduler targets now (runnable tenants)."""
        return {} if self._scheduler is None else self._scheduler.share(self._name)

    @dbus_property(access=PropertyAccess.READ)
    def MeasuredShare(self) -> GpuPercent:
        """GPU index -> percent of GPU time measured over the last second."""
        return {} if self._scheduler is None else self._scheduler.measured_share(self._name)

    @dbus_property(access=PropertyAccess.READ)
    def Timeslices(self) -> GpuSlices:
        """GPU index -> the timeslices (us) set on the tenant's channel groups
        there (runlist mode), one per group."""
        return {} if self._scheduler is None else self._scheduler.timeslices(self._name)

    @dbus_property(access=PropertyAccess.READ)
    def Preemptions(self) -> GpuCounts:
        """GPU index -> how often the tenant's new work (a priority tenant's)
        preempted the best-effort groups there."""
        return {} if self._scheduler is None else self._scheduler.preemptions(self._name)

    @dbus_property(access=PropertyAccess.READ)
    def Uvm(self) -> DBusStr:
        return str(self._manager.tenant(self._name).uvm)

    @dbus_property(access=PropertyAccess.READ)
    def Match(self) -> Rules:
        """Rules, any of which matches: {"cgroup": s, "uid": u}, all given keys AND."""
        rules = []
        for rule in self._manager.tenant(self._name).match:
            fields = {}
            if rule.cgroup is not None:
                fields["cgroup"] = Variant("s", rule.cgroup)
            if rule.uid is not None:
                fields["uid"] = Variant("u", rule.uid)
            rules.append(fields)
        return rules

    @dbus_property(access=PropertyAccess.READ)
    def Pids(self) -> Indexes:
        """Bound process ids: the config's pids and BindProcess bindings."""
        return list(self._manager.pids(self._name))

    @dbus_property(access=PropertyAccess.READ)
    def Cgroups(self) -> Paths:
        """Bound cgroup paths (BindCgroup), their subtrees included."""
        return list(self._manager.cgroups(self._name))

    def emit(self, properties: set[str]) -> None:
        self.emit_properties_changed({p: getattr(self, p) for p in sorted(properties)})


class AdminService:
    """Exports the manager on a bus and keeps the exported objects current: it
    observes the Manager, the quota policy (refusals) and the scheduler
    (``notify``)."""

    def __init__(self, manager: Manager, bus: MessageBus,
                 scheduler: Shares | None = None, probes: Latency | None = None) -> None:
        self.manager = manager
        self.bus = bus
        self.scheduler = scheduler
        self.probes = probes
        self._interface = ManagerInterface(self)
        self._tenants: dict[str, TenantInterface] = {}
        self._dirty: dict[str, set[str]] = {}
        self._flush_handle: asyncio.TimerHandle | None = None
        self._quota_sent: dict[tuple[str, int], float] = {}

    async def start(self) -> None:
        """Export the objects, then own BUS_NAME (fails if it is taken)."""
        self.bus.add_message_handler(self._note_sender)
        self.bus.export(MANAGER_PATH, self._interface)
        for tenant in self.manager.tenants:
            self._export(tenant.name)
        reply = await self.bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
        if reply not in (RequestNameReply.PRIMARY_OWNER, RequestNameReply.ALREADY_OWNER):
            self.close()
            raise RuntimeError(f"{BUS_NAME} is already owned on the bus ({reply.name})")

    def close(self) -> None:
        """Unexport everything; the caller disconnects the bus."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self.bus.remove_message_handler(self._note_sender)
        self.bus.unexport(MANAGER_PATH)
        for name in list(self._tenants):
            self._unexport(name)

    async def authorize(self) -> None:
        """Raise PermissionDenied unless the current caller may change things."""
        sender = _sender.get()
        caller = None if sender is None else await caller_of(self.bus, sender)
        admin_group = self.manager.config.daemon.admin_group
        if caller is None or not is_admin(caller, admin_group):
            uid = "unknown" if caller is None else caller.uid
            raise DBusError(
                ERROR + "PermissionDenied",
                f"changing vgpud needs root or group {admin_group!r} (caller uid {uid})",
            )

    # --- what it observes: the Manager, the quota policy and the scheduler ---

    def notify(self, event: ManagerEvent | QuotaEvent | SharesChanged) -> None:
        match event:
            case TenantsChanged(added, removed):
                self._tenants_changed(added, removed)
            case TenantChanged(name, fields):
                self._tenant_changed(name, fields)
            case SharesChanged(tenants):
                for name in tenants:
                    self._tenant_changed(name, frozenset({SHARES}))
            case SettingsChanged():
                self._interface.emit_properties_changed(
                    {"DefaultTenant": self.manager.default_tenant or ""})
            case QuotaExceeded(denied):
                self._quota_exceeded(denied)

    def _tenants_changed(self, added: Sequence[str], removed: Sequence[str]) -> None:
        for name in removed:
            self._unexport(name)
            self._dirty.pop(name, None)
            self._quota_sent = {k: t for k, t in self._quota_sent.items() if k[0] != name}
            self._interface.TenantRemoved(name)
        for name in added:
            self._export(name)
            self._interface.TenantAdded(name)

    def _tenant_changed(self, name: str, fields: frozenset[str]) -> None:
        properties = {p for f in fields for p in _PROPERTIES.get(f, ())}
        if properties and name in self._tenants:
            self._dirty.setdefault(name, set()).update(properties)
            if self._flush_handle is None:
                loop = asyncio.get_running_loop()
                self._flush_handle = loop.call_later(FLUSH_DELAY, self._flush)

    def _quota_exceeded(self, denied: Denied) -> None:
        now = asyncio.get_running_loop().time()
        key = (denied.tenant, denied.gpu)
        if key not in self._quota_sent or now - self._quota_sent[key] >= QUOTA_INTERVAL:
            self._quota_sent[key] = now
            self._interface.QuotaExceeded(denied)

    # --- helpers ---

    def _note_sender(self, msg: Message) -> None:
        if msg.message_type == MessageType.METHOD_CALL:
            _sender.set(msg.sender)

    def _export(self, name: str) -> None:
        interface = TenantInterface(self.manager, name, self.scheduler)
        self._tenants[name] = interface
        self.bus.export(tenant_path(name), interface)

    def _unexport(self, name: str) -> None:
        del self._tenants[name]
        self.bus.unexport(tenant_path(name))

    def _flush(self) -> None:
        self._flush_handle = None
        dirty, self._dirty = self._dirty, {}
        for name, properties in dirty.items():
            self._tenants[name].emit(properties)


def introspection_xml() -> str:
    """The documented API (docs/org.vgpud1.xml): both interfaces, no live objects."""
    interfaces = []
    for cls, name in ((ManagerInterface, MANAGER_INTERFACE), (TenantInterface, TENANT_INTERFACE)):
        interface = cls.__new__(cls)  # the members, without a manager behind them
        ServiceInterface.__init__(interface, name)
        interfaces.append(interface.introspect())
    root = Node(None, interfaces=interfaces).to_xml()
    ET.indent(root)
    return _DOCTYPE + ET.tostring(root, encoding="unicode") + "\n"


if __name__ == "__main__":
    sys.stdout.write(introspection_xml())
