"""The file view's event-loop side: publishes snapshots, applies writes,
mounts and runs the FUSE thread.

Snapshots: each Manager or scheduler notification marks its tenants dirty
and schedules one rebuild (call_soon: a burst of upcalls costs one rebuild
of the tenants it touched); the contexts (pid, tgid, uid from the module's
LIST_CONTEXTS, bytes from the ledger) are refreshed at most every
CONTEXTS_INTERVAL while they change. ``dmem.peak`` is the highest
charged + reserved seen at each usage notification; with ``peaks_path`` the
peaks are loaded at start and saved every PEAKS_INTERVAL while they rise and
at stop (vgpud.fsview.peaks), so a daemon restart keeps them.

Writes come from the FUSE thread (run_coroutine_threadsafe) and wait at most
WRITE_TIMEOUT for Manager.update_tenant on the loop: the same validation,
persistence and notifications as D-Bus. The snapshot is rebuilt before the
write returns, so a read after it sees the value.

Mounting: with CAP_SYS_ADMIN libfuse mounts at [fs] mountpoint; without it,
vgpud-fsmount mounts a /dev/fuse descriptor the daemon sends it
(vgpud.fsview.mountfd). Stopping: the FUSE loop can end only from a request,
so stop() flags it and looks up a name in the mount.
"""

from __future__ import annotations

import asyncio
import errno
import grp
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Protocol

import mfusepy

from vgpud.admin.auth import Caller, is_admin
from vgpud.admin.manager import (
    CONTEXTS,
    USAGE,
    AdminError,
    Manager,
    ManagerEvent,
    NoSuchTenant,
    SettingsChanged,
    TenantChanged,
    TenantsChanged,
)
from vgpud.core.ledger import Charged, Ledger
from vgpud.core.shares import SharesChanged
from vgpud.core.tenants import Tenant
from vgpud.fsview.mountfd import (
    HELPER_SOCKET,
    HelperError,
    has_cap_sys_admin,
    open_fuse_device,
    request,
    umount_detach,
)
from vgpud.fsview.ops import FileView
from vgpud.fsview.peaks import load_peaks, save_peaks
from vgpud.fsview.snapshot import ContextView, GpuView, Snapshot, TenantView, device_name
from vgpud.kernel.uapi import Context, Node
from vgpud.store.config import FsSettings

__all__ = ["FsView"]

log = logging.getLogger(__name__)
# mfusepy logs each refused request with its traceback at debug level: a
# user writing bad values would fill the daemon's debug log. Ours say why.
logging.getLogger("fuse").setLevel(logging.INFO)

CONTEXTS_INTERVAL = 1.0  # seconds between context refreshes, while they change
PEAKS_INTERVAL = 5.0  # seconds between saves of risen peaks (a SIGKILL loses these)
WRITE_TIMEOUT = 5.0
MOUNT_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0

ListContexts = Callable[[], Awaitable[Sequence[Context]]]


class Shares(Protocol):
    def share(self, tenant: str) -> dict[int, float]: ...

    def measured_share(self, tenant: str) -> dict[int, float]: ...


def proc_groups(pid: int) -> tuple[int, ...] | None:
    """The supplementary groups of process ``pid`` (None: cannot tell)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return tuple(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return None


class FsView:
    """The file view of ``manager`` (see the module doc). ``bus_ids``: GPU
    index -> PCI bus id, for the dmem region names. ``peaks_path``: where
    the peaks are kept across restarts (None: from this start on)."""

    def __init__(self, manager: Manager, ledger: Ledger, shares: Shares, settings: FsSettings,
                 *, helper_socket: Path = HELPER_SOCKET,
                 bus_ids: Mapping[int, str] | None = None,
                 peaks_path: Path | None = None) -> None:
        self.manager = manager
        self.settings = settings
        self._ledger = ledger
        self._shares = shares
        self._helper_socket = helper_socket
        self._bus_ids = dict(bus_ids or {})
        self.snapshot = Snapshot()
        self._dirty: set[str] | None = None  # None: everything
        self._scheduled = False
        self._peaks: dict[str, tuple[int, ...]] = {}
        self._peaks_path = peaks_path
        self._peaks_saved: dict[str, tuple[int, ...]] = {}
        self._peaks_failing = False
        self._saver: asyncio.Task[None] | None = None
        self._contexts: dict[str, tuple[ContextView, ...]] = {}
        self._contexts_dirty = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._ops: FileView | None = None
        self._fd: int | None = None  # the /dev/fuse descriptor mounted by vgpud-fsmount;
        # libfuse owns it once the FUSE thread runs (it closes it at the end)
        self.mountpoint: Path | None = None  # where it is mounted, once started

    # --- observer ---

    def notify(self, event: ManagerEvent | SharesChanged) -> None:
        match event:
            case TenantChanged(name=name, fields=fields):
                if USAGE in fields:
                    self._bump_peak(name)
                if fields & {USAGE, CONTEXTS}:
                    self._contexts_dirty = True
                self._mark({name})
            case SharesChanged(tenants=tenants):
                self._mark(set(tenants))
            case TenantsChanged() | SettingsChanged():
                self._mark(None)

    # --- lifecycle ---

    async def start(self, list_contexts: ListContexts | None = None) -> bool:
        """Mount and serve; False (logged) when the view cannot be mounted."""
        self._loop = asyncio.get_running_loop()
        if self._peaks_path is not None:
            self._peaks_saved = await asyncio.to_thread(load_peaks, self._peaks_path)
            self._peaks.update(self._peaks_saved)
        self._publish()
        try:
            mountpoint, where = await asyncio.to_thread(self._mount)
        except (OSError, HelperError) as exc:
            log.warning("file view not mounted: %s", exc)
            return False
        ops = FileView(lambda: self.snapshot, self._submit, mfusepy.fuse_get_context,
                       self._authorize, mfusepy.fuse_exit)
        ops.on_init = self._ready.set
        self._ops = ops
        self._thread = threading.Thread(target=self._serve, args=(ops, mountpoint),
                                        name="vgpud-fs", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._ready.wait, MOUNT_TIMEOUT)
        if not self._thread.is_alive():
            log.warning("file view not mounted at %s (see above)", where)
            return False
        self.mountpoint = where
        if list_contexts is not None:
            self._refresher = asyncio.create_task(self._refresh_contexts(list_contexts))
        if self._peaks_path is not None:
            self._saver = asyncio.create_task(self._save_peaks_every(PEAKS_INTERVAL))
        log.info("file view at %s", where)
        return True

    async def stop(self) -> None:
        for task in (self._refresher, self._saver):
            if task is not None:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
        self._refresher = self._saver = None
        await self.save_peaks()
        thread, ops, where = self._thread, self._ops, self.mountpoint
        if thread is None or ops is None:
            return
        ops.stopping = True
        if where is not None:
            await asyncio.to_thread(_poke, where)
        await asyncio.to_thread(thread.join, STOP_TIMEOUT)
        if thread.is_alive():
            log.warning("the file view's FUSE thread did not stop")
        if self._fd is not None:
            self._fd = None  # libfuse closed it with its session
            try:
                await asyncio.to_thread(request, "umount", None, self._helper_socket)
            except HelperError as exc:
                log.warning("file view left mounted (stale): %s", exc)
        elif where is not None and thread.is_alive():
            await asyncio.to_thread(umount_detach, str(where))
        self._thread = self._ops = None
        self.mountpoint = None

    # --- mounting (in a worker thread) ---

    def _mount(self) -> tuple[str, Path]:
        """libfuse's mountpoint argument, and where the view is."""
        where = self.settings.mountpoint
        if has_cap_sys_admin():
            if umount_detach(str(where)):  # first: a dead mount answers ENOTCONN
                log.info("detached a stale mount at %s", where)
            where.mkdir(mode=0o755, parents=True, exist_ok=True)
            return str(where), where
        fd = open_fuse_device()
        try:
            mounted = request("mount", fd, self._helper_socket)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        log.info("no CAP_SYS_ADMIN: vgpud-fsmount mounted the view at %s", mounted)
        return f"/dev/fd/{fd}", Path(mounted)

    def _serve(self, ops: FileView, mountpoint: str) -> None:
        options: dict[str, object] = {"fsname": "vgpud", "subtype": "vgpud"}
        if self._fd is None:
            options.update(allow_other=True, default_permissions=True, noexec=True)
        try:
            mfusepy.FUSE(ops, mountpoint, raw_fi=True, foreground=True, nothreads=True,
                         **options)
        except Exception as exc:
            log.error("file view: %s", exc)
        finally:
            self._ready.set()

    # --- from the FUSE thread ---

    def _submit(self, tenant: str, changes: dict[str, object]) -> None:
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(self._apply(tenant, changes), self._loop)
        try:
            future.result(WRITE_TIMEOUT)
        except TimeoutError:
            future.cancel()
            raise OSError(errno.ETIMEDOUT, "the daemon did not answer") from None
        except NoSuchTenant:
            raise OSError(errno.ENOENT, "no such tenant") from None
        except AdminError as exc:
            log.info("fs: %s of %s refused: %s", ", ".join(changes), tenant, exc)
            raise OSError(errno.EINVAL, str(exc)) from None

    def _authorize(self, uid: int, gid: int, pid: int) -> bool:
        groups = proc_groups(pid)
        caller = Caller(uid, None if groups is None else (gid, *groups))
        return is_admin(caller, self.snapshot.admin_group)

    # --- on the loop ---

    async def _apply(self, tenant: str, changes: dict[str, object]) -> None:
        self.manager.update_tenant(tenant, changes)
        self._mark({tenant})
        self._publish()

    def _mark(self, names: set[str] | None) -> None:
        if names is None or self._dirty is None:
            self._dirty = None
        else:
            self._dirty |= names
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._publish)

    def _publish(self) -> None:
        """Rebuild what is dirty and publish it (one reference assignment)."""
        dirty, self._dirty, self._scheduled = self._dirty, set(), False
        m = self.manager
        if dirty is None:
            gpus = tuple(GpuView(g.index, g.name, g.total,
                                 device_name(g.index, self._bus_ids.get(g.index)))
                         for g in m.gpus)
            group = m.config.daemon.admin_group
            self.snapshot = Snapshot.of(gpus, [self._view(t) for t in m.tenants], group,
                                        _gid(group))
            return
        tenants = dict(self.snapshot.tenants)
        for name in dirty:
            try:
                tenants[name] = self._view(m.tenant(name))
            except NoSuchTenant:
                tenants.pop(name, None)
        order = [t.name for t in m.tenants]
        old = self.snapshot
        self.snapshot = Snapshot.of(old.gpus, [tenants[n] for n in order if n in tenants],
                                    old.admin_group, old.admin_gid)

    def _view(self, tenant: Tenant) -> TenantView:
        usage = self.manager.usage(tenant.name)
        limits = tuple(None if tenant.memory is None and tenant.allows_gpu(u.gpu) else u.limit
                       for u in usage)
        current = tuple(u.used for u in usage)
        return TenantView(
            tenant.name, limits, current, self._bump_peak(tenant.name, current),
            tenant.weight, tenant.cap, str(tenant.priority),
            self._shares.share(tenant.name), self._shares.measured_share(tenant.name),
            self._contexts.get(tenant.name, ()))

    def _bump_peak(self, name: str, current: tuple[int, ...] | None = None) -> tuple[int, ...]:
        if current is None:
            try:
                current = tuple(u.used for u in self.manager.usage(name))
            except NoSuchTenant:
                return ()
        old = self._peaks.get(name)
        peak = current if old is None or len(old) != len(current) else tuple(
            map(max, old, current))
        self._peaks[name] = peak
        return peak

    async def save_peaks(self) -> None:
        """Put the live tenants' peaks on file, when they changed (in a thread)."""
        if self._peaks_path is None or self._loop is None:
            return
        live = {t.name for t in self.manager.tenants}
        peaks = {name: peak for name, peak in self._peaks.items() if name in live}
        if peaks == self._peaks_saved:
            return
        try:
            await asyncio.to_thread(save_peaks, self._peaks_path, peaks)
        except OSError as exc:
            if not self._peaks_failing:  # once, not every PEAKS_INTERVAL
                log.warning("file view: cannot save the peaks in %s: %s", self._peaks_path, exc)
            self._peaks_failing = True
            return
        self._peaks_saved, self._peaks_failing = peaks, False

    async def _save_peaks_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.save_peaks()

    async def _refresh_contexts(self, list_contexts: ListContexts) -> None:
        while True:
            await asyncio.sleep(CONTEXTS_INTERVAL)
            if not self._contexts_dirty:
                continue
            self._contexts_dirty = False
            try:
                live = await list_contexts()
            except Exception as exc:  # the channel's errors: keep the last list
                log.debug("file view: cannot list contexts: %s", exc)
                continue
            self._contexts = context_views(self._ledger, live)
            self._mark(None)


def context_views(ledger: Ledger, live: Sequence[Context]) -> dict[str, tuple[ContextView, ...]]:
    """Each tenant's open contexts, with what the module says of their opener
    and the bytes charged to them (walks every object of the ledger)."""
    charged: dict[int, int] = {}
    for change in ledger.changes():
        if isinstance(change, Charged):
            charged[change.ctx] = charged.get(change.ctx, 0) + change.size
    info = {c.ctx_id: c for c in live}
    out: dict[str, list[ContextView]] = {}
    for ctx, tenant in sorted(ledger.contexts().items()):
        c = info.get(ctx)
        view = ContextView(ctx, None, None, None, None, charged.get(ctx, 0)) if c is None else \
            ContextView(ctx, c.pid, c.tgid, c.uid, c.minor if c.node is Node.GPU else None,
                        charged.get(ctx, 0))
        out.setdefault(tenant, []).append(view)
    return {tenant: tuple(views) for tenant, views in out.items()}


def _gid(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return 0


def _poke(where: Path) -> None:
    """A request to the mount, so that the FUSE loop sees it should stop."""
    with suppress(OSError):
        os.stat(where / f".stop-{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}")
