"""SchedulerService: the asyncio adapter around one scheduling core per GPU.

Each GPU runs in one of two modes (vgpud.sched.modes; ``[daemon] sched_mode``):
``runlist`` (a RunlistPlanner sets the channel groups' timeslices and the GPU's
round robin switches) or ``frame`` (a TdmaScheduler turns tenants on and off in
frames). A GPU whose driver refuses a TIMESLICE entry falls back to ``frame``
for good, with one log line; ``modes()`` says so.

Inputs, each turned into core events at the current time:
- the GroupTracker's events (it observes the tracker): GroupCreated /
  GroupFreed, a group its owner paused counting as freed until it is resumed;
- the Manager's events (it observes the Manager): TenantAdded / TenantRemoved, and
  Weight/Cap/PriorityChanged, from D-Bus changes and reloads alike (the frame
  core stages them until its next frame, the planner applies them at once);
- the activity source, polled: Runnable / Idle per tenant per GPU (without a
  source, a tenant is runnable on a GPU while it has a group there); in
  runlist mode Submitted / Idle instead, and each poll's busy time as a
  BusySample. Without a source the planner gets neither (it needs none: the
  hardware skips groups without work), and priority tenants are planned by
  their weights alone. Without a priority tenant, runlist mode polls at most
  every RUNLIST_POLL seconds: its feedback windows span 128 rounds (a quarter
  of a second at the least) and the shares are published once a second, and
  each poll costs CPU per tenant;
- a timer per GPU at the core's next deadline: Tick.
Each plan the core returns (GroupsOff, SetTimeslice/SetInterleave, GroupsOn, Preempt)
becomes one actuator call with the entries in that order. Calls go out in the
order of the decisions (tasks start in creation order, and a call sends its
request before its first await).

Every tenant of the Manager is in every GPU's core; a tenant with no group on
a GPU is never runnable there. A group learned before ``start`` (the channel
is not up yet) is switched when it starts; so are the groups the tracker
already holds when the service is made (a restarted daemon's, from the charge
journal), each as if just created, or turned off for good if paused.
``stop`` turns every known group on again (but those their owners paused),
so that tenants do not stay switched off without a daemon, and on a GPU in
runlist mode first gives every group the driver's default timeslice back (and
the priority tenants' groups the default interleave level). A driver that
refuses interleave levels (the daemon lacks CAP_SYS_NICE) is logged once per
GPU; the mode stays.
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
from vgpud.core.runlist import (
    LEVEL_HIGH,
    Action,
    BusySample,
    Event,
    Preempt,
    RunlistPlanner,
    SetInterleave,
    SetTimeslice,
    Submitted,
)
from vgpud.core.shares import SharesChanged, target_shares
from vgpud.core.tdma import (
    CapChanged,
    GroupCreated,
    GroupFreed,
    Idle,
    PriorityChanged,
    Runnable,
    TdmaScheduler,
    TenantAdded,
    TenantRemoved,
    Tick,
    WeightChanged,
)
from vgpud.core.tenants import Priority, Tenant
from vgpud.kernel.uapi import Sched, SchedResult, SchedState
from vgpud.sched.activity import Activity, ActivitySource
from vgpud.sched.actuator import Actuator
from vgpud.sched.modes import (
    FRAME,
    RUNLIST,
    Core,
    Mode,
    describe,
    frame_config,
    refusal,
    restore_entries,
    runlist_config,
    to_entries,
)

__all__ = ["SchedActuator", "SchedStats", "SchedulerService"]

log = logging.getLogger(__name__)

SHARE_INTERVAL = 1.0  # seconds between share updates
RUNLIST_POLL = 0.5  # seconds between polls in runlist mode while no tenant is priority
STOP_TIMEOUT = 2.0
KEEP_SAMPLES = 100_000  # the latest latency samples kept for the stats
_SCHED_FIELDS = frozenset({"weight", "cap", "priority"})
CHECKED_OPS = (SchedState.TIMESLICE, SchedState.INTERLEAVE)  # results read, not only counted


class CallLater(Protocol):
    """loop.call_later, or a test's virtual timers."""

    def __call__(self, delay: float, callback: Callable[[_Gpu], None], gpu: _Gpu, /
                 ) -> asyncio.TimerHandle: ...


class SchedActuator(Actuator, Protocol):
    """An actuator that answers each entry's result (ModuleActuator)."""

    async def run(self, entries: Sequence[Sched]) -> list[SchedResult | None]: ...


@dataclass(slots=True)
class SchedStats:
    switches: int = 0  # plans with an incoming or outgoing tenant
    entries: int = 0
    rejected: int = 0  # events the core refused (logged)
    polls: int = 0
    timeslices: int = 0  # TIMESLICE entries decided
    preempts: int = 0  # PREEMPT entries decided
    latency_ns: deque[int] = field(default_factory=lambda: deque(maxlen=KEEP_SAMPLES))
    lateness_ns: deque[int] = field(default_factory=lambda: deque(maxlen=KEEP_SAMPLES))
    # latency: decision -> call answered; lateness: deadline -> timer ran

    def summary(self) -> dict[str, object]:
        return {"switches": self.switches, "entries": self.entries, "rejected": self.rejected,
                "polls": self.polls, "timeslices": self.timeslices, "preempts": self.preempts,
                "latency_us": _percentiles(self.latency_ns),
                "lateness_us": _percentiles(self.lateness_ns)}


@dataclass(slots=True)
class _Gpu:
    index: int
    mode: Mode
    core: Core
    refused: str | None = None  # why runlist mode was given up here
    no_interleave: str | None = None  # why the driver refused an interleave level
    groups: dict[str, int] = field(default_factory=dict)  # tenant -> live groups here
    runnable: set[str] = field(default_factory=set)  # as told to the core
    preempts: dict[str, int] = field(default_factory=dict)  # tenant -> preemptions it caused
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
        daemon = manager.config.daemon
        self.mode: Mode = daemon.sched_mode
        self.config = frame_config(daemon.frame_ms)
        self.runlist_config = runlist_config(daemon.frame_ms)
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
        self._actuator: SchedActuator | None = None
        self._backlog: list[tuple[list[Sched], int, _Gpu | None]] = []
        self._inflight: set[asyncio.Task[None]] = set()
        self._runner: asyncio.Task[None] | None = None  # the polling and share loops
        self._busy: Mapping[tuple[int, str], int] = {}
        self._busy_prev: tuple[int, Mapping[tuple[int, str], int]] | None = None
        self._shares: dict[str, dict[int, float]] = {}
        self._measured: dict[str, dict[int, float]] = {}
        self._published: dict[str, tuple[dict[int, list[int]], dict[int, int]]] = {}
        for gpu in manager.gpus:
            self._gpu(gpu.index)
        for group in tracker:  # restored: the module turned back on those left off
            if tracker.paused(group):
                self._paused(group, True)
            else:
                self._schedule(group)

    # --- lifecycle ---

    def start(self, actuator: SchedActuator) -> None:
        """Actuate from now on (on the running loop); poll and publish shares."""
        self._actuator = actuator
        backlog, self._backlog = self._backlog, []
        for entries, decided, gpu in backlog:
            self._send(entries, decided, gpu)
        if self._call_later is None:
            self._call_later = asyncio.get_running_loop().call_later
        self._runner = asyncio.create_task(self._run())
        for gpu in self._gpus.values():
            self._arm(gpu, self._now())
        if self.mode == RUNLIST:
            log.info("scheduler: %d GPUs, runlist mode (base timeslice %d us, caps' frame "
                     "%d us), activity %s", len(self._gpus), self.runlist_config.base_slice_us,
                     self.runlist_config.frame_us,
                     self.activity.name if self.activity else "none")
        else:
            log.info("scheduler: %d GPUs, frame mode (frame %d us, min slot %d us), "
                     "activity %s", len(self._gpus), self.config.frame_us,
                     self.config.min_slot_us, self.activity.name if self.activity else "none")

    async def stop(self) -> None:
        """Stop deciding; give groups the default timeslice back (runlist mode)
        and turn every group on again; log the figures."""
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
        runlist = {i for i, gpu in self._gpus.items() if gpu.mode == RUNLIST}
        entries = restore_entries((g for g in self.tracker if g.gpu in runlist),
                                  (g for g in self.tracker if self._raised(g)))
        entries += [Sched(g.ctx, g.client, g.handle, True) for g in self.tracker
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

    def modes(self) -> dict[int, str]:
        """GPU -> its mode: "runlist", "frame", or "frame (runlist refused: why)"."""
        return {i: describe(gpu.mode, gpu.refused) for i, gpu in self._gpus.items()}

    def timeslices(self, tenant: str) -> dict[int, list[int]]:
        """GPU -> the timeslices (us) last set on the tenant's groups there, in
        group order (runlist mode only)."""
        out: dict[int, list[int]] = {}
        for i, gpu in self._gpus.items():
            if isinstance(gpu.core, RunlistPlanner) and (
                    slices := gpu.core.tenant_timeslices(tenant)):
                out[i] = slices
        return out

    def preemptions(self, tenant: str) -> dict[int, int]:
        """GPU -> the times the tenant's new work preempted the best-effort groups."""
        return {i: gpu.preempts[tenant] for i, gpu in self._gpus.items()
                if tenant in gpu.preempts}

    def running(self) -> dict[int, str | None]:
        """GPU -> the tenant switched on (frame mode); None in runlist mode."""
        return {i: gpu.core.running if isinstance(gpu.core, TdmaScheduler) else None
                for i, gpu in self._gpus.items()}

    def switched_on(self) -> dict[int, frozenset[str]]:
        """GPU -> the tenants whose groups are on (what an activity source can see run)."""
        out: dict[int, frozenset[str]] = {}
        for i, gpu in self._gpus.items():
            core = gpu.core
            if isinstance(core, TdmaScheduler):
                out[i] = frozenset() if core.running is None else frozenset((core.running,))
            else:
                out[i] = core.switched_on()
        return out

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
                gpu.preempts.pop(name, None)
                self._handle(gpu, TenantRemoved(name))
        for name in added:
            tenant = tenants[name]
            self._tenants[name] = tenant
            for gpu in self._gpus.values():
                self._handle(gpu, self._added(tenant, gpu))

    def _tenant_changed(self, name: str, fields: frozenset[str]) -> None:
        if not fields & _SCHED_FIELDS or name not in self._tenants:
            return
        tenant = self.manager.tenant(name)
        self._tenants[name] = tenant
        for gpu in self._gpus.values():
            if "weight" in fields:
                self._handle(gpu, WeightChanged(name, tenant.weight))
            if "cap" in fields:
                self._handle(gpu, CapChanged(name, self._cap(tenant, gpu, warn=True)))
            if "priority" in fields:
                self._handle(gpu, PriorityChanged(name, tenant.priority is Priority.PRIORITY))

    def _settings_changed(self) -> None:
        daemon = self.manager.config.daemon
        if daemon.frame_ms * 1000 != self.config.frame_us or daemon.sched_mode != self.mode:
            log.warning("scheduler: frame_ms and sched_mode changes apply at the next start "
                        "(now %d ms, %s)", self.config.frame_us // 1000, self.mode)

    # --- the cores ---

    def _gpu(self, index: int) -> _Gpu:
        gpu = self._gpus.get(index)
        if gpu is None:
            core: Core = (RunlistPlanner(self.runlist_config) if self.mode == RUNLIST
                          else TdmaScheduler(self.config))
            gpu = self._gpus[index] = _Gpu(index, self.mode, core)
            for tenant in self._tenants.values():
                self._handle(gpu, self._added(tenant, gpu))
        return gpu

    def _added(self, tenant: Tenant, gpu: _Gpu) -> TenantAdded:
        return TenantAdded(tenant.name, tenant.weight, self._cap(tenant, gpu, warn=True),
                           tenant.priority is Priority.PRIORITY)

    def _cap(self, tenant: Tenant, gpu: _Gpu, *, warn: bool = False) -> int | None:
        """The tenant's cap, raised to the least the GPU's core can keep."""
        cap = tenant.cap
        low = gpu.core.config.cap_floor
        if cap is None or cap >= low:
            return cap
        if warn:
            log.warning("scheduler: cap %d%% of %s raised to %d%% on GPU %d (the least its "
                        "%s mode keeps)", cap, tenant.name, low, gpu.index, gpu.mode)
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
        else:
            gpu.runnable.discard(tenant)
        if gpu.mode == FRAME:
            self._handle(gpu, Runnable(tenant) if runnable else Idle(tenant))
        elif self.activity is not None:  # no source: the planner needs no signal
            self._handle(gpu, Submitted(tenant) if runnable else Idle(tenant))

    def _handle(self, gpu: _Gpu, event: Event) -> None:
        now = self._now()
        try:
            actions: Sequence[Action]
            if isinstance(gpu.core, RunlistPlanner):
                actions = gpu.core.handle(event, now)
            elif isinstance(event, BusySample | Submitted):
                actions = []  # the frame core needs neither
            else:
                actions = gpu.core.handle(event, now)
        except ValueError as exc:
            self.stats.rejected += 1
            log.warning("scheduler: GPU %d refused %s: %s", gpu.index, event, exc)
            return
        if actions:
            if isinstance(event, Submitted) and any(isinstance(a, Preempt) for a in actions):
                gpu.preempts[event.tenant] = gpu.preempts.get(event.tenant, 0) + 1
            self._actuate(gpu, actions)
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

    def _actuate(self, gpu: _Gpu, actions: Sequence[Action]) -> None:
        entries = to_entries(actions, self._groups)
        if not entries:
            return
        if any(not isinstance(a, SetTimeslice | SetInterleave | Preempt) for a in actions):
            self.stats.switches += 1
        self.stats.timeslices += sum(e.enable == SchedState.TIMESLICE for e in entries)
        self.stats.preempts += sum(e.enable == SchedState.PREEMPT for e in entries)
        self._submit(entries, gpu)

    def _submit(self, entries: list[Sched], gpu: _Gpu | None = None) -> None:
        """Send ``entries`` (one call); ``gpu``: check its TIMESLICE entries' results."""
        self.stats.entries += len(entries)
        decided = self._clock()
        if self._actuator is None:
            self._backlog.append((entries, decided, gpu))
        else:
            self._send(entries, decided, gpu)

    def _send(self, entries: list[Sched], decided: int, gpu: _Gpu | None) -> None:
        task = asyncio.get_running_loop().create_task(self._apply(entries, decided, gpu))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _apply(self, entries: list[Sched], decided: int, gpu: _Gpu | None) -> None:
        actuator = self._actuator
        if actuator is None:
            return
        if gpu is None or not any(e.enable in CHECKED_OPS for e in entries):
            await actuator.apply(entries)
        else:
            results = await actuator.run(entries)
            if (why := refusal(entries, results)) is not None:
                self._fall_back(gpu, why)
            if gpu.no_interleave is None and (
                    why := refusal(entries, results, SchedState.INTERLEAVE)) is not None:
                gpu.no_interleave = why
                log.warning("scheduler: GPU %d: the driver refused an interleave level (%s): "
                            "a priority tenant's wait is bounded by the best-effort round, "
                            "not by one slice (the daemon needs CAP_SYS_NICE)", gpu.index, why)
        self.stats.latency_ns.append(self._clock() - decided)

    def _raised(self, group: Group) -> bool:
        """Whether the group was given the HIGH interleave level."""
        gpu = self._gpus.get(group.gpu)
        if gpu is None or not isinstance(gpu.core, RunlistPlanner):
            return False
        return gpu.core.levels().get((group.tenant, group.id)) == LEVEL_HIGH

    def _fall_back(self, gpu: _Gpu, why: str) -> None:
        """Frame mode on this GPU for good: a new TdmaScheduler told all it must know."""
        if gpu.mode == FRAME or self._actuator is None:
            return
        log.warning("scheduler: GPU %d: the driver refused a timeslice (%s); frame mode "
                    "from now on", gpu.index, why)
        gpu.mode, gpu.refused = FRAME, why
        gpu.core = TdmaScheduler(self.config)
        if gpu.timer is not None:
            gpu.timer.cancel()
            gpu.timer = None
        gpu.deadline_us = None
        for tenant in self._tenants.values():
            self._handle(gpu, self._added(tenant, gpu))
        for name in sorted(gpu.runnable):
            self._handle(gpu, Runnable(name))
        for group in list(self._groups.values()):
            if group.gpu == gpu.index:
                self._handle(gpu, GroupCreated(group.tenant, group.id))

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
            await asyncio.sleep(self._poll_interval(source))

    def _poll_interval(self, source: ActivitySource) -> float:
        """The source's interval; longer in runlist mode while no tenant is priority
        (then only the feedback and the shares read it)."""
        if any(gpu.mode == FRAME for gpu in self._gpus.values()) or any(
                t.priority is Priority.PRIORITY for t in self._tenants.values()):
            return source.interval
        return max(source.interval, RUNLIST_POLL)

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
            activity = source.update(raw, self.tracker, self.switched_on(), self._clock())
        except Exception:
            log.exception("scheduler: activity source %s failed", source.name)
            return
        self.stats.polls += 1
        self._apply_activity(activity)

    def _apply_activity(self, activity: Activity) -> None:
        self._busy = activity.busy_ns
        runnable = activity.runnable
        for gpu in self._gpus.values():
            if gpu.mode == RUNLIST:  # measured first: a wake-up may close its window
                busy = {tenant: ns // 1000 for (index, tenant), ns in self._busy.items()
                        if index == gpu.index and tenant in self._tenants}
                self._handle(gpu, BusySample(busy))
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
        """Recompute target and measured shares; tell listeners whose changed (or
        whose timeslices or preemptions did)."""
        shares: dict[str, dict[int, float]] = {}
        for gpu in self._gpus.values():
            entitled = {t: (self._tenants[t].weight, self._cap(self._tenants[t], gpu))
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
        published = {t: (self.timeslices(t), self.preemptions(t)) for t in self._tenants}
        changed |= {t for t, now_ in published.items()
                    if now_ != self._published.get(t, ({}, {}))}
        self._published = published
        changed &= self._tenants.keys()
        if changed:
            self.observers.notify(SharesChanged(tuple(sorted(changed))))


def _percentiles(samples_ns: Sequence[int]) -> dict[str, float]:
    if not samples_ns:
        return {}
    ordered = sorted(samples_ns)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000  # noqa: E731
    return {"n": len(ordered), "p50": pick(0.5), "p99": pick(0.99), "max": ordered[-1] / 1000}
