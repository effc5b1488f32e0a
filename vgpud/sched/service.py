"""SchedulerService: the asyncio adapter around one TdmaScheduler per GPU.

Inputs, each turned into core events at the current time:
- the GroupTracker's events (it observes the tracker): GroupCreated /
  GroupFreed, a group its owner paused counting as freed until it is resumed;
- the Manager's events (it observes the Manager): TenantAdded / TenantRemoved, and
  Weight/Cap/PriorityChanged, from D-Bus changes and reloads alike (the core
  stages them: they apply at its next frame);
- the activity source, polled: Runnable / Idle per tenant per GPU (without a
  source, a tenant is runnable on a GPU while it has a group there);
- a timer per GPU at the core's next deadline: Tick.
Each plan the core returns (outgoing GroupsOff before incoming GroupsOn)
becomes one actuator call with the entries in that order. Calls go out in the
order of the decisions (tasks start in creation order, and a call sends its
request before its first await).

Every tenant of the Manager is in every GPU's core; a tenant with no group on
a GPU is never runnable there. A group learned before ``start`` (the channel
is not up yet) is switched when it starts; so are the groups the tracker
already holds when the service is made (a restarted daemon's, from the charge
journal), each as if just created, or turned off for good if paused.
``stop`` turns every known group on again (but those their owners paused),
so that tenants do not stay switched off without a daemon.
Shares are published to ``observers`` (SharesChanged) at most once per
SHARE_INTERVAL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from vgpud.admin.manager import (
    Manager,
    ManagerEvent,
    QuotaExceeded,
    SettingsChanged,
    TenantChanged,
    TenantsChanged,
)
from vgpud.core.groups import (
    Group,
    GroupEvent,
    GroupForgotten,
    GroupLearned,
    GroupPauseChanged,
    GroupTracker,
)
from vgpud.core.observers import Topic
from vgpud.core.shares import SharesChanged, target_shares
from vgpud.core.tdma import (
    MIN_SLOT_US,
    Action,
    CapChanged,
    Event,
    GroupCreated,
    GroupFreed,
    GroupsOn,
    Idle,
    PriorityChanged,
    Runnable,
    TdmaConfig,
    TdmaScheduler,
    TenantAdded,
    TenantRemoved,
    Tick,
    WeightChanged,
)
from vgpud.core.tenants import Priority, Tenant
from vgpud.kernel.uapi import Sched, SchedState
from vgpud.sched.activity import Activity, ActivitySource
from vgpud.sched.actuator import Actuator

__all__ = ["SchedStats", "SchedulerService"]

log = logging.getLogger(__name__)

SHARE_INTERVAL = 1.0  # seconds between share updates
STOP_TIMEOUT = 2.0
KEEP_SAMPLES = 100_000  # the latest latency samples kept for the stats
_SCHED_FIELDS = frozenset({"weight", "cap", "priority"})


class CallLater(Protocol):
    """loop.call_later, or a test's virtual timers."""

    def __call__(self, delay: float, callback: Callable[[_Gpu], None], gpu: _Gpu, /
                 ) -> asyncio.TimerHandle: ...


@dataclass(slots=True)
class SchedStats:
    switches: int = 0  # plans with an incoming or outgoing tenant
    entries: int = 0
    rejected: int = 0  # events the core refused (logged)
    polls: int = 0
    latency_ns: deque[int] = field(default_factory=lambda: deque(maxlen=KEEP_SAMPLES))
    lateness_ns: deque[int] = field(default_factory=lambda: deque(maxlen=KEEP_SAMPLES))
    # latency: decision -> call answered; lateness: deadline -> timer ran

    def summary(self) -> dict[str, object]:
        return {"switches": self.switches, "entries": self.entries, "rejected": self.rejected,
                "polls": self.polls, "latency_us": _percentiles(self.latency_ns),
                "lateness_us": _percentiles(self.lateness_ns)}


@dataclass(slots=True)
class _Gpu:
    index: int
    core: TdmaScheduler
    groups: dict[str, int] = field(default_factory=dict)  # tenant -> live groups here
    runnable: set[str] = field(default_factory=set)  # as told to the core
    timer: asyncio.TimerHandle | None = None
    deadline_us: int | None = None


class SchedulerService:
    def __init__(
        self,
        manager: Manager,
        tracker: GroupTracker,
        *,
        activity: ActivitySource | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        call_later: CallLater | None = None,
        share_interval: float = SHARE_INTERVAL,
    ) -> None:
        """``clock`` (ns) and ``call_later`` (the running loop's by default) are
        what tests replace to run the service in virtual time."""
        self.manager = manager
        self.tracker = tracker
        self.activity = activity
        self.config = _config(manager.config.daemon.frame_ms)
        self.stats = SchedStats()
        self.observers: Topic[SharesChanged] = Topic()
        self._clock = clock
        self._call_later = call_later
        self._share_interval = share_interval
        self._t0 = clock()
        self._last_us = 0
        self._gpus: dict[int, _Gpu] = {}
        self._groups: dict[int, Group] = {}  # group id -> group, as the cores know them
        self._tenants: dict[str, Tenant] = {t.name: t for t in manager.tenants}
        self._actuator: Actuator | None = None
        self._backlog: list[tuple[list[Sched], int]] = []
        self._inflight: set[asyncio.Task[None]] = set()
        self._runner: asyncio.Task[None] | None = None  # the polling and share loops
        self._busy: Mapping[tuple[int, str], int] = {}
        self._busy_prev: tuple[int, Mapping[tuple[int, str], int]] | None = None
        self._shares: dict[str, dict[int, float]] = {}
        self._measured: dict[str, dict[int, float]] = {}
        for gpu in manager.gpus:
            self._gpu(gpu.index)
        for group in tracker:  # restored: the module turned back on those left off
            if tracker.paused(group):
                self._paused(group, True)
            else:
                self._schedule(group)

    # --- lifecycle ---

    def start(self, actuator: Actuator) -> None:
        """Actuate from now on (on the running loop); poll and publish shares."""
        self._actuator = actuator
        backlog, self._backlog = self._backlog, []
        for entries, decided in backlog:
            self._send(entries, decided)
        if self._call_later is None:
            self._call_later = asyncio.get_running_loop().call_later
        self._runner = asyncio.create_task(self._run())
        for gpu in self._gpus.values():
            self._arm(gpu, self._now())
        log.info("scheduler: %d GPUs, frame %d us, min slot %d us, activity %s",
                 len(self._gpus), self.config.frame_us, self.config.min_slot_us,
                 self.activity.name if self.activity else "none")

    async def stop(self) -> None:
        """Stop deciding; turn every group on again; log the figures."""
        actuator, self._actuator = self._actuator, None  # no timer is armed from here
        for gpu in self._gpus.values():
            if gpu.timer is not None:
                gpu.timer.cancel()
                gpu.timer = None
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.cancel()
            await asyncio.wait([runner])
        if self.activity is not None:
            self.activity.close()
        if actuator is None:
            return
        entries = [Sched(g.ctx, g.client, g.handle, True) for g in self.tracker
                   if not self.tracker.paused(g)]
        try:
            async with asyncio.timeout(STOP_TIMEOUT):
                if self._inflight:
                    await asyncio.wait(self._inflight)
                if entries:
                    await actuator.apply(entries)
        except TimeoutError:
            log.warning("scheduler: groups not all switched back on at stop")
        log.info("scheduler stats %s", {**self.stats.summary(),
                                         "actuator": actuator.stats.counts()})

    # --- reading (the admin API) ---

    def share(self, tenant: str) -> dict[int, float]:
        """GPU -> the share of GPU time (percent) the scheduler targets now."""
        return dict(self._shares.get(tenant, {}))

    def measured_share(self, tenant: str) -> dict[int, float]:
        """GPU -> the share of GPU time (percent) measured over the last interval."""
        return dict(self._measured.get(tenant, {}))

    def running(self) -> dict[int, str | None]:
        return {i: gpu.core.running for i, gpu in self._gpus.items()}

    def gpu_time_ns(self) -> dict[tuple[int, str], int] | None:
        """(GPU, tenant) -> GPU time the activity source measured since it
        started (as of its last poll); None without a source."""
        return None if self.activity is None else dict(self._busy)

    # --- what it observes: the GroupTracker and the Manager ---

    def notify(self, event: GroupEvent | ManagerEvent) -> None:
        match event:
            case GroupLearned(group):
                self._schedule(group)
            case GroupForgotten(group):
                self._unschedule(group)
            case GroupPauseChanged(group, paused):
                self._paused(group, paused)
            case TenantsChanged(added, removed):
                self._tenants_changed(added, removed)
            case TenantChanged(name, fields):
                self._tenant_changed(name, fields)
            case SettingsChanged():
                self._settings_changed()
            case QuotaExceeded():
                pass

    def _paused(self, group: Group, paused: bool) -> None:
        if paused:  # off for good first: whatever unscheduling it plans comes after
            self._submit([Sched(group.ctx, group.client, group.handle, SchedState.OWNER_OFF)])
            self._unschedule(group)
        else:
            self._schedule(group)

    def _schedule(self, group: Group) -> None:
        gpu = self._gpu(group.gpu)
        if group.tenant not in self._tenants:  # made off by the module: on, unscheduled
            log.warning("scheduler: group %#x of unknown tenant %s left on, unscheduled",
                        group.handle, group.tenant)
            self._submit([Sched(group.ctx, group.client, group.handle, SchedState.ON)])
            return
        self._groups[group.id] = group
        gpu.groups[group.tenant] = gpu.groups.get(group.tenant, 0) + 1
        if self.activity is None:  # runnable first: a group picked at once is never off
            self._set_runnable(gpu, group.tenant, True)
        self._handle(gpu, GroupCreated(group.tenant, group.id))

    def _unschedule(self, group: Group) -> None:
        if self._groups.pop(group.id, None) is None:
            return
        gpu = self._gpus[group.gpu]
        self._handle(gpu, GroupFreed(group.tenant, group.id))
        left = gpu.groups[group.tenant] - 1
        if left:
            gpu.groups[group.tenant] = left
        else:
            del gpu.groups[group.tenant]
            self._set_runnable(gpu, group.tenant, False)

    def _tenants_changed(self, added: Sequence[str], removed: Sequence[str]) -> None:
        tenants = {t.name: t for t in self.manager.tenants}
        for name in removed:  # the Manager removes no tenant with open contexts
            self._tenants.pop(name, None)
            self._groups = {i: g for i, g in self._groups.items() if g.tenant != name}
            for gpu in self._gpus.values():
                gpu.runnable.discard(name)
                gpu.groups.pop(name, None)
                self._handle(gpu, TenantRemoved(name))
        for name in added:
            tenant = tenants[name]
            self._tenants[name] = tenant
            for gpu in self._gpus.values():
                self._handle(gpu, self._added(tenant))

    def _tenant_changed(self, name: str, fields: frozenset[str]) -> None:
        if not fields & _SCHED_FIELDS or name not in self._tenants:
            return
        tenant = self.manager.tenant(name)
        self._tenants[name] = tenant
        events: list[Event] = []
        if "weight" in fields:
            events.append(WeightChanged(name, tenant.weight))
        if "cap" in fields:
            events.append(CapChanged(name, self._cap(tenant, warn=True)))
        if "priority" in fields:
            events.append(PriorityChanged(name, tenant.priority is Priority.PRIORITY))
        for gpu in self._gpus.values():
            for event in events:
                self._handle(gpu, event)

    def _settings_changed(self) -> None:
        frame_us = self.manager.config.daemon.frame_ms * 1000
        if frame_us != self.config.frame_us:
            log.warning("scheduler: frame_ms changes apply at the next start (now %d us)",
                        self.config.frame_us)

    # --- the cores ---

    def _gpu(self, index: int) -> _Gpu:
        gpu = self._gpus.get(index)
        if gpu is None:
            gpu = self._gpus[index] = _Gpu(index, TdmaScheduler(self.config))
            for tenant in self._tenants.values():
                self._handle(gpu, self._added(tenant))
        return gpu

    def _added(self, tenant: Tenant) -> TenantAdded:
        return TenantAdded(tenant.name, tenant.weight, self._cap(tenant, warn=True),
                           tenant.priority is Priority.PRIORITY)

    def _cap(self, tenant: Tenant, *, warn: bool = False) -> int | None:
        """The tenant's cap, raised to what one min slot per frame needs."""
        cap = tenant.cap
        low = self.config.cap_floor
        if cap is None or cap >= low:
            return cap
        if warn:
            log.warning("scheduler: cap %d%% of %s raised to %d%% (one min slot per frame)",
                        cap, tenant.name, low)
        return low

    def _now(self) -> int:
        now = max(self._last_us, (self._clock() - self._t0) // 1000)
        self._last_us = now
        return now

    def _set_runnable(self, gpu: _Gpu, tenant: str, runnable: bool) -> None:
        if runnable == (tenant in gpu.runnable):
            return
        if runnable:
            gpu.runnable.add(tenant)
            self._handle(gpu, Runnable(tenant))
        else:
            gpu.runnable.discard(tenant)
            self._handle(gpu, Idle(tenant))

    def _handle(self, gpu: _Gpu, event: Event) -> None:
        now = self._now()
        try:
            actions = gpu.core.handle(event, now)
        except ValueError as exc:
            self.stats.rejected += 1
            log.warning("scheduler: GPU %d refused %s: %s", gpu.index, event, exc)
            return
        if actions:
            self._actuate(actions)
        self._arm(gpu, now)

    def _tick(self, gpu: _Gpu) -> None:
        gpu.timer = None
        deadline = gpu.deadline_us
        now = self._now()
        if deadline is None:
            return
        if now < deadline:  # the loop's timers are coarse (uvloop: 1 ms): not yet
            self._arm(gpu, now)
            return
        self.stats.lateness_ns.append((now - deadline) * 1000)
        self._handle(gpu, Tick())

    def _arm(self, gpu: _Gpu, now: int) -> None:
        deadline = gpu.core.next_deadline()
        if deadline == gpu.deadline_us and gpu.timer is not None:
            return
        if gpu.timer is not None:
            gpu.timer.cancel()
            gpu.timer = None
        gpu.deadline_us = deadline
        if deadline is None or self._actuator is None or self._call_later is None:
            return
        # Whole milliseconds, rounded up: the loop's timers may fire early otherwise.
        delay = -(-max(deadline - now, 0) // 1000) / 1000
        gpu.timer = self._call_later(delay, self._tick, gpu)

    def _actuate(self, actions: list[Action]) -> None:
        entries = []
        for action in actions:
            on = isinstance(action, GroupsOn)
            for gid in action.groups:
                group = self._groups.get(gid)
                if group is not None:
                    entries.append(Sched(group.ctx, group.client, group.handle, on))
        if entries:
            self.stats.switches += 1
            self._submit(entries)

    def _submit(self, entries: list[Sched]) -> None:
        self.stats.entries += len(entries)
        decided = self._clock()
        if self._actuator is None:
            self._backlog.append((entries, decided))
        else:
            self._send(entries, decided)

    def _send(self, entries: list[Sched], decided: int) -> None:
        task = asyncio.get_running_loop().create_task(self._apply(entries, decided))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _apply(self, entries: list[Sched], decided: int) -> None:
        actuator = self._actuator
        if actuator is None:
            return
        await actuator.apply(entries)
        self.stats.latency_ns.append(self._clock() - decided)

    # --- activity and shares ---

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as loops:
                if self.activity is not None:
                    loops.create_task(self._poll_loop(self.activity))
                loops.create_task(self._share_loop())
        except Exception:
            log.exception("scheduler: polling stopped")

    async def _poll_loop(self, source: ActivitySource) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(source.interval)

    async def poll(self) -> None:
        """Poll the activity source once; Runnable / Idle where it changed."""
        source = self.activity
        if source is None:
            return
        try:
            if source.blocking:
                raw = await asyncio.to_thread(source.read)
            else:
                raw = source.read()
            activity = source.update(raw, self.tracker, self.running(), self._clock())
        except Exception:
            log.exception("scheduler: activity source %s failed", source.name)
            return
        self.stats.polls += 1
        self._apply_activity(activity)

    def _apply_activity(self, activity: Activity) -> None:
        self._busy = activity.busy_ns
        runnable = activity.runnable
        for gpu in self._gpus.values():
            for tenant in list(gpu.runnable):
                if (gpu.index, tenant) not in runnable:
                    self._set_runnable(gpu, tenant, False)
            for tenant in gpu.groups:
                if (gpu.index, tenant) in runnable:
                    self._set_runnable(gpu, tenant, True)

    async def _share_loop(self) -> None:
        while True:
            self.publish_shares()
            await asyncio.sleep(self._share_interval)

    def publish_shares(self) -> None:
        """Recompute target and measured shares; tell listeners whose changed."""
        shares: dict[str, dict[int, float]] = {}
        for gpu in self._gpus.values():
            entitled = {t: (self._tenants[t].weight, self._cap(self._tenants[t]))
                        for t in gpu.runnable if t in self._tenants}
            for tenant, share in target_shares(entitled).items():
                shares.setdefault(tenant, {})[gpu.index] = round(share, 1)
        now, busy = self._clock(), dict(self._busy)
        measured: dict[str, dict[int, float]] = {}
        if self._busy_prev is not None and self.activity is not None:
            then, before = self._busy_prev
            elapsed = now - then
            if elapsed > 0:
                for (gpu_index, tenant), value in busy.items():
                    used = value - before.get((gpu_index, tenant), 0)
                    measured.setdefault(tenant, {})[gpu_index] = round(
                        100 * max(used, 0) / elapsed, 1)
        self._busy_prev = (now, busy)
        changed = {t for t in shares.keys() | self._shares.keys()
                   if shares.get(t) != self._shares.get(t)}
        changed |= {t for t in measured.keys() | self._measured.keys()
                    if measured.get(t) != self._measured.get(t)}
        self._shares, self._measured = shares, measured
        changed &= self._tenants.keys()
        if changed:
            self.observers.notify(SharesChanged(tuple(sorted(changed))))


def _config(frame_ms: int) -> TdmaConfig:
    frame_us = frame_ms * 1000
    if frame_us < MIN_SLOT_US:
        log.warning("scheduler: frame_ms=%d is shorter than one min slot; using %d us",
                    frame_ms, MIN_SLOT_US)
        frame_us = MIN_SLOT_US
    return TdmaConfig(frame_us=frame_us, min_slot_us=MIN_SLOT_US)


def _percentiles(samples_ns: Sequence[int]) -> dict[str, float]:
    if not samples_ns:
        return {}
    ordered = sorted(samples_ns)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000  # noqa: E731
    return {"n": len(ordered), "p50": pick(0.5), "p99": pick(0.99), "max": ordered[-1] / 1000}
