"""The TDMA scheduler, driven in virtual time: properties with hypothesis, plus edge cases."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpud.core.tdma import (
    MAX_WEIGHT,
    Action,
    CapChanged,
    Event,
    GroupCreated,
    GroupFreed,
    GroupsOff,
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

F = 50_000
M = 2_048
PP = 0.01  # one percentage point
SETTINGS = settings(max_examples=60, deadline=None)


class Sim:
    """Drives a scheduler as the daemon would and checks every plan it returns.

    Run intervals are recorded from `running` around each call, and the actions
    are checked against it, so the checks do not use the scheduler's accounting.
    """

    def __init__(self, config: TdmaConfig | None = None) -> None:
        self.s = TdmaScheduler(config)
        self.now = 0
        self.on: str | None = None
        self.on_since = 0
        self.slots: list[tuple[str, int, int]] = []
        self.ons: list[tuple[str, int]] = []
        self.removed: set[str] = set()
        self.groups = 0

    def do(self, event: Event, now: int | None = None) -> list[Action]:
        now = self.now if now is None else now
        actions = self.s.handle(event, now)
        self.now = now
        running = self.s.running
        ons = [a for a in actions if isinstance(a, GroupsOn)]
        assert len(ons) <= 1 and all(a.tenant == running for a in ons), actions
        offs = [a for a in actions if isinstance(a, GroupsOff)]
        assert actions == offs + ons, f"outgoing after incoming in {actions}"
        assert all(a.tenant not in self.removed for a in actions)
        if running != self.on:
            if self.on is not None:
                assert any(a.tenant == self.on for a in offs) or not self.groups_of(self.on)
                self.slots.append((self.on, self.on_since, now))
            if running is not None:
                assert ons or not self.s._tenants[running].groups
                self.ons.append((running, now))
            self.on, self.on_since = running, now
        if isinstance(event, TenantRemoved):
            self.removed.add(event.tenant)
        return actions

    def groups_of(self, tid: str) -> set[int]:
        tenant = self.s._tenants.get(tid)
        return set() if tenant is None else tenant.groups

    def add(
        self,
        tid: str,
        weight: int = 1,
        cap: int | None = None,
        priority: bool = False,
        runnable: bool = True,
    ) -> None:
        self.do(TenantAdded(tid, weight, cap, priority))
        self.groups += 1
        self.do(GroupCreated(tid, self.groups))
        if runnable:
            self.do(Runnable(tid))

    def run_until(self, t: int) -> None:
        while (deadline := self.s.next_deadline()) is not None and deadline <= t:
            assert deadline > self.now or deadline == self.now == 0
            self.do(Tick(), deadline)
        self.now = t

    def run_late(self, lateness: list[int]) -> list[tuple[int, int]]:
        """Serve the next deadlines late, by each of `lateness` in turn, as a daemon
        descheduled would; returns (when served, how late) for each."""
        served = []
        for late in lateness:
            deadline = self.s.next_deadline()
            assert deadline is not None
            self.do(Tick(), deadline + late)
            served.append((deadline + late, late))
        return served

    def all_slots(self) -> list[tuple[str, int, int]]:
        open_slot = [] if self.on is None else [(self.on, self.on_since, self.now)]
        return self.slots + open_slot

    def usage(self, start: int, end: int) -> dict[str, int]:
        used: dict[str, int] = {}
        for tid, a, b in self.all_slots():
            if min(b, end) > max(a, start):
                used[tid] = used.get(tid, 0) + min(b, end) - max(a, start)
        return used

    def starts(self, tid: str) -> list[tuple[int, int]]:
        return [(a, b) for t, a, b in self.all_slots() if t == tid]


def saturating(weights: list[int], **kw: int) -> Sim:
    sim = Sim(TdmaConfig(**kw) if kw else None)
    for i, w in enumerate(weights):
        sim.add(f"t{i:02}", w)
    return sim


def visits_to_min(weight: int, total: int) -> int:
    """k_i of the module docstring."""
    return math.ceil(M * total / (weight * F))


weights_st = st.lists(st.integers(1, 1000), min_size=1, max_size=16)


# --- properties -------------------------------------------------------------


@SETTINGS
@given(weights_st)
def test_shares_converge_to_weights(weights: list[int]) -> None:
    sim = saturating(weights)
    sim.run_until(100 * F)
    used = sim.usage(0, 100 * F)
    assert sum(used.values()) == 100 * F  # work-conserving
    total = sum(weights)
    for i, w in enumerate(weights):
        assert abs(used.get(f"t{i:02}", 0) / (100 * F) - w / total) <= PP


@SETTINGS
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=64), st.integers(0, 40 * F))
def test_no_starvation_within_documented_bound(weights: list[int], wake: int) -> None:
    """Once the runnable set is fixed (from `wake`): gaps between a tenant's slots are at
    most k*F + (n-1)*M, and a tenant becoming runnable starts within (k+1)*F + n*M."""
    sim = saturating(weights[:-1])
    late = f"t{len(weights) - 1:02}"
    sim.add(late, weights[-1], runnable=False)
    sim.run_until(wake)
    sim.do(Runnable(late))
    horizon = wake + 60 * F
    sim.run_until(horizon)
    n, total = len(weights), sum(weights)
    for i, w in enumerate(weights):
        tid = f"t{i:02}"
        k = visits_to_min(w, total)
        slots = sim.starts(tid)
        first = slots[0][0] if slots else horizon
        assert first - (wake if tid == late else 0) <= (k + 1) * F + n * M
        nexts = [a for a, _ in slots[1:]] + [horizon] if slots else []
        for (_, end), nxt in zip(slots, nexts, strict=True):
            # A slot that ends as `late` wakes was planned before: the gap
            # after it straddles the change, as one ending a microsecond earlier.
            if end > wake:
                assert nxt - end <= k * F + (n - 1) * M, (tid, end, nxt)


@SETTINGS
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=32),
       st.lists(st.integers(0, 3 * F), min_size=1, max_size=40))
def test_late_wakeups_delay_a_turn_by_their_lateness_only(
    weights: list[int], lateness: list[int]
) -> None:
    """Deadlines served late: a gap between a tenant's slots is at most the bound plus
    the lateness served within it (the overrun is a debt, not a lost turn)."""
    sim = saturating(weights)
    sim.run_until(3 * F)
    served = sim.run_late(lateness)
    n, total = len(weights), sum(weights)
    horizon = sim.now + (max(visits_to_min(w, total) for w in weights) + 2) * F + n * M
    sim.run_until(horizon)
    for i, w in enumerate(weights):
        slots = sim.starts(f"t{i:02}")
        assert slots
        nexts = [a for a, _ in slots[1:]] + [horizon]
        for (_, end), nxt in zip(slots, nexts, strict=True):
            extra = sum(late for when, late in served if end < when <= nxt)
            bound = visits_to_min(w, total) * F + (n - 1) * M
            assert nxt - end <= bound + extra, (i, end, nxt, extra)


def test_a_stall_is_paid_back_without_skipping_a_turn() -> None:
    """16 equal tenants, frame 100 ms: one tick 50 ms late (the VM tier's failure). The
    tenant that ran on still runs in every frame, and pays back from its slots."""
    sim = saturating([1] * 16, frame_us=100_000)
    sim.run_until(1_000_000)
    late = sim.s.running
    assert late is not None
    (stall,) = sim.run_late([50_000])
    sim.run_until(stall[0] + 20 * 100_000)
    slots = [(a, b) for a, b in sim.starts(late) if a >= stall[0]]
    assert len(slots) == 20  # one per frame: no turn skipped
    assert all(b - a >= M for a, b in slots)
    assert sum(b - a for a, b in slots) == 20 * 100_000 // 16 - 50_000  # paid back in full
    assert sim.s._tenants[late].debt == 0


@SETTINGS
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=16))
def test_wait_under_one_frame_when_every_share_fits_a_min_slot(weights: list[int]) -> None:
    total = sum(weights)
    if min(weights) * F < M * total:
        weights = [max(weights)] * min(len(weights), F // M)
    sim = saturating(weights)
    sim.run_until(30 * F)
    for i in range(len(weights)):
        slots = sim.starts(f"t{i:02}")
        for (_, end), (start, _) in itertools.pairwise(slots):
            assert start - end < F


@SETTINGS
@given(st.lists(st.integers(1, 1000), min_size=2, max_size=8), st.data())
def test_idle_tenant_time_goes_to_runnable_by_weight(
    weights: list[int], data: st.DataObject
) -> None:
    sim = saturating(weights)
    sleeper = data.draw(st.integers(0, len(weights) - 1))
    t0 = data.draw(st.integers(0, 10 * F))
    sim.run_until(t0)
    sim.do(Idle(f"t{sleeper:02}"))
    sim.run_until(t0 + 101 * F)
    used = sim.usage(t0 + F, t0 + 101 * F)
    rest = sum(w for i, w in enumerate(weights) if i != sleeper)
    for i, w in enumerate(weights):
        share = used.get(f"t{i:02}", 0) / (100 * F)
        assert abs(share - (0 if i == sleeper else w / rest)) <= PP


tenant_st = st.tuples(
    st.integers(0, 1000), st.one_of(st.none(), st.integers(5, 100)), st.booleans()
)


@SETTINGS
@given(st.lists(tenant_st, min_size=1, max_size=6))
def test_caps_hold_in_every_frame(tenants: list[tuple[int, int | None, bool]]) -> None:
    sim = Sim()
    for i, (w, cap, runnable) in enumerate(tenants):
        sim.add(f"t{i}", w, cap, runnable=runnable)
    sim.run_until(20 * F)
    uncapped_busy = any(w and cap is None and r for w, cap, r in tenants)
    for frame in range(20):
        used = sim.usage(frame * F, (frame + 1) * F)
        for i, (_, cap, _) in enumerate(tenants):
            if cap is not None:
                assert used.get(f"t{i}", 0) <= cap * F // 100
        if uncapped_busy:
            assert sum(used.values()) == F


@SETTINGS
@given(
    st.lists(st.integers(1, 1000), min_size=1, max_size=8),
    st.integers(1, 1000),
    st.integers(0, 20 * F),
)
def test_priority_work_runs_at_the_next_switch(weights: list[int], pw: int, when: int) -> None:
    """It preempts the best-effort slot as soon as that slot has run one min slot."""
    sim = saturating(weights)
    sim.add("prio", pw, priority=True, runnable=False)
    sim.run_until(when)
    since, switches = sim.on_since, len(sim.ons)
    sim.do(Runnable("prio"))
    sim.run_until(when + 2 * F)
    assert sim.ons[switches] == ("prio", max(when, since + M))


@SETTINGS
@given(st.lists(st.integers(1, 1000), min_size=2, max_size=6), st.data())
def test_weight_change_applies_at_next_frame(weights: list[int], data: st.DataObject) -> None:
    """Nothing changes before the next frame boundary; the new shares hold after it."""
    who = data.draw(st.integers(0, len(weights) - 1))
    new = data.draw(st.integers(1, 1000))
    when = data.draw(st.integers(0, 20 * F))
    changed, control = saturating(weights), saturating(weights)
    for sim in (changed, control):
        sim.run_until(when)
    changed.do(WeightChanged(f"t{who:02}", new))
    boundary = (when // F + 1) * F
    for sim in (changed, control):
        sim.run_until(boundary + 101 * F)
    before = [x for x in control.ons if x[1] < boundary]
    assert [x for x in changed.ons if x[1] < boundary] == before
    weights[who] = new
    used = changed.usage(boundary + F, boundary + 101 * F)
    for i, w in enumerate(weights):
        assert abs(used.get(f"t{i:02}", 0) / (100 * F) - w / sum(weights)) <= PP


@SETTINGS
@given(
    st.lists(st.integers(1, 1000), min_size=1, max_size=6),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3 * F)), max_size=20),
)
def test_a_new_group_gets_its_tenant_state_at_once(
    weights: list[int], creations: list[tuple[int, int]]
) -> None:
    sim = saturating(weights)
    for n, (who, dt) in enumerate(creations):
        tid = f"t{who % len(weights):02}"
        sim.run_until(sim.now + dt)
        state = GroupsOn if sim.on == tid else GroupsOff
        assert sim.do(GroupCreated(tid, 1000 + n)) == [state(tid, (1000 + n,))]


@SETTINGS
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=8), st.integers(0, 10 * F))
def test_removing_the_running_tenant_mid_slot_is_safe(weights: list[int], when: int) -> None:
    sim = saturating(weights)
    sim.run_until(when)
    victim = sim.on
    assert victim is not None
    actions = sim.do(TenantRemoved(victim))
    assert isinstance(actions[0], GroupsOff) and actions[0].tenant == victim
    sim.run_until(when + 101 * F)
    rest = {f"t{i:02}": w for i, w in enumerate(weights) if f"t{i:02}" != victim}
    used = sim.usage(when + F, when + 101 * F)
    assert victim not in used
    for tid, w in rest.items():
        assert abs(used.get(tid, 0) / (100 * F) - w / sum(rest.values())) <= PP
    if not rest:
        assert sim.on is None and sim.s.next_deadline() is None


def _event(draw: st.DrawFn, tids: list[str]) -> Event:
    tid = draw(st.sampled_from(tids))
    return draw(
        st.sampled_from(
            [
                TenantAdded(
                    tid,
                    draw(st.integers(0, 50)),
                    draw(st.sampled_from([None, 10, 50])),
                    draw(st.booleans()),
                ),
                TenantRemoved(tid),
                Runnable(tid),
                Runnable(tid),
                Idle(tid),
                WeightChanged(tid, draw(st.integers(0, 50))),
                CapChanged(tid, draw(st.sampled_from([None, 5, 30, 100]))),
                PriorityChanged(tid, draw(st.booleans())),
                GroupCreated(tid, draw(st.integers(0, 3))),
                GroupFreed(tid, draw(st.integers(0, 3))),
            ]
        )
    )


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_event_streams_keep_invariants(data: st.DataObject) -> None:
    """Any stream: valid plans, only runnable weighted tenants run, caps hold per frame."""
    sim = Sim()
    sim.do(Tick(), 0)
    lives: dict[str, list[tuple[int, int]]] = {}  # tenant -> [(added, removed)]
    caps: dict[str, list[tuple[int, int | None]]] = {}  # tenant -> (in force from, cap)
    for _ in range(data.draw(st.integers(1, 60))):
        sim.run_until(sim.now + data.draw(st.integers(0, F)))
        event = _event(data.draw, ["a", "b", "c", "d"])
        try:
            sim.do(event)
        except ValueError:
            continue
        tid = getattr(event, "tenant", "")
        if isinstance(event, TenantAdded):
            sim.removed.discard(tid)
            lives.setdefault(tid, []).append((sim.now, 10**12))
            caps[tid] = [(sim.now, event.cap)]
        elif isinstance(event, TenantRemoved):
            lives[tid][-1] = (lives[tid][-1][0], sim.now)
        elif isinstance(event, CapChanged):
            caps[tid].append(((sim.now // F + 1) * F, event.cap))
        if sim.on is not None:
            tenant = sim.s._tenants[sim.on]
            assert tenant.runnable and tenant.conf.weight > 0
    sim.run_until(sim.now + 2 * F)
    for frame in range(sim.now // F):
        start, end = frame * F, (frame + 1) * F
        used = sim.usage(start, end)
        for tid, spans in lives.items():
            here = [(a, r) for a, r in spans if a < end and r > start]
            if len(here) != 1 or here[0] != spans[-1]:
                continue  # caps are per life: check frames that hold one life, the last
            cap = [c for t, c in caps[tid] if t <= max(start, here[0][0])][-1]
            if cap is not None:
                assert used.get(tid, 0) <= cap * F // 100, (tid, frame)


# --- edge cases ---------------------------------------------------------------


def test_zero_tenants() -> None:
    s = TdmaScheduler()
    assert s.next_deadline() is None and s.frame_end_us is None
    assert s.tick(0) == [] and s.tick(10 * F) == []
    assert s.next_deadline() is None and s.running is None


def test_one_tenant_runs_without_switches() -> None:
    sim = saturating([7])
    assert sim.s.running == "t00"
    switches = 0
    while sim.now < 100 * F:
        switches += len(sim.do(Tick(), sim.s.next_deadline()))
    assert switches == 0 and sim.usage(0, sim.now) == {"t00": sim.now}


def test_all_idle_turns_everything_off() -> None:
    sim = saturating([1, 2, 3])
    sim.run_until(F // 3)
    for tid in ("t00", "t01", "t02"):
        sim.do(Idle(tid))
    assert sim.on is None and sim.s.next_deadline() is None
    assert sim.do(Tick(), 10 * F) == []
    assert sum(sim.usage(0, sim.now).values()) == F // 3


def test_capped_tenant_alone_leaves_the_rest_idle() -> None:
    sim = Sim()
    sim.add("a", 1, cap=30)
    sim.run_until(10 * F)
    for frame in range(10):
        assert sim.usage(frame * F, (frame + 1) * F) == {"a": 3 * F // 10}


def test_weight_extremes() -> None:
    sim = saturating([1, MAX_WEIGHT])
    sim.run_until(1000 * F)
    small = sim.usage(0, 1000 * F)["t00"]
    assert small == F  # alone at first; then one min slot every ~2048 s
    sim.do(WeightChanged("t01", 0))
    assert sim.on == "t01"  # applies at the frame boundary
    sim.run_until(1002 * F)
    assert sim.on == "t00" and sim.usage(1001 * F, 1002 * F) == {"t00": F}
    sim.do(WeightChanged("t00", 0))
    sim.run_until(1004 * F)
    assert sim.on is None and sim.s.next_deadline() is None


def test_weight_zero_tenant_never_runs() -> None:
    sim = saturating([0, 1])
    sim.run_until(10 * F)
    assert sim.usage(0, 10 * F) == {"t01": 10 * F}


def test_late_tick_is_paid_back() -> None:
    sim = saturating([1, 1])
    sim.do(Tick(), F + 10_000)  # the daemon woke 10 ms late
    sim.run_until(3 * F)
    assert sim.starts("t00")[:2] == [(0, F + 10_000), (F + 10_000 + F // 2, 2 * F)]


def test_group_created_by_running_tenant_is_on_and_freed_groups_are_dropped() -> None:
    sim = saturating([1, 1])
    assert sim.do(GroupCreated("t00", 99)) == [GroupsOn("t00", (99,))]
    assert sim.do(GroupFreed("t00", 1)) == []
    assert sim.do(Tick(), F) == [GroupsOff("t00", (99,)), GroupsOn("t01", (2,))]


def test_removing_an_idle_tenant_needs_no_action() -> None:
    sim = saturating([1, 1])
    assert sim.do(TenantRemoved("t01")) == []
    sim.run_until(2 * F)
    assert sim.usage(0, 2 * F) == {"t00": 2 * F}


def test_sixty_four_tenants_take_turns_of_three_quanta() -> None:
    sim = saturating([1] * 64)
    sim.run_until(40 * F)
    lengths = {b - a for _, a, b in sim.slots if a >= F}  # t00 ran alone before
    assert lengths == {3 * F // 64, 3 * F // 64 + 1}


@pytest.mark.parametrize(
    "event",
    [
        TenantAdded("t00"),
        TenantAdded("", 1),
        TenantAdded("x", -1),
        TenantAdded("x", MAX_WEIGHT + 1),
        TenantAdded("x", True),
        TenantAdded("x", 1, cap=4),
        TenantAdded("x", 1, cap=101),
        TenantAdded("x", 1, cap=50.0),  # type: ignore[arg-type]
        TenantAdded("x", 1, priority=1),  # type: ignore[arg-type]
        TenantRemoved("nobody"),
        Runnable("nobody"),
        Idle("nobody"),
        WeightChanged("t00", 2.5),  # type: ignore[arg-type]
        CapChanged("t00", 0),
        PriorityChanged("t00", None),  # type: ignore[arg-type]
        GroupCreated("t00", 1),
        GroupCreated("t00", -1),
        GroupFreed("t00", 7),
        "tick",  # type: ignore[list-item]
    ],
)
def test_invalid_input_raises_and_changes_nothing(event: Event) -> None:
    sim = saturating([1])
    sim.s.tick(F // 3)
    before = copy.deepcopy(sim.s.__dict__)
    with pytest.raises(ValueError) as err:
        sim.s.handle(event, F // 2)
    assert str(err.value)
    assert sim.s.__dict__ == before


def test_time_going_backwards_is_refused() -> None:
    s = TdmaScheduler()
    s.tick(100)
    with pytest.raises(ValueError, match="backwards"):
        s.tick(99)
    with pytest.raises(ValueError, match="non-negative"):
        s.tick(-1)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"min_slot_us": 2047}, "two hardware time slices"),
        ({"frame_us": 1000}, "shorter than min_slot_us"),
        ({"frame_us": 0}, "positive"),
        ({"hw_timeslice_us": 2000}, "two hardware time slices"),
    ],
)
def test_config_is_validated(kw: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TdmaConfig(**kw)


def test_configurable_frame_and_min_slot() -> None:
    sim = saturating([1, 1, 1, 1], frame_us=10_000, min_slot_us=4_096, hw_timeslice_us=2_048)
    sim.run_until(100_000)
    assert {b - a for _, a, b in sim.slots if a >= 10_000} == {5_000}  # 2 quanta of 2500
