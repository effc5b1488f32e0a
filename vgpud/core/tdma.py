"""TDMA time-slice scheduler for one GPU (sans-I/O).

The daemon feeds events and the current time in microseconds, and performs the
returned actions in order; it wakes the scheduler again at `next_deadline()`:

    actions = sched.handle(Runnable("a"), now_us)   # or sched.tick(now_us)
    for action in actions: ...                      # GroupsOff / GroupsOn
    sleep_until(sched.next_deadline())              # None: nothing is due

A tenant is switched by turning its channel groups (TSGs) off and on. Every
plan lists the outgoing tenant's GroupsOff before the incoming GroupsOn. A
new group gets its tenant's state at once: GroupsOn while the tenant is
running, else GroupsOff. (The module makes new groups off, and the driver
schedules a new TSG by default: the explicit state is right after either.)

Algorithm: deficit round robin (DRR) over a ring of tenants sorted by id.
Frames are fixed wall-clock windows of `frame_us` from the first call. The
pointer walks the ring from the last tenant chosen; each runnable tenant with
weight > 0 that it visits earns a quantum of frame_us * weight / W, W being
the weight of the tenants runnable at that visit (an integer, with the
remainder carried while W is unchanged, so steady shares are exact). A tenant
whose deficit reaches `min_slot_us` runs for all of it; one below keeps it and
is passed over, so a small share means fewer, longer slots, never slots under
the minimum. An idle tenant forfeits its positive deficit, so its share goes to
the runnable ones by weight (work-conserving); a tenant that goes idle mid-slot
ends the slot. Time a slot runs past its planned end (a late wake-up: the
daemon descheduled, a busy host) is the tenant's debt, paid back from the part
of its later slots above one min slot: lateness delays no turn, and costs no
share while a tenant's turns run late by less than its quantum minus one min
slot on average (beyond, its turns keep their min slot and it runs more than
its share). Charged to the deficit instead, a wake-up late by L would keep the
tenant from its turns for L * W / (w * F) ring visits.

Caps: a capped tenant runs at most cap% of each frame: its slots end at its
budget and never cross a frame boundary, and once the budget is spent (less
than a min slot left) it forfeits its positive deficit and waits for the next
frame; that time goes to the others, or is left idle if nobody else can run.
Priority: a priority tenant that becomes runnable preempts a best-effort slot
at the next switch, which is after that slot's first min slot, borrowing at
most one min slot from its future share (it must have a deficit >= 0), so
shares and the starvation bound still hold. Weight, cap and priority changes
are staged and take effect at the next frame boundary.

Starvation bound. Let n be the number of runnable tenants with weight > 0, W
their total weight, F the frame and M the min slot, and k_i =
ceil(M * W / (w_i * F)) the number of ring visits tenant i needs to reach M.
If the runnable set and weights stay unchanged, tenant i starts a slot within
k_i * F + (n - 1) * M of the end of its previous slot, and within
(k_i + 1) * F + n * M of becoming runnable, plus the lateness of the slots
in between (debts do not count). With every share >= M (k_i = 1), deficits
carry nothing and a saturating tenant waits under one frame between its
slots. Example: 64 equal tenants, F = 50 ms, M = 2048 us: k = 3, slots of
3 quanta (2343 us), one turn every 150 ms. A capped tenant may also wait for
the next frame; each priority tenant can add one min slot per ring cycle.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

MAX_WEIGHT = 1_000_000
MIN_SLOT_US = 2_048  # two of the driver's default TSG time slices


@dataclass(frozen=True, slots=True)
class TdmaConfig:
    """Frame length and minimum slot, in microseconds.

    The minimum slot is at least two hardware time slices (the driver's TSG
    time slice, 1024 us by default), so a tenant switched on runs a little.
    """

    frame_us: int = 50_000
    min_slot_us: int = MIN_SLOT_US
    hw_timeslice_us: int = 1_024

    def __post_init__(self) -> None:
        for name in ("frame_us", "min_slot_us", "hw_timeslice_us"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.min_slot_us < 2 * self.hw_timeslice_us:
            raise ValueError(
                f"min_slot_us={self.min_slot_us} is shorter than two hardware time slices "
                f"({2 * self.hw_timeslice_us} us)"
            )
        if self.frame_us < self.min_slot_us:
            raise ValueError(f"frame_us={self.frame_us} is shorter than min_slot_us")

    @property
    def cap_floor(self) -> int:
        """The lowest cap (percent) that leaves one min slot per frame."""
        return -(-100 * self.min_slot_us // self.frame_us)


# --- events ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TenantAdded:
    """A new tenant, idle and without groups; `cap` is a percentage of each frame."""

    tenant: str
    weight: int = 1
    cap: int | None = None
    priority: bool = False


@dataclass(frozen=True, slots=True)
class TenantRemoved:
    tenant: str


@dataclass(frozen=True, slots=True)
class Runnable:
    tenant: str


@dataclass(frozen=True, slots=True)
class Idle:
    tenant: str


@dataclass(frozen=True, slots=True)
class WeightChanged:
    tenant: str
    weight: int


@dataclass(frozen=True, slots=True)
class CapChanged:
    tenant: str
    cap: int | None


@dataclass(frozen=True, slots=True)
class PriorityChanged:
    tenant: str
    priority: bool


@dataclass(frozen=True, slots=True)
class GroupCreated:
    tenant: str
    group: int


@dataclass(frozen=True, slots=True)
class GroupFreed:
    tenant: str
    group: int


@dataclass(frozen=True, slots=True)
class Tick:
    """Time passed; nothing else happened."""


TenantEvent = (
    TenantAdded
    | TenantRemoved
    | Runnable
    | Idle
    | WeightChanged
    | CapChanged
    | PriorityChanged
    | GroupCreated
    | GroupFreed
)
Event = TenantEvent | Tick


# --- actions ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupsOff:
    tenant: str
    groups: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GroupsOn:
    tenant: str
    groups: tuple[int, ...]


Action = GroupsOff | GroupsOn


# --- state -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Conf:
    weight: int
    cap: int | None
    priority: bool


@dataclass(slots=True)
class _Tenant:
    conf: _Conf
    staged: _Conf
    groups: set[int] = field(default_factory=set)
    runnable: bool = False
    urgent: bool = False  # a priority tenant that became runnable and has not run since
    deficit: int = 0
    debt: int = 0  # time run past its slots' ends, not yet paid back
    rem: int = 0  # quantum remainder, in units of 1/rem_den us
    rem_den: int = 0
    frame_used_us: int = 0


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


class _HasGroups(Protocol):
    groups: set[int]


def check_now(now_us: int, last_us: int | None) -> None:
    """ValueError unless ``now_us`` is a time at or after ``last_us``."""
    if not is_int(now_us) or now_us < 0:
        raise ValueError(f"now_us must be a non-negative integer, got {now_us!r}")
    if last_us is not None and now_us < last_us:
        raise ValueError(f"time went backwards: now_us={now_us} < {last_us}")


def check_tenant_event(event: TenantEvent, tenants: Mapping[str, _HasGroups], cap_floor: int,
                       cap_why: str = "") -> None:
    """ValueError unless ``event`` applies to ``tenants`` (each with its groups):
    the checks both cores (this one and vgpud.core.runlist) make of a tenant event."""
    tid = event.tenant
    if not isinstance(tid, str) or not tid:
        raise ValueError(f"tenant must be a non-empty string, got {tid!r}")
    if isinstance(event, TenantAdded):
        if tid in tenants:
            raise ValueError(f"tenant {tid!r} already exists")
        _check_weight(event.weight)
        _check_cap(event.cap, cap_floor, cap_why)
        _check_priority(event.priority)
        return
    tenant = tenants.get(tid)
    if tenant is None:
        raise ValueError(f"unknown tenant {tid!r}")
    match event:
        case WeightChanged(weight=weight):
            _check_weight(weight)
        case CapChanged(cap=cap):
            _check_cap(cap, cap_floor, cap_why)
        case PriorityChanged(priority=priority):
            _check_priority(priority)
        case GroupCreated(group=group) | GroupFreed(group=group):
            if not is_int(group) or group < 0:
                raise ValueError(f"group must be a non-negative integer, got {group!r}")
            exists = group in tenant.groups
            if isinstance(event, GroupCreated) and exists:
                raise ValueError(f"tenant {tid!r} already has group {group}")
            if isinstance(event, GroupFreed) and not exists:
                raise ValueError(f"tenant {tid!r} has no group {group}")


def _check_weight(weight: object) -> None:
    if not (is_int(weight) and isinstance(weight, int) and 0 <= weight <= MAX_WEIGHT):
        raise ValueError(f"weight must be an integer in 0..{MAX_WEIGHT}, got {weight!r}")


def _check_cap(cap: object, low: int, why: str) -> None:
    if cap is not None and not (is_int(cap) and isinstance(cap, int) and low <= cap <= 100):
        raise ValueError(f"cap must be None or a percentage in {low}..100{why}, got {cap!r}")


def _check_priority(priority: object) -> None:
    if not isinstance(priority, bool):
        raise ValueError(f"priority must be a bool, got {priority!r}")


class TdmaScheduler:
    """Time-slice scheduler for one GPU; see the module docstring."""

    def __init__(self, config: TdmaConfig | None = None) -> None:
        self._cfg = config or TdmaConfig()
        self._tenants: dict[str, _Tenant] = {}
        self._ring: list[str] = []
        self._pointer: str | None = None
        self._now: int | None = None
        self._frame_end = 0
        self._running: str | None = None
        self._slot_start = 0
        self._slot_end = 0

    @property
    def config(self) -> TdmaConfig:
        return self._cfg

    @property
    def running(self) -> str | None:
        """The tenant whose groups are on, if any."""
        return self._running

    @property
    def frame_end_us(self) -> int | None:
        """End of the current frame; None before the first call."""
        return None if self._now is None else self._frame_end

    def next_deadline(self) -> int | None:
        """When the scheduler must be called again (with `tick`), or None."""
        if self._running is not None:
            return min(self._slot_end, self._frame_end)
        if any(t.runnable and t.conf.weight > 0 for t in self._tenants.values()):
            return self._frame_end  # runnable but capped out: wait for the next frame
        return None

    def tick(self, now_us: int) -> list[Action]:
        return self.handle(Tick(), now_us)

    def handle(self, event: Event, now_us: int) -> list[Action]:
        """Apply `event` at `now_us`; return what to switch off, then on.

        Invalid input raises ValueError and changes nothing.
        """
        self._validate(event, now_us)
        if self._now is None:
            self._now = now_us
            self._frame_end = now_us + self._cfg.frame_us
        self._advance(now_us)
        actions: list[Action] = []
        self._apply(event, actions)
        self._schedule(now_us, actions)
        return actions

    # --- input ---------------------------------------------------------------

    def _validate(self, event: Event, now_us: int) -> None:
        check_now(now_us, self._now)
        if isinstance(event, Tick):
            return
        if not isinstance(event, Event):
            raise ValueError(f"not a scheduler event: {event!r}")
        check_tenant_event(event, self._tenants, self._cfg.cap_floor,
                           f" (a capped tenant needs at least one min slot of "
                           f"{self._cfg.min_slot_us} us per frame)")

    def _apply(self, event: Event, actions: list[Action]) -> None:
        match event:
            case TenantAdded(tenant=tid, weight=weight, cap=cap, priority=priority):
                conf = _Conf(weight, cap, priority)
                self._tenants[tid] = _Tenant(conf=conf, staged=conf)
                insort(self._ring, tid)
            case TenantRemoved(tenant=tid):
                self._stop(tid, actions)
                del self._tenants[tid]
                self._ring.remove(tid)
            case Runnable(tenant=tid):
                tenant = self._tenants[tid]
                if not tenant.runnable:
                    tenant.runnable = True
                    tenant.urgent = tenant.conf.priority
            case Idle(tenant=tid):
                tenant = self._tenants[tid]
                tenant.runnable = tenant.urgent = False
                tenant.deficit = min(tenant.deficit, 0)
                self._stop(tid, actions)
            case WeightChanged(tenant=tid, weight=weight):
                tenant = self._tenants[tid]
                tenant.staged = replace(tenant.staged, weight=weight)
            case CapChanged(tenant=tid, cap=cap):
                tenant = self._tenants[tid]
                tenant.staged = replace(tenant.staged, cap=cap)
            case PriorityChanged(tenant=tid, priority=priority):
                tenant = self._tenants[tid]
                tenant.staged = replace(tenant.staged, priority=priority)
            case GroupCreated(tenant=tid, group=group):
                self._tenants[tid].groups.add(group)
                state = GroupsOn if tid == self._running else GroupsOff
                actions.append(state(tid, (group,)))
            case GroupFreed(tenant=tid, group=group):
                self._tenants[tid].groups.discard(group)

    def _stop(self, tid: str, actions: list[Action]) -> None:
        """End `tid`'s slot now if it is running."""
        if tid == self._running:
            self._switch_off(actions)

    # --- time ----------------------------------------------------------------

    def _advance(self, now: int) -> None:
        """Charge the running tenant up to `now`, rolling frames on the way."""
        if now >= self._frame_end:
            self._charge(self._frame_end)
            frames = (now - self._frame_end) // self._cfg.frame_us + 1
            self._frame_end += frames * self._cfg.frame_us
            for tenant in self._tenants.values():
                tenant.frame_used_us = 0
                tenant.conf = tenant.staged
                if tenant.conf.weight == 0:
                    tenant.deficit = min(tenant.deficit, 0)
        self._charge(now)

    def _charge(self, now: int) -> None:
        assert self._now is not None
        if self._running is not None:
            tenant = self._tenants[self._running]
            spent = now - self._now
            late = min(spent, max(0, now - self._slot_end))  # past the slot's planned end
            tenant.deficit -= spent - late
            tenant.debt += late
            tenant.frame_used_us += spent
        self._now = now

    # --- decisions -----------------------------------------------------------

    def _budget(self, tenant: _Tenant) -> int | None:
        """Microseconds a capped tenant may still run in this frame; None if uncapped."""
        if tenant.conf.cap is None:
            return None
        return tenant.conf.cap * self._cfg.frame_us // 100 - tenant.frame_used_us

    def _candidate(self, tenant: _Tenant, now: int) -> bool:
        if not tenant.runnable or tenant.conf.weight == 0:
            return False
        budget = self._budget(tenant)
        m = self._cfg.min_slot_us
        return budget is None or (budget >= m and self._frame_end - now >= m)

    def _clip(self, tenant: _Tenant, length: int, now: int) -> int:
        budget = self._budget(tenant)
        if budget is None:
            return length
        return min(length, budget, self._frame_end - now)

    def _urgent(self, now: int) -> str | None:
        """The first priority tenant waiting to preempt, if any."""
        for tid in self._ring:
            t = self._tenants[tid]
            if t.urgent and t.conf.priority and t.deficit >= 0 and self._candidate(t, now):
                return tid
        return None

    def _schedule(self, now: int, actions: list[Action]) -> None:
        if self._running is not None:
            tenant = self._tenants[self._running]
            end = self._slot_end
            budget = self._budget(tenant)
            if tenant.conf.weight == 0:
                end = now
            elif budget is not None:
                end = min(end, now + budget, self._frame_end)
            if not tenant.conf.priority and self._urgent(now) is not None:
                end = min(end, max(now, self._slot_start + self._cfg.min_slot_us))
            self._slot_end = end
            if now < end:
                return
            rest = self._budget(tenant)
            if rest is not None and rest < self._cfg.min_slot_us:
                tenant.deficit = min(tenant.deficit, 0)  # capped out: unused share is not saved
        picked = self._pick(now)
        if picked is None:
            if self._running is not None:
                self._switch_off(actions)
            return
        tid, length = picked
        if tid != self._running:
            if self._running is not None:
                self._switch_off(actions)
            groups = self._tenants[tid].groups
            if groups:
                actions.append(GroupsOn(tid, tuple(sorted(groups))))
            self._running = tid
            self._slot_start = now  # a tenant kept on keeps its start: min slot is per switch
        self._slot_end = now + length

    def _switch_off(self, actions: list[Action]) -> None:
        assert self._running is not None
        groups = self._tenants[self._running].groups
        if groups:
            actions.append(GroupsOff(self._running, tuple(sorted(groups))))
        self._running = None

    def _pick(self, now: int) -> tuple[str, int] | None:
        """The next tenant and its slot length, advancing the DRR pointer."""
        m = self._cfg.min_slot_us
        urgent = self._urgent(now)
        if urgent is not None:
            tenant = self._tenants[urgent]
            tenant.urgent = False
            self._repay(tenant)
            return urgent, self._clip(tenant, max(m, tenant.deficit), now)
        start = 0 if self._pointer is None else bisect_right(self._ring, self._pointer)
        order = self._ring[start:] + self._ring[:start]
        ring = [(tid, self._tenants[tid]) for tid in order]
        ring = [(tid, t) for tid, t in ring if self._candidate(t, now)]
        if not ring:
            return None
        total = sum(t.conf.weight for _, t in ring)
        while True:  # ends: the heaviest tenant earns >= frame/n per visit
            for tid, tenant in ring:
                tenant.deficit += self._quantum(tenant, total)
                if tenant.deficit >= m:
                    self._pointer = tid
                    tenant.urgent = False
                    self._repay(tenant)
                    return tid, self._clip(tenant, tenant.deficit, now)

    def _repay(self, tenant: _Tenant) -> None:
        """Pay debt from what the tenant may run now beyond one min slot."""
        pay = min(tenant.debt, max(0, tenant.deficit - self._cfg.min_slot_us))
        tenant.deficit -= pay
        tenant.debt -= pay

    def _quantum(self, tenant: _Tenant, total: int) -> int:
        carried = tenant.rem if tenant.rem_den == total else 0
        quantum, tenant.rem = divmod(self._cfg.frame_us * tenant.conf.weight + carried, total)
        tenant.rem_den = total
        return quantum
