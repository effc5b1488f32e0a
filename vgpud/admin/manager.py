"""The daemon's admin state: config + runtime state + the ledger's limits.

Every mutation validates first, persists the new runtime state atomically
(save_state), and only then applies it, so a change that fails changes
nothing. Its observers (the D-Bus service, the scheduler, the App) hear what
changed: TenantsChanged, TenantChanged, SettingsChanged and SectionsChanged.

The ledger holds one account per (tenant, GPU) of the inventory; its limit is
what the tenant may hold there (Tenant.limit_for), 0 on GPUs the tenant may
not use. The quota policy opens and closes the ledger's contexts and charges
them; the Manager hears of it as one of the policy's observers
(vgpud.policy.events) and tells its own as TenantChanged.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from pydantic import ValidationError

from vgpud.core.ledger import Ledger, UnknownTenant, Usage
from vgpud.core.observers import Topic
from vgpud.core.tenants import Binding, CgroupBinding, Tenant, validate_name
from vgpud.host import processes
from vgpud.policy.events import ContextClosed, ContextOpened, QuotaEvent, UsageChanged
from vgpud.store.config import Config, ConfigError, describe, load_config
from vgpud.store.state import (
    CHANGEABLE,
    CgroupPathBinding,
    PidBinding,
    RuntimeState,
    save_state,
)

__all__ = [
    "AdminError",
    "Gpu",
    "InvalidArgument",
    "InvalidConfig",
    "Manager",
    "ManagerEvent",
    "NoSuchTenant",
    "SectionsChanged",
    "SettingsChanged",
    "TenantBusy",
    "TenantChanged",
    "TenantsChanged",
    "cgroup2_mount",
]

# Fields create_tenant accepts (pids are bound with bind() instead), and those
# update_tenant changes (the runtime-changeable ones).
CREATE_FIELDS = frozenset({"memory", "match", "gpus", "uvm", "weight", "cap", "priority",
                           "limits"})
UPDATE_FIELDS = CHANGEABLE
# Notification field names besides Tenant's own fields.
USAGE = "usage"
CONTEXTS = "contexts"
BINDINGS = "bindings"

log = logging.getLogger(__name__)

DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup2_mount(mountinfo: Path = Path("/proc/self/mountinfo")) -> Path:
    """Where the host's cgroup2 hierarchy is mounted (its root, "/", mounted):
    /sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid host. The paths the
    module reports are from that root."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return DEFAULT_CGROUP_ROOT
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype = line.split(" - ", 1)[1].split()[0]
        if fstype == "cgroup2" and fields[3] == "/":
            return Path(fields[4])
    return DEFAULT_CGROUP_ROOT


@dataclass(frozen=True, order=True, slots=True)
class Gpu:
    """One device of the inventory."""

    index: int
    name: str
    total: int  # bytes of device memory


class AdminError(Exception):
    """An admin request that failed; nothing was changed."""


class NoSuchTenant(AdminError):
    pass


class InvalidArgument(AdminError):
    pass


class TenantBusy(AdminError):
    """The tenant still has open contexts or memory, so it cannot go away."""


class InvalidConfig(AdminError):
    """Reload found a bad config file; the last good one stays in force."""


@dataclass(frozen=True, slots=True)
class TenantsChanged:
    added: tuple[str, ...]
    removed: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TenantChanged:
    """``fields``: Tenant field names, or USAGE, CONTEXTS, BINDINGS."""

    name: str
    fields: frozenset[str]


@dataclass(frozen=True, slots=True)
class SettingsChanged:
    """The [daemon] section changed (after a reload)."""


@dataclass(frozen=True, slots=True)
class SectionsChanged:
    """Sections other than [daemon] and the tenants changed (a reload):
    names of SERVICE_SECTIONS."""

    names: frozenset[str]


# The config's sections for the daemon's services (vgpud.app applies them).
SERVICE_SECTIONS = ("metrics", "cdi", "fs", "probes")


ManagerEvent = TenantsChanged | TenantChanged | SettingsChanged | SectionsChanged


class Manager:
    def __init__(
        self,
        config_path: Path | str,
        config: Config,
        state: RuntimeState,
        ledger: Ledger,
        gpus: Iterable[tuple[int, str, int]],
        *,
        process_start: Callable[[int], int | None] = processes.start_ticks,
        boot_id: str | None = None,
        cgroup_root: Path | None = None,
    ) -> None:
        """`config` and `state` as loaded at startup; `gpus` the inventory:
        (index, name, total bytes). The state file stays where the startup
        config put it (state_path changes need a restart). `process_start`
        gives a pid's start time (None: no such process), so that a binding
        names one process; `boot_id` is this boot's (host.processes);
        `cgroup_root` where the cgroup2 hierarchy is mounted (cgroup2_mount())."""
        self.config_path = Path(config_path)
        self.state_path = config.daemon.state_path
        self.gpus = tuple(sorted(Gpu(*gpu) for gpu in gpus))
        self.observers: Topic[ManagerEvent] = Topic()
        self._ledger = ledger
        self._config = config
        self._state = state
        self._tenants = state.tenants(config.tenants)
        self._process_start = process_start
        self._boot_id = processes.boot_id() if boot_id is None else boot_id
        self._cgroup_root = cgroup2_mount() if cgroup_root is None else cgroup_root
        self._cgroup_bindings = self._effective_cgroups()
        self._config_bindings = self._bind_config(config)
        self._sync_ledger(())

    # --- reading ---

    @property
    def config(self) -> Config:
        return self._config

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        """The effective tenants, in resolution order."""
        return self._tenants

    @property
    def bindings(self) -> dict[int, Binding]:
        """Bound processes: config pids running when the config was loaded,
        then runtime bindings (which take precedence), to tenants that exist."""
        names = {t.name for t in self._tenants}
        config = {p: b for p, b in self._config_bindings.items() if b.tenant in names}
        return {**config, **self._state.effective_bindings(self._config.tenants, self._boot_id)}

    @property
    def cgroup_bindings(self) -> Mapping[str, CgroupBinding]:
        """Bound cgroups (BindCgroup) of this boot, to tenants that exist, by
        path (kept from one change to the next: resolve() reads it per open)."""
        return self._cgroup_bindings

    def cgroup_id_of(self, path: str) -> int | None:
        """The id (directory inode) of the cgroup now at `path` (from the
        cgroup2 root), None if there is none: what resolve() asks of a bound
        path that an opener is below. One stat of cgroupfs (kernfs, in
        memory), only for an opener below a bound cgroup."""
        try:
            st = os.lstat(self._cgroup_root / path.lstrip("/"))
        except (OSError, ValueError):
            return None
        return st.st_ino if stat.S_ISDIR(st.st_mode) else None

    @property
    def default_tenant(self) -> str | None:
        """The config's default tenant, unless it was deleted at runtime."""
        name = self._config.daemon.default_tenant
        return name if any(t.name == name for t in self._tenants) else None

    def tenant(self, name: str) -> Tenant:
        _check_name(name)
        for tenant in self._tenants:
            if tenant.name == name:
                return tenant
        raise NoSuchTenant(f"no tenant named {name!r}")

    def limits(self, name: str) -> dict[int, int]:
        """Bytes the tenant may hold on each GPU (0 where it may not use it)."""
        return {u.gpu: u.limit for u in self.usage(name)}

    def usage(self, name: str) -> tuple[Usage, ...]:
        """The tenant's account on each GPU of the inventory."""
        self.tenant(name)
        return tuple(self._ledger.usage(name, gpu.index) for gpu in self.gpus)

    def contexts(self, name: str) -> int:
        """Open contexts of the tenant (those restored from the charge journal too)."""
        return sum(1 for tenant in self._ledger.contexts().values() if tenant == name)

    def pids(self, name: str) -> tuple[int, ...]:
        """Process ids bound to the tenant: its config pids and runtime bindings."""
        tenant = self.tenant(name)
        bound = (pid for pid, b in self.bindings.items() if b.tenant == name)
        return tuple(sorted({*tenant.pids, *bound}))

    def cgroups(self, name: str) -> tuple[str, ...]:
        """Cgroup paths bound to the tenant (BindCgroup)."""
        self.tenant(name)
        return tuple(sorted(p for p, b in self._cgroup_bindings.items() if b.tenant == name))

    # --- admin changes ---

    def create_tenant(self, name: str, fields: Mapping[str, object]) -> Tenant:
        """A new tenant from `fields` (CREATE_FIELDS, as in the config file)."""
        _check_name(name)
        if unknown := set(fields) - CREATE_FIELDS:
            raise InvalidArgument(f"unknown tenant fields: {', '.join(sorted(unknown))}")
        try:
            tenant = Tenant.model_validate({"name": name, **fields})
        except ValidationError as e:
            raise _invalid(e) from e
        if any(t.name == name for t in self._tenants):
            raise InvalidArgument(f"tenant {name!r} exists")
        self._commit(self._state.create(self._config.tenants, tenant))
        return tenant

    def delete_tenant(self, name: str) -> None:
        self.tenant(name)
        if name == self._config.daemon.default_tenant:
            raise InvalidArgument(f"{name!r} is the default tenant (daemon.default_tenant)")
        self._commit(self._state.delete(self._config.tenants, name))

    def update_tenant(self, name: str, changes: Mapping[str, object]) -> None:
        """Change UPDATE_FIELDS at once (all or nothing):
        memory: 8GiB, 512MiB, 50%, a byte count, or None (the whole device);
        weight 1..1000; cap 1..100 or None; priority best-effort | priority;
        limits: {kind: count} of the kinds to change (ObjectLimits), the others
        kept. A memory limit below current usage is accepted: it frees
        nothing, new allocations are refused until usage drops below it; so
        does an object limit below the objects held."""
        tenant = self.tenant(name)
        if unknown := set(changes) - UPDATE_FIELDS:
            raise InvalidArgument(f"not changeable at runtime: {', '.join(sorted(unknown))}")
        if not changes:
            raise InvalidArgument("nothing to change")
        if isinstance(limits := changes.get("limits"), Mapping):
            changes = {**changes, "limits": {**tenant.limits.model_dump(), **limits}}
        try:
            tenant.replace(**changes)  # for the message; change() validates too
        except ValidationError as e:
            raise _invalid(e) from e
        self._commit(self._state.change(self._config.tenants, name, **changes))

    def bind(self, pid: int, name: str) -> None:
        """Process `pid` (this process, not a later one given the same pid)
        belongs to `name` for the nodes it opens from now on. Bindings of
        processes that are gone are dropped on the way."""
        self.tenant(name)
        if pid < 1:
            raise InvalidArgument(f"invalid pid {pid}")
        start = self._process_start(pid)
        if start is None:
            raise InvalidArgument(f"no process {pid}")
        gone = {p for p, b in self._state.bindings.items()
                if b.boot_id != self._boot_id or self._process_start(p) != b.start}
        binding = PidBinding(tenant=name, start=start, boot_id=self._boot_id)
        self._commit(self._state.without_bindings(gone).bind(self._config.tenants, pid, binding))

    def unbind(self, pid: int) -> None:
        if pid not in self._state.bindings:
            raise InvalidArgument(f"pid {pid} is not bound")
        self._commit(self._state.unbind(pid))

    def bind_cgroup(self, path: str, name: str) -> None:
        """The processes of the cgroup at `path` (from the cgroup2 root, as
        /proc/PID/cgroup's "0::" line gives it on the host) and of every
        cgroup below it belong to `name` for the nodes they open from now on,
        forked ones too; while that cgroup exists (a new cgroup made later at
        the same path is not bound). Replaces a binding of the same path.
        Contexts already open keep their tenant. Bindings of cgroups that are
        gone are dropped on the way."""
        self.tenant(name)
        _check_cgroup_path(path)
        cgroup_id = self.cgroup_id_of(path)
        if cgroup_id is None:
            raise InvalidArgument(f"no cgroup {path} under {self._cgroup_root}")
        gone = {p for p, b in self._state.cgroup_bindings.items()
                if b.boot_id != self._boot_id or self.cgroup_id_of(p) != b.cgroup_id}
        binding = CgroupPathBinding(tenant=name, cgroup_id=cgroup_id, boot_id=self._boot_id)
        self._commit(self._state.without_cgroups(gone - {path})
                     .bind_cgroup(self._config.tenants, path, binding))

    def unbind_cgroup(self, path: str) -> None:
        if path not in self._state.cgroup_bindings:
            raise InvalidArgument(f"cgroup {path!r} is not bound")
        self._commit(self._state.unbind_cgroup(path))

    def reload(self) -> None:
        """Re-read the config file. On any error the last good config stays."""
        try:
            config = load_config(self.config_path)
        except ConfigError as e:
            raise InvalidConfig(str(e)) from e
        self._commit(self._state, config)

    # --- what the quota policy tells (vgpud.policy.events) ---

    def notify(self, event: QuotaEvent, /) -> None:
        """The policy moved a tenant's contexts or bytes: its observers hear
        TenantChanged (a refusal is the policy's own observers' to hear)."""
        match event:
            case ContextOpened(tenant=tenant):
                self._notify(tenant, {CONTEXTS})
            case ContextClosed(tenant=tenant):
                self._notify(tenant, {CONTEXTS, USAGE})
            case UsageChanged(tenant):
                self._notify(tenant, {USAGE})

    # --- helpers ---

    def _commit(self, state: RuntimeState, config: Config | None = None) -> None:
        """Validate, persist, apply, notify; raise before anything changed."""
        config = config or self._config
        tenants = state.tenants(config.tenants)
        old = {t.name: t for t in self._tenants}
        new = {t.name: t for t in tenants}
        for name in old.keys() - new.keys():
            self._check_idle(name)
        if state is not self._state:
            try:
                save_state(state, self.state_path)
            except OSError as e:
                raise AdminError(f"cannot save {self.state_path}: {e}") from e
        old_bindings, old_config = self.bindings, self._config
        old_cgroups = set(self._cgroup_bindings.values())
        if config is not self._config:
            self._config_bindings = self._bind_config(config)
        self._config, self._state, self._tenants = config, state, tenants
        self._cgroup_bindings = self._effective_cgroups()
        self._sync_ledger(old.keys() - new.keys())
        added = tuple(n for n in new if n not in old)
        removed = tuple(n for n in old if n not in new)
        if added or removed:
            self.observers.notify(TenantsChanged(added, removed))
        bindings = self.bindings
        moved = {p for p in old_bindings.keys() | bindings.keys()
                 if old_bindings.get(p) != bindings.get(p)}
        rebound = {b.tenant for p in moved for b in (old_bindings.get(p), bindings.get(p))
                   if b is not None}
        rebound |= {b.tenant for b in old_cgroups ^ set(self._cgroup_bindings.values())}
        for name in (n for n in new if n in old):
            fields = _diff(old[name], new[name])
            if name in rebound:
                fields.add(BINDINGS)
            self._notify(name, fields)
        if config.daemon != old_config.daemon:
            self.observers.notify(SettingsChanged())
        sections = frozenset(n for n in SERVICE_SECTIONS
                             if getattr(config, n) != getattr(old_config, n))
        if sections:
            self.observers.notify(SectionsChanged(sections))

    def _effective_cgroups(self) -> Mapping[str, CgroupBinding]:
        bindings = self._state.effective_cgroup_bindings(self._config.tenants, self._boot_id)
        return MappingProxyType({b.path: b for b in bindings})

    def _bind_config(self, config: Config) -> dict[int, Binding]:
        """The config's pids, bound to the processes running now."""
        out: dict[int, Binding] = {}
        for tenant in config.tenants:
            for pid in tenant.pids:
                start = self._process_start(pid)
                if start is None:
                    log.warning("config: pid %d of tenant %s is not running: not bound",
                                pid, tenant.name)
                else:
                    out[pid] = Binding(tenant.name, start)
        return out

    def _check_idle(self, name: str) -> None:
        contexts = self.contexts(name)
        used = sum(u.used for u in self._ledger.snapshot() if u.tenant == name)
        if contexts or used:
            raise TenantBusy(
                f"tenant {name!r} is in use ({contexts} open contexts, {used} bytes)"
            )

    def _sync_ledger(self, removed: Iterable[str]) -> None:
        for name in removed:
            with suppress(UnknownTenant):  # no accounts without GPUs
                self._ledger.remove_tenant(name)
        for tenant in self._tenants:
            for gpu in self.gpus:
                limit = tenant.limit_for(gpu.index, gpu.total)
                self._ledger.set_limit(tenant.name, gpu.index, 0 if limit is None else limit)

    def _notify(self, name: str, fields: set[str]) -> None:
        if fields:
            self.observers.notify(TenantChanged(name, frozenset(fields)))


def _check_name(name: str) -> None:
    try:
        validate_name(name)
    except ValueError as e:
        raise InvalidArgument(str(e)) from e


def _check_cgroup_path(path: str) -> None:
    """An absolute, normalized path below the cgroup2 root."""
    if (not isinstance(path, str) or not path.startswith("/") or path == "/"
            or "\0" in path or os.path.normpath(path) != path or path.startswith("//")
            or any(part in (".", "..") for part in path.split("/"))):
        raise InvalidArgument(
            f"invalid cgroup path {path!r}: an absolute, normalized path below the "
            "cgroup2 root, as /proc/PID/cgroup's 0:: line gives it (not / itself)")


def _invalid(error: ValidationError) -> InvalidArgument:
    key, problem = describe(error)
    return InvalidArgument(f"{key}: {problem}" if key else problem)


def _diff(old: Tenant, new: Tenant) -> set[str]:
    return {f for f in Tenant.model_fields if getattr(old, f) != getattr(new, f)}
