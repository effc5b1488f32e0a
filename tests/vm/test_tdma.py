"""TDMA scheduling end to end: nvsim's work engine + vgpu + vgpud --config (+ D-Bus).

Tenants are cgroups; tests/support/tdma_workload.py opens one nvidiactl file per
tenant from inside its cgroup, allocates a channel group and keeps its
pending work from draining. Shares are measured from nvsim's own busy
counters (/proc/driver/nvsim/groups), not from the daemon.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.bus import PrivateBus
from tests.support.guest import remove_cgroup
from tests.support.tdma import CGROOT, Tenants, config_text, open_as_tenant
from tests.support.vgpud_proc import Daemon
from vgpud.admin.client import AdminClient
from vgpud.admin.dbus import tenant_path

pytestmark = pytest.mark.vm

FRAME_S = 0.1  # frame_ms = 100, the default


def shares(before: Sequence[int], after: Sequence[int]) -> list[float]:
    used = [b - a for a, b in zip(before, after, strict=True)]
    return [100 * u / sum(used) for u in used]


def measure(tenants: Tenants, seconds: float) -> list[float]:
    before = tenants.busy()
    time.sleep(seconds)
    return shares(before, tenants.busy())


class Tdma:
    """Cgroups, config, the daemon (D-Bus on a private bus) and the workloads of a test.

    ``tdma(weights)`` starts them; ``restart()`` SIGKILLs the daemon and starts
    another on the same config and charge journal."""

    def __init__(self, daemon_factory: type[Daemon], tmp: Path) -> None:
        self.daemon_factory = daemon_factory
        self.config = tmp / "vgpud.toml"
        self.tmp = tmp
        self.made: list[Path] = []
        self.running: list[Tenants] = []
        self.daemons: list[Daemon] = []

    def __call__(self, weights: Sequence[int], per_process: int = 16) -> Tenants:
        for i in range(len(weights)):
            path = CGROOT / f"vgpu-tdma-t{i}"
            path.mkdir(exist_ok=True)
            self.made.append(path)
        self.config.write_text(config_text(self.tmp / "state.json", weights).replace(
            "[daemon]\n", f'[daemon]\ncharges_path = "{self.tmp / "run" / "charges"}"\n'))
        self._start_daemon()
        tenants = Tenants(len(weights), per_process)
        self.running.append(tenants)
        time.sleep(1.0)  # the daemon learns the groups; a few frames go by
        return tenants

    def restart(self) -> Daemon:
        """SIGKILL the daemon (no stop: groups stay as it left them); start another."""
        self.daemons[-1].kill()
        return self._start_daemon()

    def _start_daemon(self) -> Daemon:
        daemon = self.daemon_factory("--config", str(self.config), log_level="info").start()
        self.daemons.append(daemon)
        return daemon

    def close(self) -> None:
        for tenants in self.running:
            tenants.close()
        for d in self.daemons:
            d.kill()
            print(d.log())  # shown when the test fails
        for path in self.made:
            remove_cgroup(path)


@pytest.fixture
def tdma(vgpu: Path, daemon_factory: type[Daemon], tmp_path: Path) -> Iterator[Tdma]:
    if not (CGROOT / "cgroup.controllers").exists():
        pytest.skip("cgroup v2 is not mounted at /sys/fs/cgroup in this guest")
    if not Path(nv.PROC_GROUPS).exists():
        pytest.skip("nvsim has no work engine (/proc/driver/nvsim/groups)")
    bus = PrivateBus()
    os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = bus.address
    world = Tdma(daemon_factory, tmp_path)
    try:
        yield world
    finally:
        world.close()
        bus.close()
        del os.environ["DBUS_SYSTEM_BUS_ADDRESS"]


def test_weights_50_30_20_within_2pp(tdma) -> None:
    tenants = tdma([50, 30, 20])
    got = measure(tenants, 10.0)
    print("shares", got)
    for share, want in zip(got, (50, 30, 20), strict=True):
        assert abs(share - want) <= 2.0, got


def test_idle_tenant_time_goes_to_the_others_by_weight(tdma) -> None:
    tenants = tdma([50, 30, 20])
    tenants.command(2, "idle")
    deadline = time.monotonic() + 5.0
    while tenants.pending(2) > 0:  # it drains in its next slots
        assert time.monotonic() < deadline, "t2's work did not drain"
        time.sleep(0.005)
    time.sleep(FRAME_S)  # within one frame, its time is the others'
    engine0 = nv.proc_engines()[0]
    before = tenants.busy()
    time.sleep(10 * FRAME_S)
    after = tenants.busy()
    engine1 = nv.proc_engines()[0]
    got = shares(before, after)
    print("after t2 went idle:", got, "engine idle", engine1.idle_ns - engine0.idle_ns)
    assert got[2] == 0.0
    assert abs(got[0] - 62.5) <= 3.0 and abs(got[1] - 37.5) <= 3.0, got
    idle = (engine1.idle_ns - engine0.idle_ns) / (
        engine1.idle_ns - engine0.idle_ns + engine1.busy_ns - engine0.busy_ns)
    assert idle < 0.05, f"GPU idle {idle:.1%} of the frames after t2 went idle"
    tenants.command(2, "busy")  # and back: it gets its share again
    time.sleep(5 * FRAME_S)
    got = measure(tenants, 3.0)
    print("t2 busy again:", got)
    assert abs(got[2] - 20) <= 3.0, got


def test_16_tenants_none_starves(tdma) -> None:
    tenants = tdma([100] * 16)
    start = time.monotonic()
    last = tenants.busy()
    since = [start] * 16
    longest = [0.0] * 16
    while time.monotonic() - start < 5.0:
        time.sleep(0.02)
        now, busy = time.monotonic(), tenants.busy()
        for i in range(16):
            if busy[i] > last[i]:
                since[i] = now
            longest[i] = max(longest[i], now - since[i])
        last = busy
    print("longest gaps", longest)
    # equal weights: 6.25 ms quanta >= the 2 ms min slot, so each runs every frame;
    # the slack is for TCG (a workload late to refill leaves its tenant idle)
    assert max(longest) <= 5 * FRAME_S, longest
    got = measure(tenants, 5.0)
    print("shares", got)
    assert min(got) >= 100 / 16 / 2, got


def test_weight_change_over_dbus_applies_at_the_next_frame(tdma) -> None:
    tenants = tdma([100, 100])
    got = measure(tenants, 2.0)
    print("before", got)
    assert abs(got[0] - 50) <= 3.0, got

    async def set_weight(client: AdminClient) -> dict:
        await client.call("SetWeight", "su", "t1", 300)
        return await client.tenant_properties(tenant_path("t1"))

    asyncio.run(AdminClient.run(set_weight))
    time.sleep(FRAME_S + 0.05)
    got = measure(tenants, 3.0)
    print("after", got)
    assert abs(got[1] - 75) <= 3.0, got
    props = asyncio.run(AdminClient.run(
        lambda c: c.tenant_properties(tenant_path("t1"))))
    assert props["Weight"] == 300
    assert props["Share"] == {0: 75.0}
    assert abs(props["MeasuredShare"][0] - 75) <= 10, props


def stats(ctl: int, client: int, group: int) -> nv.WorkStats:
    e, st, got = nv.work_stats(ctl, client, group)
    assert (e, st) == (0, nv.NV_OK) and got is not None
    return got


def test_groups_never_run_outside_their_slots(tdma) -> None:
    """A new group is off when its alloc returns; its owner's GPFIFO_SCHEDULE cannot
    turn it on outside its slots, and an owner's "off" holds through the slots."""
    tenants = tdma([1, 1])
    tenants.command(1, "idle")  # t1 drains and is then never in a slot
    deadline = time.monotonic() + 5.0
    while tenants.pending(1) > 0:
        assert time.monotonic() < deadline, "t1's work did not drain"
        time.sleep(0.005)
    ctl = open_as_tenant(1)
    try:
        tree = nv.build_tree(ctl)
        group = nv.alloc_channel_group(ctl, tree.client, tree.device)
        assert not stats(ctl, tree.client, group).enabled  # off before anyone had its handle
        assert nv.gpfifo_schedule(ctl, tree.client, group, True) == (0, nv.NV_OK)
        time.sleep(3 * FRAME_S)
        assert not stats(ctl, tree.client, group).enabled  # t1 has no slot: still off
        assert nv.submit_work(ctl, tree.client, group, 10**10) == (0, nv.NV_OK)  # 10 s
        time.sleep(5 * FRAME_S)  # runnable now: it gets slots, the new group runs in them
        busy = stats(ctl, tree.client, group).busy_ns
        assert busy > 0
        assert nv.gpfifo_schedule(ctl, tree.client, group, False) == (0, nv.NV_OK)
        time.sleep(FRAME_S)
        paused = stats(ctl, tree.client, group)
        time.sleep(5 * FRAME_S)
        still = stats(ctl, tree.client, group)
        assert not still.enabled and still.pending_ns > 0
        assert still.busy_ns == paused.busy_ns  # its slots are t0's now
        assert nv.gpfifo_schedule(ctl, tree.client, group, True) == (0, nv.NV_OK)
        time.sleep(5 * FRAME_S)
        assert stats(ctl, tree.client, group).busy_ns > still.busy_ns
        print("busy ns: first slots", busy, "paused at", paused.busy_ns)
    finally:
        os.close(ctl)


def shares_over_dbus(count: int) -> list[dict[int, float]]:
    async def read(client: AdminClient) -> list[dict[int, float]]:
        return [(await client.tenant_properties(tenant_path(f"t{i}")))["Share"]
                for i in range(count)]

    return asyncio.run(AdminClient.run(read))


def test_sigkill_and_restart_keep_scheduling_the_groups(tdma) -> None:
    """The restarted daemon learns the groups made before from the charge journal:
    without it, the module would turn them all back on at its registration and
    nvsim's round robin would give them equal time."""
    tenants = tdma([300, 100])
    got = measure(tenants, 2.0)
    print("before the kill", got)
    assert abs(got[0] - 75) <= 5.0, got
    daemon = tdma.restart()
    time.sleep(0.5)
    got = measure(tenants, 3.0)
    print("after the restart", got)
    assert abs(got[0] - 75) <= 4.0 and abs(got[1] - 25) <= 4.0, got
    assert shares_over_dbus(2) == [{0: 75.0}, {0: 25.0}]  # the targets of known groups
    assert "2 contexts and 2 channel groups restored" in daemon.log()
