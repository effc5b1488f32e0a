"""Runlist planner for one GPU (sans-I/O): the GPU's own round robin slices time,
the planner sets each channel group's (TSG's) timeslice.

The daemon feeds events and the current time in microseconds, performs the
returned actions in order, and calls `tick` again at `next_deadline()`:

    actions = planner.handle(BusySample({"a": 1200, ...}), now_us)
    for action in actions: ...   # GroupsOff, SetTimeslice, SetInterleave, GroupsOn, Preempt
    sleep_until(planner.next_deadline())   # None: only events wake it

The hardware visits the enabled groups that have work in turn, each for up to
its timeslice, and skips a group without work: that alone conserves work, so
the planner needs no activity signal (Runnable/Idle are optional). Each call
computes the wanted state and emits only the difference from what it emitted
before, in the order GroupsOff, SetTimeslice and SetInterleave, GroupsOn,
Preempt (a group is given its slice before it is switched on).

Nominal plan. Tenant i with weight w_i > 0, boost b_i (1 until the feedback
says otherwise) and g_i groups gets slice u * w_i * b_i / g_i on each group,
so a saturating tenant gets w_i * b_i / sum(w_j * b_j) of each round. The unit
u, from the weights alone, is the largest that keeps the smallest nominal
slice (b = 1) at `base_slice_us` (the frame core's hw_timeslice, the driver's
default), the largest at most `max_timeslice_us` and a nominal round (u times
the total weight) at most `max_round_us`. Every slice is clamped to
[min_timeslice_us, max_timeslice_us], so where the weights are widely spread
the lightest tenants' slices are pinned at the minimum and get more than
their share, taken from the others: a saturating tenant i loses
w_i / W * E / (u * W + E) of the GPU, E the pinned slices' excess over
u * w / g. u grows (by 1.25 at a time, up to the unit at which nothing is
pinned) until no tenant loses more than `floor_error` (0.5 point): the
round is the shortest from max_round_us up that keeps every share within
that of its weight's. (Weights 3..993 at 64 tenants: a round of about 100
ms; pinning the smallest slice at the minimum instead would make it 2.7 s.)

Starvation bound. While the set of tenants with work is unchanged, a group
with work waits at most one round for its turn: the sum of the other enabled
groups' slices plus, per turn, the plant's switch time and overrun. With
boosts <= 1 that is at most the round above (max_round_us, or longer where
that would pin too much), and never more than min_timeslice_us * W / (w/g)_min,
plus those costs (64 tenants of equal weight: 64 * 1024 us = 65.5 ms). A slice is re-sent only
when it moves by more than `hysteresis_pct` percent, so a weight change costs
one SetTimeslice per group of the changed tenant (of every tenant when it
moves u: the changed tenant had or now has the smallest w/g), and a
steady state emits nothing. Weight 0 switches a tenant's groups off.

Feedback. BusySample carries cumulative busy time per tenant as measured. The
planner sums the deltas over a window of at least `window_rounds` planned
rounds (a round: the sum of the enabled groups' slices), so that the part of
a round cut by the window's ends (at most one turn per tenant) stays under
1/window_rounds of what each tenant is measured to get. One window is one
"sample" below: with 2 tenants at base slices about 128 * 2 ms = 0.26 s,
with 64 equal tenants 128 * 65.5 ms = 8.4 s, up to 128 * max_round_us. The
nominal plan is exact for saturating tenants whose slices run fully; the loop
removes what overruns, yields and idle groups add, slowly where rounds are
long. A window in which the GPU was busy for less than
(1 - idle_tolerance) of the elapsed time, or a priority tenant was active, is
not used for correction: everybody got what they asked for (or priority
rules). Otherwise the competing set C is the uncapped tenants with weight > 0
that ran in the window and whose nominal slices are not pinned at the minimum
(no boost of theirs could shorten them); tenant i's target is
t_i = w_i / W_C * sum_C d_j and
its error e_i = ln(d_i / t_i). When |d_i - t_i| exceeds deadband * t_i plus
one turn's worth (its planned per-round time, the window's measurement
uncertainty), ln b_i -= gain * clip(e_i, +-ln step_limit). The boosts in C
are then shifted together so that the largest is 1, which shortens the slices of the
tenants that get too much and so serves a tenant whose groups yield early
(shorter rounds give it more turns), but not below any tenant's floor (the
boost at which its slice is min_timeslice_us): a tenant that went below its
floor is lifted back to it, and the rest with it. Last, no boost in C may
exceed the smallest by more than max_boost, nor its top (the boost at which
its slice is max_timeslice_us, or 1/max_boost if that is lower): a slice held
at a bound never winds up against it. Tenants outside C (idle, capped,
weight 0) and every tenant in an unused window have ln b halved (they relax
to the nominal plan). Errors
from yield (a group runs out of work before its slice ends), overruns, a
fixed cost per turn, unequal group counts and a tenant's idle groups are all
corrected by this one rule, within the bounds.

Stability and convergence. Write a_i(b_i) for what saturating tenant i runs
per round; its share is a_i / sum_j a_j. Since the targets of C share one
normaliser, e_i - e_j = ln(d_i/d_j) - ln(w_i/w_j) for any pair in C: the
pairwise log-ratio error E_ij, and one unclipped correction changes
ln(b_i/b_j) by -gain * E_ij (the common shift keeps ratios). With the plant's
sensitivity s = d ln a_i / d ln b_i in (0, 1] (1 for slices that run fully;
less with overruns, a fixed cost per turn, or yield), E_ij contracts by
(1 - gain * s) per sample: for gain <= 1 this lies in [0, 1), so the loop
converges monotonically without overshoot, and the ratio of any two boosts
stays within max_boost (bounded: no wind-up). The worst wind-up is a tenant
that asked for less than its share and then saturates: its boost is at most
max_boost times the others', E0 <= ln max_boost. While a tenant's error is
above ln step_limit it moves by gain * ln step_limit, so E falls by at least
gain * s * ln step_limit per sample, then geometrically by (1 - gain * s).
With the defaults (gain 0.75, step 2, boost 4) and s >= 0.8, E0 = ln 4 takes
2 clipped samples and 3 geometric ones to fall under 0.04 (one point at
50/50), plus the window in which the demand changed: CONVERGENCE_SAMPLES = 6
windows, asserted against the simulated plant in tests/unit/test_runlist.py
(it measures 3). The loop then rests within deadband + 1/window_rounds of
each target, and emits nothing. A tenant whose demand stays under its share
costs the others no GPU time (the hardware skips its groups when they have no
work), only shorter slices (more switches). A correction beyond the bounds (a
tenant with 8 groups of which 1 has work needs 8) is made only up to them.

Caps. Frames are fixed windows of `frame_us` from the first call. A capped
tenant's groups are on for the first cap% of each frame and off for the rest
(GroupsOn/GroupsOff at those instants, the only per-frame work), so it runs at
most cap% of the GPU; under contention it gets its round-robin share of the
on-phase only. A cap, weight or priority change takes effect at once.

Priority. A priority tenant's groups are at the runlist's HIGH interleave
level (SetInterleave; every other group stays at the driver's default,
MEDIUM): the hardware's runlist puts a HIGH group after every lower one, so a
priority group that gets work runs once the slice running then ends (or at
once on an idle engine), with no help from the planner, and gets a slice after
every best-effort slice while it has work. Its wait is bounded by the longest
best-effort slice plus a switch, whatever the number of groups: the nominal
slice before the planner hears of the work, a share of priority_round_us
after. Without interleave (a driver that refuses it), the bound is the
best-effort round below.

A priority tenant is active from Runnable, Submitted or a BusySample in
which it ran (a burst too short for the activity poll to see) until a feedback
window closes in which it ran for no time and submitted nothing; an Idle does
not end it, so the best-effort slices stay short between its bursts (each of
which would otherwise find a nominal, possibly long, slice running, and wait
for it before the planner hears of the burst). While
one is active, priority groups get `priority_slice_us` and best-effort
groups their plan scaled so the smallest is `short_slice_us` and a round of
them is at most `priority_round_us`, each slice floored at
`min_timeslice_us` (so the round is at most priority_round_us plus one
minimum slice per best-effort group, whatever the weights' spread: it
bounds each best-effort slice, and without interleave the priority group's
wait for its turn; best-effort shares follow
the weights only as far as that allows); Submitted or
Runnable of a priority tenant emits Preempt of every enabled best-effort
tenant's groups (the planner does not know which one runs), at most once per
`preempt_holdoff_us`. Nominal slices are restored when no priority tenant is
active.

Invalid input raises ValueError and changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from vgpud.core.tdma import (
    CapChanged,
    GroupCreated,
    GroupFreed,
    GroupsOff,
    GroupsOn,
    Idle,
    PriorityChanged,
    Runnable,
    TenantAdded,
    TenantEvent,
    TenantRemoved,
    Tick,
    WeightChanged,
    check_now,
    check_tenant_event,
    is_int,
)

__all__ = [
    "CONVERGENCE_SAMPLES",
    "LEVEL_HIGH",
    "LEVEL_MEDIUM",
    "Action",
    "BusySample",
    "Event",
    "Preempt",
    "RunlistConfig",
    "RunlistPlanner",
    "SetInterleave",
    "SetTimeslice",
    "Submitted",
]

CONVERGENCE_SAMPLES = 6  # windows, with the defaults: see the module docstring
# NVA06C_CTRL_INTERLEAVE_LEVEL_*: a new group is MEDIUM; HIGH comes after every lower group.
LEVEL_MEDIUM = 1
LEVEL_HIGH = 2


@dataclass(frozen=True, slots=True)
class RunlistConfig:
    """Timeslice bounds and loop constants (microseconds unless named otherwise).

    base_slice_us is the frame core's hw_timeslice (1024 us, the driver's
    default TSG timeslice). The bounds are the driver's to give: NVIDIA's open
    modules check a requested slice against kfifoRunlistGetMinTimeSlice_HAL,
    whose value the daemon's config must supply; min_timeslice_us here is only
    a floor for the short best-effort slices and max_timeslice_us bounds how
    long one group may hold the engine.
    """

    base_slice_us: int = 1_024
    min_timeslice_us: int = 256
    max_timeslice_us: int = 200_000
    max_round_us: int = 100_000
    floor_error: float = 0.005
    hysteresis_pct: int = 1
    frame_us: int = 50_000
    window_rounds: int = 128
    gain: float = 0.75
    step_limit: float = 2.0
    max_boost: float = 4.0
    deadband: float = 0.01
    idle_tolerance: float = 0.1
    priority_slice_us: int = 8_192
    short_slice_us: int = 512
    priority_round_us: int = 2_048
    preempt_holdoff_us: int = 1_000

    def __post_init__(self) -> None:
        for name in ("base_slice_us", "min_timeslice_us", "max_timeslice_us", "max_round_us",
                     "frame_us", "window_rounds", "priority_slice_us", "short_slice_us",
                     "priority_round_us"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("hysteresis_pct", "preempt_holdoff_us"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        lo, hi = self.min_timeslice_us, self.max_timeslice_us
        for name in ("base_slice_us", "priority_slice_us", "short_slice_us"):
            if not lo <= getattr(self, name) <= hi:
                raise ValueError(f"{name} must lie in [min_timeslice_us, max_timeslice_us]")
        if self.frame_us < lo:
            raise ValueError("frame_us is shorter than min_timeslice_us")
        if not 0 < self.gain <= 1:
            raise ValueError(f"gain must be in (0, 1] for stability, got {self.gain!r}")
        if not (self.step_limit > 1 and self.max_boost >= 1):
            raise ValueError("step_limit must exceed 1 and max_boost be at least 1")
        if not (0 <= self.deadband < 1 and 0 <= self.idle_tolerance < 1
                and 0 < self.floor_error < 1):
            raise ValueError("deadband and idle_tolerance must be in [0, 1), floor_error "
                             "in (0, 1)")

    @property
    def cap_floor(self) -> int:
        """The lowest cap (percent) whose on-phase holds one minimum timeslice."""
        return -(-100 * self.min_timeslice_us // self.frame_us)


# --- events and actions (the rest are tdma's) --------------------------------


@dataclass(frozen=True, slots=True)
class BusySample:
    """Cumulative busy time per tenant on this GPU, in microseconds, as measured.

    Tenants left out ran for no time since the last sample. A counter that went
    down (the source restarted) starts a new baseline.
    """

    busy_us: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class Submitted:
    """The tenant submitted work (the module's submit path or the activity signal)."""

    tenant: str


@dataclass(frozen=True, slots=True)
class SetTimeslice:
    tenant: str
    group: int
    us: int


@dataclass(frozen=True, slots=True)
class SetInterleave:
    """The group's runlist interleave level (LEVEL_MEDIUM or LEVEL_HIGH)."""

    tenant: str
    group: int
    level: int


@dataclass(frozen=True, slots=True)
class Preempt:
    """End the running slice if one of these groups holds the engine."""

    tenant: str
    groups: tuple[int, ...]


Event = TenantEvent | Tick | BusySample | Submitted
Action = GroupsOff | SetTimeslice | SetInterleave | GroupsOn | Preempt

_TENANT_EVENTS = (TenantAdded, TenantRemoved, Runnable, Idle, WeightChanged, CapChanged,
                  PriorityChanged, GroupCreated, GroupFreed, Submitted)


@dataclass(slots=True)
class _Tenant:
    weight: int
    cap: int | None
    priority: bool
    groups: set[int] = field(default_factory=set)
    log_boost: float = 0.0
    active: bool = False  # a priority tenant with work
    submitted: bool = False  # since the last window closed
    busy_mark: int = 0  # the last cumulative busy seen
    window_busy: int = 0


class RunlistPlanner:
    """Timeslice planner for one GPU; see the module docstring."""

    def __init__(self, config: RunlistConfig | None = None) -> None:
        self._cfg = config or RunlistConfig()
        self._tenants: dict[str, _Tenant] = {}
        self._now: int | None = None
        self._frame_start = 0
        self._window_start = 0
        self._last_preempt: int | None = None
        self._slices: dict[tuple[str, int], int] = {}  # as last sent
        self._on: dict[tuple[str, int], bool] = {}  # as last sent
        self._levels: dict[tuple[str, int], int] = {}  # as last sent (none: MEDIUM)
        # The plan may differ from what was sent: set by every event but a
        # sample or a tick, and by a closed feedback window; else a sample
        # costs no plan (the plan is a function of that state, and of time
        # only through caps).
        self._stale = True

    @property
    def config(self) -> RunlistConfig:
        return self._cfg

    def timeslices(self) -> dict[tuple[str, int], int]:
        """Each known group's timeslice as last sent, in microseconds."""
        return dict(self._slices)

    def tenant_timeslices(self, tenant: str) -> list[int]:
        """The timeslices last sent to ``tenant``'s groups, in group order (its
        groups alone: the daemon asks for every tenant once a second)."""
        t = self._tenants.get(tenant)
        if t is None:
            return []
        return [self._slices[key] for key in ((tenant, g) for g in sorted(t.groups))
                if key in self._slices]

    def levels(self) -> dict[tuple[str, int], int]:
        """Each group's interleave level as last sent (LEVEL_MEDIUM if none was)."""
        return {key: self._levels.get(key, LEVEL_MEDIUM) for key in self._slices}

    def switched_on(self) -> frozenset[str]:
        """The tenants with a group switched on (all but weight 0 and a cap's off phase)."""
        return frozenset(tid for (tid, _), on in self._on.items() if on)

    def next_deadline(self) -> int | None:
        """The next cap duty-cycle edge, or None when no tenant is capped."""
        if self._now is None:
            return None
        capped = [t.cap for t in self._tenants.values()
                  if t.cap is not None and t.cap < 100 and t.weight > 0 and t.groups]
        if not capped:
            return None
        frame_end = self._frame_start + self._cfg.frame_us
        edges = [self._frame_start + cap * self._cfg.frame_us // 100 for cap in capped]
        return min([e for e in edges if e > self._now] + [frame_end])

    def tick(self, now_us: int) -> list[Action]:
        return self.handle(Tick(), now_us)

    def handle(self, event: Event, now_us: int) -> list[Action]:
        """Apply `event` at `now_us`; return the actions to perform, in order."""
        self._validate(event, now_us)
        if self._now is None:
            self._frame_start = self._window_start = now_us
        self._now = now_us
        frames = (now_us - self._frame_start) // self._cfg.frame_us
        self._frame_start += frames * self._cfg.frame_us
        if isinstance(event, Submitted) and not self._tenants[event.tenant].priority:
            self._tenants[event.tenant].submitted = True
            return []  # the hardware finds best-effort work by itself
        preempt = self._apply(event, now_us)
        actions: list[Action] = []
        if self._stale or self.next_deadline() is not None:  # caps move with time
            actions = self._reconcile(now_us)
            self._stale = False
        if preempt and self._preempt_due(now_us):
            self._last_preempt = now_us
            actions += self._preempts()
        return actions

    # --- input ---------------------------------------------------------------

    def _validate(self, event: Event, now_us: int) -> None:
        check_now(now_us, self._now)
        if isinstance(event, Tick):
            return
        if isinstance(event, BusySample):
            self._check_sample(event)
            return
        if not isinstance(event, _TENANT_EVENTS):
            raise ValueError(f"not a planner event: {event!r}")
        if isinstance(event, Submitted):
            if not isinstance(event.tenant, str) or event.tenant not in self._tenants:
                raise ValueError(f"unknown tenant {event.tenant!r}")
            return
        check_tenant_event(event, self._tenants, self._cfg.cap_floor)

    def _check_sample(self, event: BusySample) -> None:
        busy = event.busy_us
        if not isinstance(busy, Mapping):
            raise ValueError(f"busy_us must be a mapping, got {busy!r}")
        for tid, value in busy.items():
            if tid not in self._tenants:
                raise ValueError(f"unknown tenant {tid!r} in a busy sample")
            if not is_int(value) or value < 0:
                raise ValueError(f"busy time must be a non-negative integer, got {value!r}")

    def _apply(self, event: Event, now: int) -> bool:
        """Update the state; True when a priority tenant has new work."""
        if not isinstance(event, BusySample | Tick):
            self._stale = True
        match event:
            case TenantAdded(tenant=tid, weight=weight, cap=cap, priority=priority):
                self._tenants[tid] = _Tenant(weight, cap, priority)
            case TenantRemoved(tenant=tid):
                for group in self._tenants.pop(tid).groups:
                    self._forget(tid, group)
            case Runnable(tenant=tid) | Submitted(tenant=tid):
                tenant = self._tenants[tid]
                tenant.submitted = True
                if tenant.priority and tenant.weight > 0:
                    tenant.active = True
                    return True
            case Idle():
                pass  # a priority tenant stays active until a quiet window closes
            case WeightChanged(tenant=tid, weight=weight):
                self._tenants[tid].weight = weight
            case CapChanged(tenant=tid, cap=cap):
                self._tenants[tid].cap = cap
            case PriorityChanged(tenant=tid, priority=priority):
                tenant = self._tenants[tid]
                tenant.priority = priority
                tenant.active = tenant.active and priority
            case GroupCreated(tenant=tid, group=group):
                self._tenants[tid].groups.add(group)
            case GroupFreed(tenant=tid, group=group):
                self._tenants[tid].groups.discard(group)
                self._forget(tid, group)
            case BusySample(busy_us=busy):
                self._sample(busy, now)
        return False

    def _forget(self, tid: str, group: int) -> None:
        self._slices.pop((tid, group), None)
        self._on.pop((tid, group), None)
        self._levels.pop((tid, group), None)

    # --- feedback ------------------------------------------------------------

    def _sample(self, busy: Mapping[str, int], now: int) -> None:
        for tid, tenant in self._tenants.items():
            value = busy.get(tid, tenant.busy_mark)
            if value > tenant.busy_mark:
                tenant.window_busy += value - tenant.busy_mark
                if tenant.priority and tenant.weight > 0 and not tenant.active:
                    tenant.active = self._stale = True  # it ran: a burst no poll caught
            tenant.busy_mark = value
        elapsed = now - self._window_start
        if elapsed <= 0 or elapsed < self._cfg.window_rounds * self._round_us():
            return
        self._correct(elapsed)
        self._window_start = now
        self._stale = True
        for tenant in self._tenants.values():
            if tenant.active and not tenant.window_busy and not tenant.submitted:
                tenant.active = False  # no Idle event: it ran and asked for nothing
            tenant.window_busy = 0
            tenant.submitted = False

    def _round_us(self) -> int:
        """A round as planned: every enabled group for its whole slice."""
        return sum(us for key, us in self._slices.items() if self._on.get(key))

    def _correct(self, elapsed: int) -> None:
        cfg = self._cfg
        tenants = self._tenants
        total = sum(t.window_busy for t in tenants.values())
        used = total >= (1 - cfg.idle_tolerance) * elapsed and not self._priority_active()
        nominal, unit = self._nominal(prio=False)
        # A tenant pinned at the minimum slice (its weight's slice is shorter) gets
        # a little more than its share whatever its boost: it is left out.
        comp = {tid: t for tid, t in tenants.items()
                if used and t.weight > 0 and t.cap is None and t.window_busy > 0 and t.groups
                and unit * nominal.get(tid, 0) >= cfg.min_timeslice_us}
        for tid, tenant in tenants.items():
            if tid not in comp:
                tenant.log_boost /= 2
        if not comp:
            return
        busy = sum(t.window_busy for t in comp.values())
        weight = sum(t.weight for t in comp.values())
        step = math.log(cfg.step_limit)
        floor = {tid: math.log(cfg.min_timeslice_us / (unit * nominal[tid])) for tid in comp}
        top = {tid: math.log(cfg.max_timeslice_us / (unit * nominal[tid])) for tid in comp}
        for tid, tenant in comp.items():
            target = busy * tenant.weight / weight
            turn = sum(self._slices.get((tid, g), 0) for g in tenant.groups)
            slack = cfg.deadband * target + turn  # a window's ends cut one turn at most
            if abs(tenant.window_busy - target) <= slack:
                continue
            move = -cfg.gain * max(-step, min(step, math.log(tenant.window_busy / target)))
            tenant.log_boost += move
        # Shift all so the largest boost is 1 (the others' slices shorten, which
        # serves yielding groups) but none below its floor (those lift the rest).
        shift = min(max(t.log_boost for t in comp.values()),
                    min(t.log_boost - floor[tid] for tid, t in comp.items()))
        low = min(t.log_boost for t in comp.values()) - shift
        spread = math.log(cfg.max_boost)
        for tid, tenant in comp.items():  # past its top a boost changes nothing: no wind-up
            ceiling = min(low + spread, max(top[tid], -spread))
            tenant.log_boost = min(ceiling, tenant.log_boost - shift)

    # --- plan ----------------------------------------------------------------

    def _priority_active(self) -> bool:
        return any(t.active and t.priority for t in self._tenants.values())

    def _enabled(self, tenant: _Tenant, now: int) -> bool:
        if tenant.weight == 0:
            return False
        if tenant.cap is None or tenant.cap >= 100:
            return True
        return now - self._frame_start < tenant.cap * self._cfg.frame_us // 100

    def _nominal(self, prio: bool) -> tuple[dict[str, float], float]:
        """w/g of each tenant planned by weight, and the unit (see the docstring)."""
        cfg = self._cfg
        nominal = {tid: t.weight / len(t.groups) for tid, t in self._tenants.items()
                   if t.groups and t.weight > 0 and not (prio and t.priority)}
        if not nominal:
            return nominal, 1.0
        low, high = min(nominal.values()), max(nominal.values())
        weight = sum(self._tenants[tid].weight for tid in nominal)  # a round is unit * weight
        if prio:  # the best-effort round bounds the priority group's wait: it wins over shares
            return nominal, min(cfg.short_slice_us / low, cfg.priority_round_us / weight)
        unit = min(cfg.base_slice_us / low, cfg.max_timeslice_us / high,
                   cfg.max_round_us / weight)
        pinned = cfg.min_timeslice_us / low  # the unit at which no slice is pinned
        while unit < pinned and self._floor_error(nominal, unit, weight) > cfg.floor_error:
            unit = min(pinned, unit * 1.25)
        return nominal, unit

    def _floor_error(self, nominal: dict[str, float], unit: float, weight: int) -> float:
        """The largest share (a fraction of the GPU) a saturating tenant loses at
        ``unit`` to the tenants whose slices it pins at the minimum: tenant i
        gets u * w_i / R of a round R = u * W + E, E the pinned slices' excess,
        so it loses w_i / W * E / R."""
        floor = self._cfg.min_timeslice_us
        excess = sum(len(self._tenants[tid].groups) * (floor - unit * x)
                     for tid, x in nominal.items() if unit * x < floor)
        heaviest = max(self._tenants[tid].weight for tid in nominal)
        return heaviest / weight * excess / (unit * weight + excess)

    def _plan(self) -> dict[tuple[str, int], int]:
        cfg = self._cfg
        prio = self._priority_active()
        plan: dict[tuple[str, int], int] = {}
        if prio:
            for tid, t in self._tenants.items():
                if t.priority and t.groups and t.weight > 0:
                    plan.update(dict.fromkeys(((tid, g) for g in t.groups),
                                              cfg.priority_slice_us))
        nominal, unit = self._nominal(prio)
        for tid, x in nominal.items():
            boost = math.exp(self._tenants[tid].log_boost)
            us = max(cfg.min_timeslice_us, min(cfg.max_timeslice_us, round(unit * x * boost)))
            plan.update(dict.fromkeys(((tid, g) for g in self._tenants[tid].groups), us))
        return plan

    def _reconcile(self, now: int) -> list[Action]:
        plan = self._plan()
        offs: list[Action] = []
        sets: list[Action] = []
        ons: list[Action] = []
        hyst = self._cfg.hysteresis_pct
        for tid in sorted(self._tenants):
            tenant = self._tenants[tid]
            enabled = self._enabled(tenant, now)
            turn_on: list[int] = []
            turn_off: list[int] = []
            level = LEVEL_HIGH if tenant.priority else LEVEL_MEDIUM
            for group in sorted(tenant.groups):
                key = (tid, group)
                want = plan.get(key)
                have = self._slices.get(key)
                if want is not None and (have is None or 100 * abs(want - have) > hyst * have):
                    self._slices[key] = want
                    sets.append(SetTimeslice(tid, group, want))
                if self._levels.get(key, LEVEL_MEDIUM) != level:
                    self._levels[key] = level
                    sets.append(SetInterleave(tid, group, level))
                if self._on.get(key) != enabled:
                    self._on[key] = enabled
                    (turn_on if enabled else turn_off).append(group)
            if turn_off:
                offs.append(GroupsOff(tid, tuple(turn_off)))
            if turn_on:
                ons.append(GroupsOn(tid, tuple(turn_on)))
        return offs + sets + ons

    def _preempt_due(self, now: int) -> bool:
        last = self._last_preempt
        return last is None or now - last >= self._cfg.preempt_holdoff_us

    def _preempts(self) -> list[Action]:
        return [Preempt(tid, tuple(sorted(g for g in t.groups if self._on.get((tid, g)))))
                for tid, t in sorted(self._tenants.items())
                if not t.priority and any(self._on.get((tid, g)) for g in t.groups)]
