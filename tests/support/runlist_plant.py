"""A simulated GPU runlist (the plant) and the loop that drives a RunlistPlanner
against it, in virtual microseconds.

The plant is the hardware round robin: it visits the enabled groups that have
work in creation order, each for up to its timeslice, and skips a group
without work. A group at the HIGH interleave level (SetInterleave) comes up
after every turn of a lower group: each HIGH group with work gets one turn
before the next lower one (the runlist order of ctrla06c.h; the planner never
uses LOW, which the plant does not model). A switch to another group costs
`switch_us` of idle engine time. Each group's demand says how much work it
has: saturating, a fraction of the GPU (work arrives at that rate), idle, or
fine-grained chunks (one chunk at a time, the group yields when it ends and
submits the next `gap_us` later); a slice cut with work left may overrun by
`overrun_us`. GroupsOff and Preempt
end the running turn at once. The plant reports cumulative busy time per
tenant, as nvsim's counters do. Used by tests/unit/test_runlist.py and
tests/bench/bench_runlist.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from vgpud.core.runlist import (
    LEVEL_HIGH,
    LEVEL_MEDIUM,
    Action,
    BusySample,
    Event,
    Preempt,
    RunlistPlanner,
    SetInterleave,
    SetTimeslice,
)
from vgpud.core.tdma import GroupCreated, GroupsOff, GroupsOn, TenantAdded, TenantRemoved

DEFAULT_TIMESLICE_US = 1_024  # a new TSG's slice (the driver's default)
MAX_PENDING_US = 50_000  # work a fractional group banks while it waits
MIN_WORK_US = 50  # a fractional group submits once this much has arrived


@dataclass(frozen=True, slots=True)
class Demand:
    """How much work one group has.

    rate: the fraction of the GPU it would use alone (1 saturates, 0 is idle).
    chunk_us > 0: work comes one chunk at a time; the group yields when a chunk
    ends and has the next one `gap_us` later.
    overrun_us: how far a slice cut with work left runs past its end.
    """

    rate: float = 1.0
    chunk_us: int = 0
    gap_us: int = 0
    overrun_us: int = 0


SATURATING = Demand()
IDLE = Demand(rate=0.0)


@dataclass(slots=True)
class _Group:
    tenant: str
    group: int
    demand: Demand
    timeslice: int = DEFAULT_TIMESLICE_US
    enabled: bool = False  # the module makes a new group off
    pending: float = 0.0  # fractional demand: work arrived, not yet run
    arrived_to: int = 0
    chunk_left: int = 0
    ready_at: int = 0
    busy: int = 0
    preempted: int = 0
    level: int = LEVEL_MEDIUM
    high_block: int = -1  # HIGH: the block of turns it last ran in


@dataclass(slots=True)
class Plant:
    switch_us: int = 0
    now: int = 0
    groups: list[_Group] = field(default_factory=list)
    switches: int = 0
    starts: list[tuple[str, int]] = field(default_factory=list)  # (tenant, busy from)
    _running: _Group | None = None
    _busy_from: int = 0
    _turn_end: int = 0
    _last: _Group | None = None
    _pointer: int = 0
    _high_pointer: int = 0
    _high_block: int = 0  # a new block of HIGH turns opens with each lower turn
    _retired: dict[str, int] = field(default_factory=dict)  # busy of freed groups

    def add_group(self, tenant: str, group: int, demand: Demand = SATURATING) -> None:
        assert self.find(tenant, group) is None, (tenant, group)
        self.groups.append(_Group(tenant, group, demand, arrived_to=self.now,
                                  ready_at=self.now))

    def free_group(self, tenant: str, group: int) -> None:
        g = self.get(tenant, group)
        if g is self._running:
            self._end_turn()
        self._retired[tenant] = self._retired.get(tenant, 0) + g.busy
        index = self.groups.index(g)
        self.groups.remove(g)
        if index < self._pointer:
            self._pointer -= 1
        if index < self._high_pointer:
            self._high_pointer -= 1
        if self._last is g:
            self._last = None

    def set_demand(self, tenant: str, demand: Demand) -> None:
        """Give all of `tenant`'s groups a new demand from now."""
        for g in self.groups:
            if g.tenant == tenant:
                self._arrive(g)
                g.demand = demand
                g.arrived_to = g.ready_at = self.now

    def find(self, tenant: str, group: int) -> _Group | None:
        return next((g for g in self.groups if (g.tenant, g.group) == (tenant, group)), None)

    def get(self, tenant: str, group: int) -> _Group:
        g = self.find(tenant, group)
        if g is None:
            raise KeyError(f"no group {group} of {tenant!r} on the plant")
        return g

    def busy(self) -> dict[str, int]:
        out = dict(self._retired)
        for g in self.groups:
            out[g.tenant] = out.get(g.tenant, 0) + g.busy
        return out

    def apply(self, actions: Iterable[Action]) -> None:
        for action in actions:
            match action:
                case SetTimeslice(tenant=t, group=group, us=us):
                    self.get(t, group).timeslice = us
                case SetInterleave(tenant=t, group=group, level=level):
                    self.get(t, group).level = level
                case GroupsOn(tenant=t, groups=groups) | GroupsOff(tenant=t, groups=groups):
                    on = isinstance(action, GroupsOn)
                    for group in groups:
                        g = self.get(t, group)
                        g.enabled = on
                        if not on and g is self._running:
                            self._end_turn()
                case Preempt(tenant=t, groups=groups):
                    for group in groups:
                        g = self.get(t, group)
                        if g is self._running:
                            g.preempted += 1
                            self._end_turn()

    # --- the engine ---------------------------------------------------------

    def run_until(self, until: int) -> None:
        while self.now < until:
            if self._running is not None:
                self._charge(min(until, self._turn_end))
                if self.now >= self._turn_end:
                    self._end_turn()
                continue
            if not self._start_turn():
                self.now = min(until, max(self.now + 1, self._next_work()))

    def _arrive(self, g: _Group) -> None:
        d = g.demand
        if 0 < d.rate < 1 and not d.chunk_us:
            g.pending = min(MAX_PENDING_US, g.pending + d.rate * (self.now - g.arrived_to))
        g.arrived_to = self.now

    def _work(self, g: _Group) -> float:
        """Work the group has now (float('inf'): saturating)."""
        d = g.demand
        if d.rate <= 0:
            return 0.0
        if d.chunk_us:
            if not g.chunk_left and self.now >= g.ready_at:
                g.chunk_left = d.chunk_us
            return float(g.chunk_left)
        if d.rate >= 1:
            return float("inf")
        self._arrive(g)
        return g.pending if g.pending >= MIN_WORK_US else 0.0

    def _next_work(self) -> int:
        soon = [self.now + 10**9]
        for g in self.groups:
            d = g.demand
            if not g.enabled or d.rate <= 0:
                continue
            if d.chunk_us:
                soon.append(g.ready_at)
            elif d.rate < 1:
                soon.append(self.now + int((MIN_WORK_US - g.pending) / d.rate) + 1)
        return min(soon)

    def _start_turn(self) -> bool:
        found = self._next(high=True, block=self._high_block)
        if found is None:
            found = self._next(high=False, block=0)
            if found is not None:
                self._high_block += 1
        if found is None:
            self._high_block += 1
            found = self._next(high=True, block=self._high_block)
        if found is None:
            return False
        g, work = found
        cost = self.switch_us if self._last is not None and g is not self._last else 0
        self.switches += cost > 0
        length = min(work, g.timeslice)
        if work > g.timeslice:
            length = min(work, g.timeslice + g.demand.overrun_us)
        self._running, self._last = g, g
        self._busy_from = self.now + cost
        self._turn_end = self._busy_from + max(1, int(length))
        self.starts.append((g.tenant, self._busy_from))
        return True

    def _next(self, *, high: bool, block: int) -> tuple[_Group, float] | None:
        """The next enabled group with work at HIGH (not yet run in ``block``)
        or below it, round robin from its pointer; the pointer moves past it."""
        n = len(self.groups)
        start = self._high_pointer if high else self._pointer
        for i in range(n):
            g = self.groups[(start + i) % n]
            if not g.enabled or (g.level == LEVEL_HIGH) != high:
                continue
            if high and g.high_block == block:
                continue
            work = self._work(g)
            if work <= 0:
                continue
            if high:
                self._high_pointer = (start + i + 1) % n
                g.high_block = block
            else:
                self._pointer = (start + i + 1) % n
            return g, work
        return None

    def _charge(self, to: int) -> None:
        g = self._running
        assert g is not None
        ran = max(0, to - max(self.now, self._busy_from))
        g.busy += ran
        if g.demand.chunk_us:
            g.chunk_left = max(0, g.chunk_left - ran)
            if not g.chunk_left:
                g.ready_at = to + g.demand.gap_us
        elif g.demand.rate < 1:
            g.pending = max(0.0, g.pending - ran)
        self.now = to

    def _end_turn(self) -> None:
        self._running = None


@dataclass(slots=True)
class Loop:
    """Drives `planner` against `plant`: events and ticks go to the planner,
    its actions to the plant, and a BusySample every `sample_us`."""

    planner: RunlistPlanner
    plant: Plant
    sample_us: int = 500_000
    samples: list[tuple[int, dict[str, int]]] = field(default_factory=list)  # busy deltas
    actions: list[tuple[int, Action]] = field(default_factory=list)
    _next_group: int = 0
    _last_busy: dict[str, int] = field(default_factory=dict)
    _next_sample: int | None = None
    _tenants: set[str] = field(default_factory=set)  # those the planner knows

    def event(self, event: Event) -> list[Action]:
        actions = self.planner.handle(event, self.plant.now)
        if isinstance(event, TenantAdded):
            self._tenants.add(event.tenant)
        elif isinstance(event, TenantRemoved):
            self._tenants.discard(event.tenant)
        self._do(actions)
        return actions

    def _do(self, actions: list[Action]) -> None:
        self.plant.apply(actions)
        self.actions += [(self.plant.now, a) for a in actions]

    def add(self, tenant: str, weight: int = 1, demands: Iterable[Demand] = (SATURATING,),
            cap: int | None = None, priority: bool = False) -> list[int]:
        self.event(TenantAdded(tenant, weight, cap, priority))
        groups = []
        for demand in demands:
            self._next_group += 1
            self.plant.add_group(tenant, self._next_group, demand)
            self.event(GroupCreated(tenant, self._next_group))
            groups.append(self._next_group)
        return groups

    def run(self, duration_us: int) -> None:
        end = self.plant.now + duration_us
        if self._next_sample is None:
            self._next_sample = self.plant.now + self.sample_us
        while True:
            deadline = self.planner.next_deadline()
            stop = min(end, self._next_sample, end if deadline is None else deadline)
            self.plant.run_until(stop)
            if deadline is not None and deadline <= stop:
                self._do(self.planner.tick(self.plant.now))
            if self._next_sample <= stop:
                self._sample()
                self._next_sample += self.sample_us
            if stop >= end:
                return

    def _sample(self) -> None:
        busy = self.plant.busy()
        self.samples.append((self.plant.now, {t: b - self._last_busy.get(t, 0)
                                              for t, b in busy.items()}))
        self._last_busy = busy
        known = {t: b for t, b in busy.items() if t in self._tenants}
        self._do(self.planner.handle(BusySample(known), self.plant.now))

    def shares(self, last: int) -> dict[str, float]:
        """Percent of the elapsed time each tenant ran over the `last` samples."""
        picked = self.samples[-last:]
        span = picked[-1][0] - (self.samples[-last - 1][0] if len(self.samples) > last
                                else 0)
        total: dict[str, int] = {}
        for _, delta in picked:
            for t, b in delta.items():
                total[t] = total.get(t, 0) + b
        return {t: 100 * b / span for t, b in total.items()}

    def busy_shares(self, last: int) -> dict[str, float]:
        """Percent of the busy time each tenant ran over the `last` samples."""
        picked = self.samples[-last:]
        total: dict[str, int] = {}
        for _, delta in picked:
            for t, b in delta.items():
                total[t] = total.get(t, 0) + b
        whole = sum(total.values()) or 1
        return {t: 100 * b / whole for t, b in total.items()}
