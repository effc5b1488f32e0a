"""Runlist mode end to end: nvsim's engine is the GPU's round robin (it honours
SET_TIMESLICE and PREEMPT), vgpud sets each channel group's timeslice.

Judged by nvsim's own counters (/proc/driver/nvsim/groups and engines), as the
TDMA tests (tests/vm/test_tdma.py, which also runs its acceptance in this
mode): shares from busy_ns, the GPU's idle time from the engine, a wake's
submit-to-run latency from wake_sum_ns / wake_n. Shares are read over one
fixed window after a fixed settle (`measure`, SETTLE_S): the feedback loop
of vgpud/core/runlist.py corrects the slices over windows of 128 rounds.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.guest import wait_for
from tests.support.nvsim import ctxsw_ns
from tests.support.tdma import (
    SETTLE_S,
    WAIT_S,
    TdmaWorld,
    Window,
    measure,
    near,
    open_as_tenant,
    proc_group,
    tdma_world,
    wake_latencies,
)
from tests.support.vgpud_proc import Daemon
from vgpud.admin.client import AdminClient
from vgpud.admin.names import tenant_path

pytestmark = pytest.mark.vm

TOL = 2.0  # percentage points
CONVERGE_LIMIT_S = 120.0  # the 1 : 8 groups case: the feedback's windows are 2 s long
CAP_FRAME_MS = 400  # the caps' duty cycle: a late edge of the daemon's costs less of it
WAKES = 60


@pytest.fixture
def world(vgpu: Path, daemon_factory: type[Daemon], tmp_path: Path) -> Iterator[TdmaWorld]:
    yield from tdma_world(daemon_factory, tmp_path, "runlist")


def test_shares_follow_the_weights_without_an_activity_source(world: TdmaWorld) -> None:
    """No source polled: the planner only knows weights and groups. The shares hold,
    and an idle tenant's time goes to the others: the GPU's round robin skips a
    group without work (the work conservation is the hardware's)."""
    tenants = world([50, 30, 20], daemon='sched_activity = "none"\n')
    assert "activity none" in world.daemons[-1].log()
    window = measure(tenants.busy, 10.0, SETTLE_S)
    assert near(50, 30, 20, tol=TOL)(window), window
    tenants.command(2, "idle")
    wait_for(lambda: tenants.pending(2) == 0, WAIT_S, "t2's work to drain")

    def given_away(w: Window) -> bool:
        return w.shares[2] == 0.0 and near(62.5, 37.5, 0, tol=TOL)(w) and w.idle < 0.02

    window = measure(tenants.busy, 5.0, 1.0)
    assert given_away(window), window


def test_one_and_eight_groups_converge_to_equal_shares(world: TdmaWorld) -> None:
    """Weights 1 : 1, t0 with one group, t1 with eight: a tenant's share is divided
    among its groups, and the feedback removes what the group count still costs.
    The convergence time is from the moment every group has run to the end of the
    first 2 s window within TOL; after it, a fresh window holds."""
    tenants = world([1, 1], cgroups=[0] + [1] * 8)
    start = time.monotonic()

    def busy() -> list[int]:
        each = tenants.busy()
        return [each[0], sum(each[1:])]

    trail: list[float] = []  # t0's share in each 2 s window
    last = busy()
    while not trail or abs(trail[-1] - 50) > TOL:
        assert time.monotonic() - start < CONVERGE_LIMIT_S, f"t0's share: {trail}"
        time.sleep(2.0)
        now = busy()
        used = [b - a for a, b in zip(last, now, strict=True)]
        trail.append(round(100 * used[0] / sum(used), 1))
        last = now
    print(f"1 : 8 groups: within {TOL} points after {time.monotonic() - start:.1f} s; "
          f"t0's share per 2 s window: {trail}")
    window = measure(busy, 5.0)
    assert near(50, 50, tol=TOL)(window), window
    print("timeslices us (t0, then t1's):",
          [g.timeslice_us for g in nv.proc_groups() if g.client in tenants.clients])


def test_cap_20_holds_while_the_gpu_would_idle(world: TdmaWorld) -> None:
    """One saturating tenant capped at 20%: its groups are on for the first 20% of
    each frame, and the GPU idles for the rest."""
    tenants = world([1], CAP_FRAME_MS, tenant={0: "cap = 20\n"})

    def capped(w: Window) -> bool:
        return abs(100 * (1 - w.idle) - 20) <= TOL

    window = measure(tenants.busy, 5.0, SETTLE_S)
    assert capped(window), f"ran {100 * (1 - window.idle):.1f}% of the GPU: {window}"


def tenant_props(name: str) -> dict:
    return asyncio.run(AdminClient.run(lambda c: c.tenant_properties(tenant_path(name))))


def p50_p99(ordered: list[int]) -> tuple[int, int]:
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)]


def test_a_waking_priority_tenant_runs_within_a_slice(world: TdmaWorld) -> None:
    """Sixteen best-effort groups (t0-t3, four each) saturate the GPU; t4,
    priority, wakes WAKES times (1 ms of work to its idle group, 40 ms after
    the last ran dry), in turns with t5, best-effort, which wakes the same way:
    the control, a group without the HIGH level, measured in the same run.
    Bound, from the design: t4's group is at the HIGH interleave level, which
    the runlist puts after every best-effort group, so it waits at most for
    the slice running when its work comes (the nominal 1024 us at most;
    shorter while the daemon has seen t4's work, and where the feedback serves
    t4, which never uses its share) plus a context switch (a PREEMPT's, when
    the daemon's, triggered by its 20 ms activity poll, lands first), whatever
    the number of best-effort groups. t5 waits for the runlist's cursor to
    come round to it (nvsim walks its list in a fixed order, as the hardware
    walks its runlist): about half a round of seventeen groups. With eight
    best-effort groups the two medians were 311 against 1707 us in one run
    and 924 against 1644 us in another (bench-log.md): half a round was too
    near a slice and the timers' lateness. Asserted with slack
    for TCG, whose timers run late: t4's median within 3 bounds and at most
    half of t5's (without the level the two are alike), its mean within 6
    bounds, nvsim's wake latency counters being the judge."""
    tenants = world([1, 1, 1, 1, 1, 1], tenant={4: 'priority = "priority"\n'},
                    cgroups=[0] * 4 + [1] * 4 + [2] * 4 + [3] * 4)
    ctl, control = open_as_tenant(4), open_as_tenant(5)
    try:
        tree, other = nv.build_tree(ctl), nv.build_tree(control)
        group = nv.alloc_channel_group(ctl, tree.client, tree.device)
        idle = nv.alloc_channel_group(control, other.client, other.device)
        wait_for(lambda: proc_group(tree.client, group).enabled
                 and proc_group(other.client, idle).enabled, WAIT_S,
                 "the daemon to learn t4's and t5's groups")
        best_effort = set(tenants.clients)
        bound_ns = 1024 * 1000 + ctxsw_ns()
        latencies: list[int] = []
        without: list[int] = []  # t5's: the control
        for _ in range(WAKES // 10):  # in turns: a change of load weighs on both
            latencies += wake_latencies(ctl, tree.client, group, 10)
            without += wake_latencies(control, other.client, idle, 10)
        slices = sorted(g.timeslice_us for g in nv.proc_groups() if g.client in best_effort)
        mine, theirs = proc_group(tree.client, group), proc_group(other.client, idle)
    finally:
        os.close(ctl)
        os.close(control)
    ordered, control_ordered = sorted(latencies), sorted(without)
    p50, p99 = p50_p99(ordered)
    c50, c99 = p50_p99(control_ordered)
    print(f"priority wake: {len(ordered)} wakes, p50 {p50 / 1e3:.0f} us, p99 "
          f"{p99 / 1e3:.0f} us, max {ordered[-1] / 1e3:.0f} us; bound (a slice) "
          f"{bound_ns / 1e3:.0f} us; best-effort slices {slices} us, t4's "
          f"{mine.timeslice_us} us; preemptions {tenant_props('t4')['Preemptions']}; "
          f"the control (t5, level {theirs.level}): {len(control_ordered)} wakes, p50 "
          f"{c50 / 1e3:.0f} us, p99 {c99 / 1e3:.0f} us; p50 ratio {p50 / max(c50, 1):.2f}")
    assert len(ordered) >= WAKES // 2, f"too few wakes: {len(ordered)}"
    assert len(control_ordered) >= WAKES // 2, f"too few wakes: {len(control_ordered)}"
    assert max(slices) <= 1024 and mine.timeslice_us > max(slices)
    assert mine.level == nv.LEVEL_HIGH and theirs.level == nv.LEVEL_MEDIUM
    assert p50 <= 3 * bound_ns, ordered
    assert 2 * p50 <= c50, (ordered, control_ordered)
    assert statistics.mean(ordered) <= 6 * bound_ns, ordered
    assert tenant_props("t4")["Preemptions"].get(0, 0) > 0  # its wake-ups were seen
