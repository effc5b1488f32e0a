"""SchedulerService in virtual time: a fake clock, virtual timers, a recording actuator."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.sched_world import MS, FakeSource, World, settle
from vgpud.core.groups import Group
from vgpud.core.shares import SharesChanged, target_shares
from vgpud.kernel.uapi import Sched, SchedResult, SchedState
from vgpud.sched.actuator import ModuleActuator

GIB = 2**30


@pytest.fixture
def w(tmp_path: Path) -> World:
    return World(tmp_path)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_groups_before_start_are_switched_at_start(w: World) -> None:
    async def main() -> None:
        ga = w.group("a")
        gb = w.group("b")
        assert w.actuator.calls == []
        w.service.start(w.actuator)
        await settle()
        # a was picked when its group came (runnable without a source): b's goes off
        entries = [e for _, es in w.actuator.calls for e in es]
        assert Sched(gb.ctx, gb.client, gb.handle, False) in entries
        assert Sched(ga.ctx, ga.client, ga.handle, False) not in entries
        await w.service.stop()

    run(main())


def test_saturating_tenants_get_their_weights(w: World) -> None:
    async def main() -> None:
        w.service.start(w.actuator)
        groups = {t: [w.group(t), w.group(t)] for t in "abc"}
        await settle()  # new groups run until their off lands: measure from here
        w.actuator.most_clients_on = 0
        start = w.clock.now
        await w.timers.run_until(start + 10_000 * MS)
        on = w.on_time(start, w.clock.now)
        for t, weight in zip("abc", (50, 30, 20), strict=True):
            first, second = (on.get((g.client, g.handle), 0) for g in groups[t])
            assert first == second  # a tenant's groups go on and off together
            assert first / (10_000 * MS) == pytest.approx(weight / 100, abs=0.01), t
        # every plan: the outgoing groups off before the incoming on, in one call
        for _, entries in w.actuator.calls:
            flags = [e.enable for e in entries]
            assert flags == sorted(flags), entries
        assert w.actuator.most_clients_on == 1  # never two tenants on at once
        await w.service.stop()

    run(main())


def test_group_created_outside_its_slot_goes_off_at_once(w: World) -> None:
    async def main() -> None:
        w.service.start(w.actuator)
        w.group("a")
        await settle()
        calls = len(w.actuator.calls)
        late = w.group("b")
        await settle()
        assert w.actuator.calls[calls:] == [(w.clock.now, [Sched(late.ctx, late.client,
                                                                  late.handle, False)])]
        await w.service.stop()

    run(main())


def test_stop_turns_every_group_back_on(w: World) -> None:
    async def main() -> None:
        w.service.start(w.actuator)
        groups = [w.group(t) for t in "abc"]
        await w.timers.run_until(w.clock.now + 30 * MS)
        await w.service.stop()
        _, last = w.actuator.calls[-1]
        assert sorted(last) == sorted(Sched(g.ctx, g.client, g.handle, True) for g in groups)

    run(main())


def test_freed_groups_leave_and_idle_tenants_give_way(w: World) -> None:
    async def main() -> None:
        w.service.start(w.actuator)
        ga, gb = w.group("a"), w.group("b")
        await settle()  # their first states: a on, b off
        await w.timers.run_until(w.clock.now + 50 * MS)
        w.tracker.freed(ga.client, ga.handle)  # a has no group left: idle
        await settle()
        start = w.clock.now
        await w.timers.run_until(start + 500 * MS)
        on = w.on_time(start, w.clock.now)
        assert on.get((gb.client, gb.handle), 0) == 500 * MS
        assert all(e.h_object != ga.handle for t, es in w.actuator.calls if t >= start
                   for e in es)
        await w.service.stop()

    run(main())


def test_a_group_its_owner_paused_stays_off_until_resumed(w: World) -> None:
    async def main() -> None:
        w.service.start(w.actuator)
        ga, gb = w.group("a"), w.group("b")
        await settle()
        w.tracker.set_paused(ga, True)
        await settle()
        # off for good first, then a (no schedulable group left) gives way to b
        assert [es for _, es in w.actuator.calls[-2:]] == [
            [Sched(ga.ctx, ga.client, ga.handle, SchedState.OWNER_OFF)],
            [Sched(gb.ctx, gb.client, gb.handle, True)]]
        start = w.clock.now
        await w.timers.run_until(start + 300 * MS)  # a has no schedulable group: b runs
        assert all(e.h_object != ga.handle for t, es in w.actuator.calls if t > start
                   for e in es)
        assert w.on_time(start, w.clock.now).get((gb.client, gb.handle), 0) == 300 * MS
        w.tracker.set_paused(ga, False)  # back to the scheduler: off until a's slot
        await w.timers.run_until(w.clock.now + 300 * MS)
        assert w.on_time(start + 300 * MS, w.clock.now).get((ga.client, ga.handle), 0) > 0
        w.tracker.set_paused(ga, True)
        await settle()
        await w.service.stop()  # the paused group is its owner's: not turned on
        assert w.actuator.calls[-1][1] == [Sched(gb.ctx, gb.client, gb.handle, True)]

    run(main())


def test_a_group_of_a_tenant_the_scheduler_lacks_is_left_on(w: World) -> None:
    async def main() -> None:
        w.service.start(w.actuator)
        stray = Group(9, "nobody", 0, 0xE0, 0x900, 0x10, 1)
        w.tracker.add(stray)  # the module made it off: it must not stay off
        await settle()
        assert w.actuator.calls[-1][1] == [Sched(9, 0xE0, 0x900, SchedState.ON)]
        await w.service.stop()

    run(main())


def test_activity_drives_runnable_and_idle(tmp_path: Path) -> None:
    source = FakeSource()
    w = World(tmp_path, activity=source)

    async def main() -> None:
        w.service.start(w.actuator)
        groups = {t: w.group(t) for t in "abc"}
        await settle()
        assert w.service.running() == {0: None, 1: None}  # nobody has work yet
        source.runnable = {(0, "a"), (0, "b"), (0, "c")}
        await w.service.poll()
        start = w.clock.now
        await w.timers.run_until(start + 2_000 * MS)
        # c goes idle: a and b split its time 50:30 from the next switch on
        source.runnable = {(0, "a"), (0, "b")}
        await w.service.poll()
        idle_at = w.clock.now
        await w.timers.run_until(idle_at + 3_000 * MS)
        on = w.on_time(idle_at + 100 * MS, w.clock.now)
        total = 2_900 * MS
        share = {t: on.get((g.client, g.handle), 0) / total for t, g in groups.items()}
        assert share["c"] == 0
        assert share["a"] == pytest.approx(50 / 80, abs=0.02)
        assert share["b"] == pytest.approx(30 / 80, abs=0.02)
        assert source.switched_on[-1][0] in ({"a"}, {"b"})
        await w.service.stop()

    run(main())


def test_shares_published_once_per_change(tmp_path: Path) -> None:
    source = FakeSource()
    w = World(tmp_path, activity=source)
    heard: list[list[str]] = []

    class Observer:
        def notify(self, event: SharesChanged) -> None:
            heard.append(list(event.tenants))

    w.service.observers.subscribe(Observer())

    async def main() -> None:
        w.service.start(w.actuator)
        for t in "abc":
            w.group(t)
        source.runnable = {(0, "a"), (0, "b")}
        await w.service.poll()
        source.busy = {(0, "a"): 0, (0, "b"): 0}
        w.service.publish_shares()
        heard.clear()
        w.clock.now += 1_000 * MS
        source.busy = {(0, "a"): 600 * MS, (0, "b"): 350 * MS}
        await w.service.poll()
        w.service.publish_shares()
        assert w.service.share("a") == {0: 62.5}
        assert w.service.share("b") == {0: 37.5}
        assert w.service.share("c") == {}
        assert w.service.measured_share("a") == {0: 60.0}
        assert w.service.measured_share("b") == {0: 35.0}
        assert heard == [["a", "b"]]
        w.clock.now += 1_000 * MS
        source.busy = {(0, "a"): 1200 * MS, (0, "b"): 700 * MS}
        await w.service.poll()
        w.service.publish_shares()
        assert heard == [["a", "b"]]  # nothing moved: nothing said
        await w.service.stop()

    run(main())


@pytest.mark.parametrize("how", ["dbus", "reload"])
def test_weight_change_applies_at_the_next_frame(w: World, how: str) -> None:
    async def main() -> None:
        w.service.start(w.actuator)
        ga, gb = w.group("a"), w.group("b")
        await w.timers.run_until(w.clock.now + 1_000 * MS)
        if how == "dbus":  # what SetWeight does
            w.manager.update_tenant("b", {"weight": 150})  # a 50 : b 150
        else:
            path = w.manager.config_path
            path.write_text(path.read_text().replace("weight = 30", "weight = 150"))
            w.manager.reload()
        frame_end = w.service._gpus[0].core.frame_end_us
        assert frame_end is not None
        start = w.service._t0 + frame_end * 1000  # from the next frame boundary on
        await w.timers.run_until(start + 2_000 * MS)
        on = w.on_time(start, w.clock.now)
        assert on[(gb.client, gb.handle)] / (2_000 * MS) == pytest.approx(0.75, abs=0.02)
        assert on[(ga.client, ga.handle)] / (2_000 * MS) == pytest.approx(0.25, abs=0.02)
        await w.service.stop()

    run(main())


def test_tenants_added_and_removed_follow_the_manager(w: World) -> None:
    async def main() -> None:
        w.service.start(w.actuator)
        w.manager.create_tenant("d", {"weight": 10, "cap": 1})  # cap raised to 3%
        gd = w.group("d")
        ga = w.group("a")
        start = w.clock.now
        await w.timers.run_until(start + 2_000 * MS)
        on = w.on_time(start, w.clock.now)
        assert on[(gd.client, gd.handle)] / (2_000 * MS) == pytest.approx(0.03, abs=0.01)
        assert on[(ga.client, ga.handle)] / (2_000 * MS) == pytest.approx(0.97, abs=0.01)
        w.tracker.freed(gd.client, gd.handle)
        w.manager.delete_tenant("d")
        assert "d" not in w.service._tenants
        assert w.service.stats.rejected == 0
        await w.service.stop()

    run(main())


def test_target_shares_fill_caps() -> None:
    assert target_shares({}) == {}
    assert target_shares({"a": (1, None), "b": (3, None)}) == {"a": 25.0, "b": 75.0}
    assert target_shares({"a": (1, None), "b": (3, 50)}) == {"a": 50.0, "b": 50.0}
    assert target_shares({"a": (1, 10), "b": (1, 20)}) == {"a": 10.0, "b": 20.0}
    assert target_shares({"a": (0, None), "b": (5, None)}) == {"a": 0.0, "b": 100.0}


class FakeChannel:
    def __init__(self, results: Callable[[Sequence[Sched]], list[SchedResult]]) -> None:
        self.results = results
        self.calls: list[list[Sched]] = []

    async def schedule(self, entries: Sequence[Sched]) -> list[SchedResult]:
        self.calls.append(list(entries))
        return self.results(entries)


def test_module_actuator_chunks_checks_and_counts() -> None:
    def results(entries: Sequence[Sched]) -> list[SchedResult]:
        out = []
        for e in entries:
            if e.h_object == 1:
                out.append(SchedResult(-2, 0))  # ENOENT: the context closed
            elif e.h_object == 2:
                out.append(SchedResult(0, 0x33))  # the group was freed
            elif e.h_object == 3:
                out.append(SchedResult(0, 0x1F))  # a real failure
            else:
                out.append(SchedResult(0, 0))
        return out

    channel = FakeChannel(results)
    actuator = ModuleActuator(channel)
    entries = [Sched(1, 0xC, h, h % 2 == 0) for h in range(600)]
    run(actuator.apply(entries))
    assert [len(c) for c in channel.calls] == [256, 256, 88]
    assert [e for c in channel.calls for e in c] == entries
    s = actuator.stats
    assert (s.calls, s.entries, s.gone, s.failed, s.errors) == (3, 600, 2, 1, 0)
    assert len(s.latency_ns) == 3

    channel.results = lambda entries: []  # a short answer: all failed
    run(actuator.apply(entries[:3]))
    assert s.failed == 4

    class Broken:
        async def schedule(self, entries: Sequence[Sched]) -> list[SchedResult]:
            raise OSError("channel closed")

    broken = ModuleActuator(Broken())
    run(broken.apply(entries[:3]))
    assert broken.stats.errors == 1
