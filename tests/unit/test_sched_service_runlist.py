"""SchedulerService in runlist mode, in virtual time: timeslices by weight, the
feedback from busy time, priority interleave levels and preemption, caps,
pausing, the fallback to frame mode when the driver refuses a timeslice, and
what stop restores."""

from __future__ import annotations

import asyncio
import errno
import logging
from pathlib import Path
from typing import Any

import pytest

from tests.support.sched_world import MS, RUNLIST_CONFIG, FakeSource, World, settle
from vgpud.core.groups import Group
from vgpud.kernel.uapi import Sched, SchedResult, SchedState
from vgpud.sched.service import RUNLIST_POLL

TS, PREEMPT, LEVEL = SchedState.TIMESLICE, SchedState.PREEMPT, SchedState.INTERLEAVE
ORDER = {SchedState.OFF: 0, TS: 1, LEVEL: 1, SchedState.ON: 2, PREEMPT: 3}  # the planner's


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def world(tmp: Path, source: FakeSource | None = None) -> World:
    return World(tmp, activity=source, config=RUNLIST_CONFIG)


def ts(g: Group, us: int) -> Sched:
    return Sched(g.ctx, g.client, g.handle, TS, us)


def on(g: Group) -> Sched:
    return Sched(g.ctx, g.client, g.handle, SchedState.ON)


def entries_since(w: World, call: int) -> list[Sched]:
    return [e for _, es in w.actuator.calls[call:] for e in es]


def test_timeslices_follow_the_weights_and_groups_stay_on(tmp_path: Path) -> None:
    w = world(tmp_path)

    async def main() -> None:
        w.service.start(w.actuator)
        a1, a2, b, c = w.group("a"), w.group("a"), w.group("b"), w.group("c")
        await settle()
        # w/g: a 50/2, b 30, c 20; the smallest (c) gets the driver's 1024 us
        assert w.actuator.timeslice == {(g.client, g.handle): us for g, us in (
            (a1, 1280), (a2, 1280), (b, 1536), (c, 1024))}
        for _, entries in w.actuator.calls:  # a group gets its slice, then goes on
            ranks = [ORDER[SchedState(e.enable)] for e in entries]
            assert ranks == sorted(ranks), entries
            assert {e.h_object for e in entries if e.enable == SchedState.ON} <= {
                e.h_object for e in entries if e.enable == TS}
        assert not any(e.enable in (SchedState.OFF, PREEMPT)
                       for _, es in w.actuator.calls for e in es)
        assert w.service.modes() == {0: "runlist", 1: "runlist"}
        assert w.service.running() == {0: None, 1: None}
        # what an activity source can see run: every tenant at once
        assert w.service.switched_on() == {0: {"a", "b", "c"}, 1: frozenset()}
        assert w.service.timeslices("a") == {0: [1280, 1280]}
        w.service.publish_shares()
        assert [w.service.share(t) for t in "abc"] == [{0: 50.0}, {0: 30.0}, {0: 20.0}]
        calls = len(w.actuator.calls)
        await w.timers.run_until(w.clock.now + 10_000 * MS)
        assert len(w.actuator.calls) == calls  # no cap, no signal: nothing to do
        await w.service.stop()

    run(main())


def test_weight_change_costs_one_timeslice_per_group(tmp_path: Path) -> None:
    w = world(tmp_path)

    async def main() -> None:
        w.service.start(w.actuator)
        w.group("a")
        b = w.group("b")
        w.group("c")
        await settle()
        calls = len(w.actuator.calls)
        w.manager.update_tenant("b", {"weight": 60})  # at once, not at a frame
        await settle()
        assert entries_since(w, calls) == [ts(b, 3072)]
        assert w.service.stats.rejected == 0
        await w.service.stop()

    run(main())


def test_busy_time_corrects_the_timeslices(tmp_path: Path) -> None:
    source = FakeSource()
    w = world(tmp_path, source)

    async def main() -> None:
        w.service.start(w.actuator)
        ga, gb, gc = w.group("a"), w.group("b"), w.group("c")
        await settle()
        calls = len(w.actuator.calls)
        source.runnable = {(0, "a"), (0, "b"), (0, "c")}
        await w.service.poll()
        await settle()
        assert len(w.actuator.calls) == calls  # best-effort work: the hardware finds it
        before = dict(w.actuator.timeslice)
        for second in range(1, 4):  # b gets 20% where it should get 30%, every second
            w.clock.now += 1_000 * MS
            source.busy = {(0, "a"): second * 550 * MS, (0, "b"): second * 200 * MS,
                           (0, "c"): second * 250 * MS, (0, "nobody"): 5 * MS}
            await w.service.poll()
        await settle()
        after = w.actuator.timeslice
        ratio = lambda s: s[(gb.client, gb.handle)] / s[(gc.client, gc.handle)]  # noqa: E731
        assert ratio(after) > ratio(before) * 1.2
        assert after[(ga.client, ga.handle)] < before[(ga.client, ga.handle)]
        assert w.service.stats.rejected == 0  # unknown tenants are left out of samples
        assert not any(e.enable == PREEMPT for _, es in w.actuator.calls for e in es)
        await w.service.stop()

    run(main())


def test_priority_wakeup_preempts_the_best_effort_groups(tmp_path: Path) -> None:
    source = FakeSource()
    source.interval = 0.02
    w = world(tmp_path, source)

    async def main() -> None:
        w.service.start(w.actuator)
        assert w.service._poll_interval(source) == RUNLIST_POLL
        w.manager.update_tenant("b", {"priority": "priority"})
        assert w.service._poll_interval(source) == 0.02  # wake-ups are seen sooner
        a1, a2, b, c = w.group("a"), w.group("a"), w.group("b"), w.group("c")
        source.runnable = {(0, "a"), (0, "c")}
        await w.service.poll()
        await settle()
        nominal = dict(w.actuator.timeslice)
        calls = len(w.actuator.calls)
        source.runnable = {(0, "a"), (0, "b"), (0, "c")}  # b has work: one call
        await w.service.poll()
        await settle()
        [(_, entries)] = w.actuator.calls[calls:]
        ops = [e.enable for e in entries]
        assert ops == sorted(ops)  # timeslices first, then the preemptions
        assert [e for e in entries if e.enable == PREEMPT] == [
            Sched(g.ctx, g.client, g.handle, PREEMPT) for g in (a1, a2, c)]
        slices = dict(w.actuator.timeslice)
        assert slices[(b.client, b.handle)] == 8192
        assert min(slices[(g.client, g.handle)] for g in (a1, a2, c)) == 512
        assert w.service.preemptions("b") == {0: 1}
        assert w.service.preemptions("a") == {}
        source.runnable = {(0, "a"), (0, "c")}  # idle again: short slices stay
        await w.service.poll()
        await settle()
        assert w.actuator.timeslice == slices
        for _ in range(3):  # until a feedback window closes in which b did nothing
            w.clock.now += 2_000 * MS
            await w.service.poll()
            await settle()
        assert w.actuator.timeslice == nominal
        await w.service.stop()

    run(main())


def test_priority_groups_are_high_until_stop(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A priority tenant's groups get the HIGH interleave level (2) with their
    slice, the others none (the driver's MEDIUM); a priority change sends one
    INTERLEAVE per group, and stop gives the raised groups MEDIUM (1) back."""
    w = world(tmp_path)

    async def main() -> None:
        w.service.start(w.actuator)
        w.manager.update_tenant("b", {"priority": "priority"})
        a, b1, b2 = w.group("a"), w.group("b"), w.group("b")
        await settle()
        assert w.actuator.level == {(b1.client, b1.handle): 2, (b2.client, b2.handle): 2}
        for _, entries in w.actuator.calls:
            ranks = [ORDER[SchedState(e.enable)] for e in entries]
            assert ranks == sorted(ranks), entries
        calls = len(w.actuator.calls)
        w.manager.update_tenant("a", {"priority": "priority"})
        await settle()
        assert [e for e in entries_since(w, calls) if e.enable == LEVEL] == [
            Sched(a.ctx, a.client, a.handle, LEVEL, 2)]
        w.manager.update_tenant("a", {"priority": "best-effort"})
        await settle()
        calls = len(w.actuator.calls)
        await w.service.stop()
        assert [e for e in entries_since(w, calls) if e.enable == LEVEL] == [
            Sched(g.ctx, g.client, g.handle, LEVEL, 1) for g in (b1, b2)]
        assert set(w.actuator.level.values()) == {1}

    with caplog.at_level(logging.WARNING, "vgpud.sched.service"):
        run(main())
    assert not [r for r in caplog.records if "interleave" in r.getMessage()]


def test_a_refused_interleave_level_is_said_once_and_the_mode_stays(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    w = world(tmp_path)
    w.actuator.refuse_level = SchedResult(0, 0x1B)  # NV_ERR_INSUFFICIENT_PERMISSIONS

    async def main() -> None:
        w.service.start(w.actuator)
        w.manager.update_tenant("b", {"priority": "priority"})
        w.group("a")
        for _ in range(3):
            w.group("b")
            await settle()
        assert w.service.modes() == {0: "runlist", 1: "runlist"}
        await w.service.stop()

    with caplog.at_level(logging.WARNING, "vgpud.sched.service"):
        run(main())
    said = [r.getMessage() for r in caplog.records if "interleave" in r.getMessage()]
    assert len(said) == 1 and "SET_INTERLEAVE_LEVEL 2 on group" in said[0], said
    assert "NVIDIA status 0x1b" in said[0] and "CAP_SYS_NICE" in said[0]


def test_a_cap_is_a_duty_cycle(tmp_path: Path) -> None:
    w = world(tmp_path)

    async def main() -> None:
        w.service.start(w.actuator)
        w.manager.update_tenant("c", {"cap": 20})
        ga, gc = w.group("a"), w.group("c")
        await settle()
        start = w.clock.now
        await w.timers.run_until(start + 2_000 * MS)
        got = w.on_time(start, w.clock.now)
        assert got[(gc.client, gc.handle)] / (2_000 * MS) == pytest.approx(0.2, abs=0.01)
        assert got[(ga.client, ga.handle)] == 2_000 * MS  # the others are never off
        await w.service.stop()

    run(main())


def test_paused_groups_keep_their_semantics(tmp_path: Path) -> None:
    w = world(tmp_path)

    async def main() -> None:
        w.service.start(w.actuator)
        ga, gb = w.group("a"), w.group("b")
        await settle()
        assert w.actuator.timeslice == {(ga.client, ga.handle): 1707,
                                        (gb.client, gb.handle): 1024}
        calls = len(w.actuator.calls)
        w.tracker.set_paused(ga, True)
        await settle()
        assert entries_since(w, calls) == [Sched(ga.ctx, ga.client, ga.handle,
                                                 SchedState.OWNER_OFF)]
        calls = len(w.actuator.calls)
        w.tracker.set_paused(ga, False)  # its slice first, then on
        await settle()
        assert entries_since(w, calls) == [ts(ga, 1707), on(ga)]
        w.tracker.set_paused(ga, True)
        await settle()
        calls = len(w.actuator.calls)
        await w.service.stop()  # every group's slice back; the paused one stays off
        assert entries_since(w, calls) == [ts(ga, 1024), ts(gb, 1024), on(gb)]

    run(main())


def test_stop_restores_the_default_timeslice_on_runlist_gpus_only(tmp_path: Path) -> None:
    w = world(tmp_path)

    async def main() -> None:
        before = w.group("a", gpu=1)  # learned before start: sent at start
        w.service.start(w.actuator)
        await settle()
        assert w.actuator.calls[0][1] == [ts(before, 1024), on(before)]
        groups = [w.group(t) for t in "abc"]
        await settle()
        calls = len(w.actuator.calls)
        await w.service.stop()
        assert entries_since(w, calls) == (
            [ts(g, 1024) for g in (before, *groups)] + [on(g) for g in (before, *groups)])
        assert set(w.actuator.timeslice.values()) == {1024}

    run(main())


@pytest.mark.parametrize(("answer", "why"), [
    (SchedResult(0, 0x56), "NVIDIA status 0x56"),
    (SchedResult(-errno.EOPNOTSUPP, 0), f"errno {errno.EOPNOTSUPP} (Operation not supported)"),
])
def test_a_refused_timeslice_falls_back_to_frame_mode(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, answer: SchedResult,
        why: str) -> None:
    w = world(tmp_path)
    w.actuator.refuse = answer

    async def main() -> None:
        w.service.start(w.actuator)
        groups = {t: w.group(t) for t in "abc"}
        await settle()
        modes = w.service.modes()
        assert modes[1] == "runlist"  # the other GPU is not judged by this one
        assert modes[0].startswith("frame (runlist refused: SET_TIMESLICE 1024 us on group")
        assert modes[0].endswith(f"{why})")
        assert w.service.running()[0] == "a"
        await settle()
        calls = len(w.actuator.calls)
        start = w.clock.now
        w.actuator.most_clients_on = 0
        await w.timers.run_until(start + 10_000 * MS)
        got = w.on_time(start, w.clock.now)
        for t, weight in zip("abc", (50, 30, 20), strict=True):
            g = groups[t]
            assert got[(g.client, g.handle)] / (10_000 * MS) == pytest.approx(
                weight / 100, abs=0.01), t
        assert w.actuator.most_clients_on == 1  # tenants take turns now
        assert not any(e.enable in (TS, PREEMPT) for e in entries_since(w, calls))
        await w.service.stop()  # frame mode: no timeslice to restore
        assert not any(e.enable == TS for e in w.actuator.calls[-1][1])

    with caplog.at_level(logging.WARNING, "vgpud.sched.service"):
        run(main())
    refused = [r for r in caplog.records if "refused a timeslice" in r.getMessage()]
    assert len(refused) == 1, refused


def test_a_group_gone_is_no_refusal(tmp_path: Path) -> None:
    w = world(tmp_path)
    w.actuator.refuse = SchedResult(-errno.ENOENT, 0)  # its context had just closed

    async def main() -> None:
        w.service.start(w.actuator)
        w.group("a")
        await settle()
        assert w.service.modes() == {0: "runlist", 1: "runlist"}
        await w.service.stop()

    run(main())
