"""The composition root: every part of the quota daemon is made and wired here.

``build_quota`` reads the config and the runtime state, takes the GPU
inventory and makes, in this order: the Ledger; the Manager over it; the
GroupTracker; the journal, which replays into both what the previous daemon
left; the QuotaPolicy, and the SchedPolicy over it (the policy the Dispatcher
gets); the SchedulerService. Then it makes the subscriptions, each visible
below (vgpud.core.observers: subjects never subscribe anyone):

    Ledger       -> journal              (first: on file before anyone acts)
    GroupTracker -> journal, scheduler
    QuotaPolicy  -> Manager              (contexts and usage, told on as TenantChanged),
                    D-Bus service, metrics' DeniedCounts ([metrics] enabled)
    Manager      -> scheduler, App (a reload's changed sections),
                    D-Bus service, CDI spec keeper, file view
    scheduler    -> D-Bus service, file view  (shares)

The D-Bus service's, and the CDI spec keeper's (vgpud.cdi: its hook calls
the D-Bus API), are made when it starts. ``App`` runs what the upcall
path does not: the D-Bus service, then (``serve``) the services of
``App.services`` in their declared order: the scheduler's actuation, the
latency probes (vgpud.probes), the metrics and the file view, stopped in
reverse (``stop``); and SIGHUP reloads. vgpud.daemon.Daemon calls it at each
step of its lifecycle.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dbus_fast import BusType
from dbus_fast.aio import MessageBus

from vgpud.admin.dbus import BUS_NAME, AdminService
from vgpud.admin.manager import AdminError, Manager, ManagerEvent, SectionsChanged
from vgpud.cdi.files import SpecFile, this_hook
from vgpud.cdi.keeper import SpecKeeper
from vgpud.core.groups import GroupTracker
from vgpud.core.ledger import Ledger
from vgpud.core.observers import Observer, Topic
from vgpud.fsview.peaks import PEAKS_FILE
from vgpud.host.cgroups import CgroupPaths
from vgpud.host.inventory import GpuInfo, discover
from vgpud.kernel.channel import ChannelError, GenlChannel
from vgpud.kernel.codec import DecodeError
from vgpud.policy.quota import QuotaPolicy
from vgpud.policy.sched import SchedPolicy
from vgpud.probes.service import ProbeService
from vgpud.sched.activity import choose_source
from vgpud.sched.actuator import ModuleActuator
from vgpud.sched.service import SchedulerService
from vgpud.store.config import DEFAULT_CONFIG_PATH, ConfigError, MetricsSettings, load_config
from vgpud.store.journal import ChargeAndGroupJournal
from vgpud.store.state import StateError, load_state

if TYPE_CHECKING:
    from vgpud.fsview.service import FsView
    from vgpud.metrics.service import MetricsService
    from vgpud.metrics.sources import DeniedCounts
    from vgpud.policy.dispatch import Dispatcher

__all__ = ["App", "Service", "StartupError", "build_quota"]

log = logging.getLogger("vgpud")

E = TypeVar("E")


class StartupError(Exception):
    """Config, state or inventory that the daemon cannot start with (EX_CONFIG)."""


@dataclass(frozen=True, slots=True)
class Service:
    """One service around the upcall path: how it starts and how it stops."""

    name: str
    start: Callable[[], Awaitable[None]]
    stop: Callable[[], Awaitable[None]]


class Subscriptions:
    """The subscriptions made here, so that they can be undone."""

    def __init__(self) -> None:
        self._made: list[tuple[Topic[Any], Observer[Any]]] = []

    def add(self, topic: Topic[E], observer: Observer[E]) -> None:
        topic.subscribe(observer)
        self._made.append((topic, observer))

    def drop(self, observer: object) -> None:
        """Undo the subscriptions of ``observer``."""
        for topic, made in self._made:
            if made is observer:
                topic.unsubscribe(made)
        self._made = [(t, o) for t, o in self._made if o is not observer]

    def clear(self) -> None:
        for topic, observer in reversed(self._made):
            topic.unsubscribe(observer)
        self._made = []


def build_quota(config_path: Path | None = None, dbus: str = "try",
                inventory: Callable[[], list[GpuInfo]] = discover, *, probes: bool = True,
                fs: bool = True, probes_helper: Path | None = None,
                metrics_helper: Path | None = None) -> tuple[SchedPolicy, App]:
    """The quota daemon's policy and the App around it (see the module doc);
    StartupError on a bad config or state file. ``probes`` False: no latency
    probes, whatever the config says (--no-probes); ``fs`` False: no file
    view (--no-fs); ``probes_helper``: load them in vgpud-probes over this
    socket, whatever the config says (--probes-helper); ``metrics_helper``:
    serve the metrics from vgpud-metrics on this socket (--metrics-helper)."""
    config_path = config_path or DEFAULT_CONFIG_PATH
    try:
        config = load_config(config_path)
        state = load_state(config.daemon.state_path)
    except (ConfigError, StateError) as exc:
        raise StartupError(str(exc)) from exc
    gpus = inventory()
    if not gpus:
        log.warning("no GPUs in the inventory: every charged allocation will be refused")
    ledger = Ledger()
    manager = Manager(config_path, config, state, ledger,
                      [(gpu.number, gpu.name, gpu.total) for gpu in gpus])
    log.info("config %s: %d tenants, %d GPUs", config_path, len(manager.tenants), len(gpus))
    tracker = GroupTracker()
    journal = ChargeAndGroupJournal.resume(config.daemon.charges_path, ledger, groups=tracker)
    cgroups = CgroupPaths()
    quota = QuotaPolicy(manager, ledger, cgroup_path=cgroups)
    policy = SchedPolicy(quota, tracker)
    activity = (choose_source([gpu.index for gpu in manager.gpus])
                if manager.config.daemon.sched_activity == "auto" else None)
    scheduler = SchedulerService(manager, tracker, activity=activity)
    probe_service = ProbeService(quota.context_tenant,
                                 closed_tenant=quota.closed_context_tenant,
                                 enabled=probes and config.probes.enabled,
                                 interval=config.probes.interval_ms / 1000,
                                 helper=probes_helper or config.probes.helper)
    app = App(manager, quota, tracker, scheduler, journal=journal, dbus=dbus, cgroups=cgroups,
              probes=probe_service, cdi=_spec_keeper(manager), inventory=tuple(gpus),
              fs=fs and config.fs.enabled, metrics_helper=metrics_helper)
    subs = app.subscriptions
    if journal is not None:
        subs.add(ledger.observers, journal)
        subs.add(tracker.observers, journal)
    subs.add(tracker.observers, scheduler)
    subs.add(quota.observers, manager)
    subs.add(manager.observers, scheduler)
    subs.add(manager.observers, app)
    if config.metrics.enabled:
        # Before READY=1, not when the metrics start: imports take seconds in a
        # slow guest, which upcalls must not wait for (a reload that turns the
        # metrics on imports them on the loop, once).
        app.count_denied()
    return policy, app


def _spec_keeper(manager: Manager) -> SpecKeeper | None:
    """The CDI spec's keeper when [cdi] is enabled (not started)."""
    settings = manager.config.cdi
    if not settings.enabled:
        return None
    try:
        return SpecKeeper(manager, SpecFile(settings.spec_dir), this_hook())
    except OSError as exc:
        log.error("CDI: no spec for container runtimes: %s", exc)
        return None


class App:
    """The quota daemon's parts beyond the upcall path: the Manager served on
    D-Bus, the TDMA scheduler, the journal.

    ``dbus``: "off" (--no-dbus), "try" (an unreachable bus is a warning) or
    "require" (--require-dbus: the daemon does not start without it).
    """

    def __init__(self, manager: Manager, quota: QuotaPolicy, tracker: GroupTracker,
                 scheduler: SchedulerService, *, journal: ChargeAndGroupJournal | None = None,
                 dbus: str = "try", cgroups: CgroupPaths | None = None,
                 probes: ProbeService | None = None, cdi: SpecKeeper | None = None,
                 inventory: tuple[GpuInfo, ...] = (), fs: bool = False,
                 metrics_helper: Path | None = None) -> None:
        """``cgroups``: the paths the quota policy looks up for contexts opened
        before this daemon, found at ``attach``. ``probes``: the latency probes,
        started once the daemon is registered. ``cdi``: the CDI spec's keeper,
        started with the admin API, which its hook calls. ``inventory``: the
        GPUs' UUIDs and bus ids, for the views. ``fs``: mount the file view
        (vgpud.fsview) with the channel. ``metrics_helper``: vgpud-metrics'
        socket (--metrics-helper), over [metrics] helper."""
        self.manager = manager
        self.quota = quota
        self.tracker = tracker
        self.scheduler = scheduler
        self.journal = journal
        self.dbus = dbus
        self.cgroups = cgroups
        self.probes = probes or ProbeService(quota.context_tenant, enabled=False)
        self.subscriptions = Subscriptions()
        self.service: AdminService | None = None
        self.metrics: MetricsService | None = None  # started with the channel
        self.denied: DeniedCounts | None = None  # made when [metrics] is first enabled
        # What the metrics serve from (set when they may start) and the
        # settings they were started with: a reload compares against these.
        self._metrics_from: tuple[Dispatcher, GenlChannel] | None = None
        self._metrics_settings: MetricsSettings | None = None
        self._metrics_lock = asyncio.Lock()
        self._reconfigure: asyncio.Task[None] | None = None
        self.metrics_helper = metrics_helper
        self.cdi = cdi
        self.fs_wanted = fs
        self.fs: FsView | None = None
        self.inventory = inventory
        self._bus: MessageBus | None = None
        self._running: list[Service] = []  # started by serve(), in order

    async def start(self) -> bool:
        """Serve the admin API (org.vgpud1) on the system bus; False (logged)
        when it cannot and is required."""
        if self.dbus == "off":
            log.info("admin API off (--no-dbus)")
            return True
        bus = None
        try:
            bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
            service = AdminService(self.manager, bus, self.scheduler, self.probes)
            await service.start()
        except Exception as exc:
            if bus is not None:
                bus.disconnect()
            text = f"admin API {BUS_NAME} not available on the system bus: {exc}"
            if self.dbus == "require":
                log.error("%s", text)
                return False
            log.warning("%s; running without it", text)
            return True
        self._bus, self.service = bus, service
        self.subscriptions.add(self.quota.observers, service)
        self.subscriptions.add(self.manager.observers, service)
        self.subscriptions.add(self.scheduler.observers, service)
        log.info("admin API %s on the system bus", BUS_NAME)
        if self.cdi is not None:
            self.cdi.start()
            self.subscriptions.add(self.manager.observers, self.cdi)
        return True

    async def attach(self, channel: GenlChannel) -> None:
        """Registered: find the cgroup paths of the contexts opened before this
        daemon (in a worker thread: the loop never walks the cgroup tree), and
        drop the restored charges and groups of contexts closed while no
        daemon ran."""
        if not self.quota.restored and self.cgroups is None:
            return
        try:
            live = await channel.list_contexts()
        except (ChannelError, DecodeError) as exc:
            log.warning("cannot list the live contexts (%s): every restored charge is kept "
                        "until its context closes; contexts opened before this daemon "
                        "resolve without their cgroup path", exc)
            return
        if self.cgroups is not None:
            await self.cgroups.prefetch(
                c.cgroup_id for c in live if c.ctx_id not in self.quota.restored)
        if self.quota.restored:
            for ctx in self.quota.reconcile(live):
                self.tracker.closed(ctx)

    def services(self, dispatcher: Dispatcher, channel: GenlChannel) -> tuple[Service, ...]:
        """The services around the upcall path, in the order they start (once
        READY=1 is sent); they stop in reverse, while the channel is up."""
        return (
            # Groups back on at the stop, while the module can still be told.
            Service("scheduler", lambda: self._start_scheduling(channel),
                    self._stop_scheduling),
            # Loaded in the background; stopped so that vgpu is not pinned past the stop.
            Service("probes", self._start_probes, self.probes.stop),
            # Their refresh asks the channel: stopped before it closes.
            Service("metrics", lambda: self.start_metrics(dispatcher, channel),
                    self._stop_metrics_for_good),
            Service("file view", lambda: self.start_fs(channel), self.stop_fs),
        )

    async def serve(self, dispatcher: Dispatcher, channel: GenlChannel) -> None:
        """Start the services, in order."""
        for service in self.services(dispatcher, channel):
            self._running.append(service)
            await service.start()

    async def stop(self) -> None:
        """Stop the services started, in reverse (again: a no-op)."""
        while self._running:
            service = self._running.pop()
            log.debug("stopping the %s", service.name)
            await service.stop()

    async def _start_scheduling(self, channel: GenlChannel) -> None:
        self.scheduler.start(ModuleActuator(channel))

    async def _start_probes(self) -> None:
        """Load the latency probes in the background (or say why not)."""
        self.probes.start()

    def count_denied(self) -> DeniedCounts:
        """The metrics' count of refused allocations, from now on."""
        if self.denied is None:
            from vgpud.metrics.sources import DeniedCounts

            self.denied = DeniedCounts()
            self.subscriptions.add(self.quota.observers, self.denied)
        return self.denied

    async def start_metrics(self, dispatcher: Dispatcher, channel: GenlChannel) -> None:
        """Serve the Prometheus metrics when [metrics] is enabled (vgpud.metrics),
        now and after each reload that changes that section; an address that
        cannot be bound is logged, and the daemon goes on."""
        self._metrics_from = (dispatcher, channel)
        await self._apply_metrics()

    async def _apply_metrics(self) -> None:
        """Bring the running metrics in line with the config's [metrics]."""
        async with self._metrics_lock:
            settings = self.manager.config.metrics
            if self._metrics_from is None or settings == self._metrics_settings:
                return
            await self.stop_metrics()
            self._metrics_settings = settings
            if not settings.enabled:
                return
            from vgpud.metrics.listen import parse_listen
            from vgpud.metrics.service import MetricsService
            from vgpud.metrics.sources import snapshot_source

            dispatcher, channel = self._metrics_from
            uuids = {gpu.number: gpu.uuid for gpu in self.inventory if gpu.uuid}
            source = snapshot_source(self.manager, self.quota.ledger, self.scheduler,
                                     dispatcher, channel.stats, self.count_denied(), uuids)
            metrics = MetricsService(*parse_listen(settings.listen), source,
                                     channel.get_counters,
                                     helper=self.metrics_helper or settings.helper)
            if metrics.start():
                self.metrics = metrics

    async def start_fs(self, channel: GenlChannel) -> None:
        """Mount the file view at [fs] mountpoint; one that cannot be mounted
        is logged, and the daemon goes on."""
        if not self.fs_wanted:
            return
        # Here, not at the top: mfusepy loads libfuse, which --no-fs need not.
        # In a worker thread: the import takes seconds in a slow guest, and the
        # loop is answering upcalls by now.
        try:
            module = await asyncio.to_thread(importlib.import_module, "vgpud.fsview.service")
        except (ImportError, OSError) as exc:  # mfusepy raises OSError without libfuse
            log.error("file view not mounted: %s (Debian: apt-get install libfuse3-3)", exc)
            return
        bus_ids = {gpu.number: gpu.bus_id for gpu in self.inventory if gpu.bus_id}
        peaks = self.manager.config.daemon.charges_path.parent / PEAKS_FILE
        fs = module.FsView(self.manager, self.quota.ledger, self.scheduler,
                           self.manager.config.fs, bus_ids=bus_ids, peaks_path=peaks)
        self.subscriptions.add(self.manager.observers, fs)
        self.subscriptions.add(self.scheduler.observers, fs)
        if await fs.start(channel.list_contexts):
            self.fs = fs
        else:
            self.subscriptions.drop(fs)

    async def stop_fs(self) -> None:
        fs, self.fs = self.fs, None
        if fs is not None:
            self.subscriptions.drop(fs)
            await fs.stop()

    async def stop_metrics(self) -> None:
        """Stop serving them (a reload's restart of them included)."""
        metrics, self.metrics = self.metrics, None
        if metrics is not None:
            await metrics.stop()

    async def _stop_metrics_for_good(self) -> None:
        """Wait out a reload's restart of the metrics, let none start, stop them."""
        self._metrics_from = None
        if self._reconfigure is not None:
            await asyncio.wait([self._reconfigure])
        await self.stop_metrics()

    async def _stop_scheduling(self) -> None:
        """Stop deciding and turn the groups back on (the channel still up)."""
        self.subscriptions.drop(self.scheduler)
        await self.scheduler.stop()

    def reload(self) -> None:
        """SIGHUP: re-read the config; a bad one keeps the last good one."""
        try:
            self.manager.reload()
        except AdminError as exc:
            log.error("reload failed, keeping the last good config: %s", exc)
            return
        log.info("reloaded %s: %d tenants", self.manager.config_path,
                 len(self.manager.tenants))

    def notify(self, event: ManagerEvent, /) -> None:
        """A reload (SIGHUP or D-Bus Reload) changed these sections: [metrics]
        and [cdi] are restarted; [fs] and [probes] take a restart of the
        daemon, which the log says. (Tenants and [daemon] are the Manager's
        other observers'.)"""
        if not isinstance(event, SectionsChanged):
            return
        for name in sorted(event.names & {"fs", "probes"}):
            log.warning("reload: [%s] changed: it applies at the next restart "
                        "(systemctl restart vgpud)", name)
        if "cdi" in event.names:
            self._restart_cdi()
        if "metrics" in event.names:
            self._reconfigure = asyncio.get_running_loop().create_task(self._apply_metrics())

    def _restart_cdi(self) -> None:
        """The spec's keeper for the reloaded [cdi]: the old spec removed, the
        new one written (when the admin API runs, as at start)."""
        if self.cdi is not None:
            self.subscriptions.drop(self.cdi)
            self.cdi.stop()
        self.cdi = _spec_keeper(self.manager)
        if self.cdi is not None and self.service is not None:
            self.cdi.start()
            self.subscriptions.add(self.manager.observers, self.cdi)

    def close(self) -> None:
        self.subscriptions.clear()
        if self.cdi is not None:
            self.cdi.stop()
        if self.service is not None:
            self.service.close()
            self.service = None
        if self._bus is not None:
            self._bus.disconnect()
            self._bus = None
        if self.journal is not None:
            self.journal.close()
            self.journal = None
