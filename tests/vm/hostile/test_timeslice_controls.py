"""A tenant's own scheduling controls: it cannot lengthen its slices or preempt.

libcuda sets its channel groups' timeslices itself (2048 us observed), and
any tenant can issue SET_TIMESLICE, SET_INTERLEAVE_LEVEL and PREEMPT on its
groups. On a group the daemon knows, none reaches the driver: the daemon
answers them as the driver answers an unprivileged client, and GET_TIMESLICE
returns what the tenant set (vgpud/policy/sched.py). Judged by nvsim's own
counters (/proc/driver/nvsim/groups): the group's timeslice stays the one the
driver had, and a tenant that asked for 1 s slices still gets its weight's
share of a saturated GPU, within the TDMA tests' 2 points (tests/vm/test_tdma.py).

Two tenants of equal weight, unprivileged uids (A_UID, B_UID), in frame mode
with the share tests' 400 ms frames; the share test runs in runlist mode too.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.guest import wait_for
from tests.support.hostile import TENANT_UID, spawn_tenant
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm

A_UID, B_UID = TENANT_UID, TENANT_UID + 1
ASK_US = 1_000_000  # the 1 s timeslice a tenant asks for
FRAME_MS = 400  # the TDMA share tests' frames
TOL = 2.0  # percentage points, as the TDMA share tests
WAIT_S = 60.0
SETTLE_S = 3.0  # from both tenants having run to the window
NV_ERR_INSUFFICIENT_PERMISSIONS = 0x1B  # nvstatuscodes.h

CONFIG = f"""\
[[tenant]]
name = "a"
weight = 1
match = [{{ uid = {A_UID} }}]

[[tenant]]
name = "b"
weight = 1
match = [{{ uid = {B_UID} }}]
"""

# A tenant: one channel group, the handles printed; then (a line "controls")
# its scheduling controls, their results printed, or (a line "work ASK" with
# ASK 0 for none) a SET_TIMESLICE of ASK and saturating work: its pending work
# kept at 500 ms or more (tests/support/tdma_workload.py) until stdin closes.
TENANT = r"""
import json, os, select, sys, time
from tests.support import nvclient as nv

MS = 1_000_000
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(fd)
group = nv.alloc_channel_group(fd, tree.client, tree.device)
print(json.dumps({"client": tree.client, "group": group}), flush=True)
ts = nv.TIMESLICE.pack
preempt = lambda wait, manual, us: bytes([wait, manual, 0, 0]) + us.to_bytes(4, "little")


def call(cmd, params, client=tree.client, obj=group, **kw):
    e, st, out = nv.rm_control(fd, client, obj, cmd, params, **kw)
    return [e, st, out.hex() if out else None]


what, _, arg = sys.stdin.readline().partition(" ")
if what == "controls":
    other = json.loads(arg)  # the other tenant's group
    client2 = nv.alloc_client(fd)
    r = {
        "set": call(nv.NVA06C_CTRL_CMD_SET_TIMESLICE, ts(ASK_US)),
        "get": call(nv.NVA06C_CTRL_CMD_GET_TIMESLICE, ts(0)),
        "set_zero": call(nv.NVA06C_CTRL_CMD_SET_TIMESLICE, ts(0)),
        "set_short": call(nv.NVA06C_CTRL_CMD_SET_TIMESLICE, ts(5)[:4]),
        "set_long": call(nv.NVA06C_CTRL_CMD_SET_TIMESLICE, ts(5) + bytes(8)),
        "set_null": call(nv.NVA06C_CTRL_CMD_SET_TIMESLICE, None, params_ptr=0, params_size=8),
        "get_after": call(nv.NVA06C_CTRL_CMD_GET_TIMESLICE, ts(0)),
        "preempt": call(0xA06C0105, preempt(1, 0, 0)),
        "preempt_bad": call(0xA06C0105, preempt(1, 1, 2 * MS)),
        "interleave": call(0xA06C0107, (2).to_bytes(4, "little")),
        "get_interleave": call(0xA06C0108, bytes(4)),
        "dup": list(nv.rm_dup_object(fd, client2, client2, 0, tree.client, group)[:2]),
        "other": call(nv.NVA06C_CTRL_CMD_SET_TIMESLICE, ts(ASK_US), client=other["client"],
                      obj=other["group"]),
    }
    lat = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        nv.rm_control(fd, tree.client, group, nv.NVA06C_CTRL_CMD_GET_TIMESLICE, ts(0))
        lat.append(time.perf_counter_ns() - t0)
    r["get_us"] = sorted(lat)[100] / 1000, sorted(lat)[197] / 1000
    print(json.dumps(r), flush=True)
    sys.stdin.readline()
    sys.exit(0)
ask = int(arg)
if ask:
    set_ = call(nv.NVA06C_CTRL_CMD_SET_TIMESLICE, ts(ask))
    get = call(nv.NVA06C_CTRL_CMD_GET_TIMESLICE, ts(0))
    print(json.dumps({"set": set_, "get": get}), flush=True)
target = 500 * MS
while not select.select([0], [], [], 0.1)[0]:
    for g in nv.proc_groups():
        if (g.client, g.group) == (tree.client, group) and g.pending_ns < target:
            e, st = nv.submit_work(fd, tree.client, group, 2 * target - g.pending_ns)
            assert not e and not st, (e, st)
"""


class Tenant:
    """One TENANT process, as `uid`."""

    def __init__(self, uid: int) -> None:
        self.proc = spawn_tenant(f"ASK_US = {ASK_US}\n{TENANT}", stdin=True, uid=uid)
        self.handles = self.read()
        self.client, self.group = self.handles["client"], self.handles["group"]

    def read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the tenant died: {self.proc.stderr.read() if self.proc.stderr else ''}"
        return json.loads(line)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def nvsim(self) -> nv.ProcGroup:
        return next(g for g in nv.proc_groups() if (g.client, g.group) == (self.client,
                                                                           self.group))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass(frozen=True)
class Tenants:
    a: Tenant
    b: Tenant
    mode: str  # the daemon's sched_mode


@pytest.fixture
def tenants(vgpu: Path, daemon_factory: type[Daemon], tmp_path: Path,
            request: pytest.FixtureRequest) -> Iterator[Tenants]:
    """The daemon (sched_mode the test's `mode` parameter, else frame; FRAME_MS)
    deciding for tenants a and b; a tenant process of each, its group made."""
    mode = getattr(request, "param", "frame")
    config = tmp_path / "vgpud.toml"
    config.write_text(f'[daemon]\nstate_path = "{tmp_path / "state.json"}"\n'
                      f'charges_path = "{tmp_path / "charges"}"\nframe_ms = {FRAME_MS}\n'
                      f'sched_mode = "{mode}"\n\n{CONFIG}')
    daemon = daemon_factory("--config", str(config), "--no-dbus", log_level="info").start(
        timeout=300)
    made: list[Tenant] = []
    try:
        made += [Tenant(A_UID), Tenant(B_UID)]
        yield Tenants(*made, mode)
    finally:
        for t in made:
            t.close()
        daemon.kill()
        print(daemon.log())


def test_own_controls_are_answered_and_change_nothing(tenants: Tenants, nvsim: Path) -> None:
    a, b = tenants.a, tenants.b
    before = a.nvsim().timeslice_us
    a.send("controls " + json.dumps(b.handles))
    r = a.read()
    print(json.dumps(r))
    ask = nv.TIMESLICE.pack(ASK_US).hex()
    assert r["set"][:2] == [0, nv.NV_OK]
    assert r["get"] == [0, nv.NV_OK, ask]  # what it set, not what the driver has
    assert r["set_zero"][:2] == [0, nv.NV_ERR_NOT_SUPPORTED]
    assert r["set_short"][:2] == r["set_long"][:2] == [0, nv.NV_ERR_INVALID_PARAM_STRUCT]
    assert r["set_null"][:2] == [0, nv.NV_ERR_INVALID_ADDRESS]
    assert r["get_after"] == [0, nv.NV_OK, ask]  # the refused sets changed nothing
    assert r["preempt"][:2] == [0, nv.NV_OK]
    assert r["preempt_bad"][:2] == [0, nv.NV_ERR_INVALID_ARGUMENT]
    assert r["interleave"][:2] == [0, NV_ERR_INSUFFICIENT_PERMISSIONS]
    assert r["get_interleave"][:2] == [0, nv.NV_ERR_NOT_SUPPORTED]
    assert r["dup"][0] == errno.EPERM  # a second handle would escape the daemon
    assert r["other"][0] == errno.EPERM  # the other tenant's group
    # nvsim's truth: neither group's timeslice moved.
    after = a.nvsim().timeslice_us
    print(f"nvsim timeslice of a's group: {before} us before, {after} us after")
    assert after == before != ASK_US
    assert b.nvsim().timeslice_us != ASK_US
    floor = get_timeslice_us(nvsim)
    print(f"GET_TIMESLICE p50/p99: {r['get_us'][0]:.0f}/{r['get_us'][1]:.0f} us answered by "
          f"the daemon through vgpu, {floor[0]:.0f}/{floor[1]:.0f} us straight on nvsim")
    a.send("done")


def get_timeslice_us(nodes: Path) -> tuple[float, float]:
    """p50 and p99 (us) of 200 GET_TIMESLICE calls on a new group, as root
    straight on `nodes`."""
    ctl = nv.NvNodes(nodes).open_ctl()
    try:
        tree = nv.build_tree(ctl)
        group = nv.alloc_channel_group(ctl, tree.client, tree.device)
        lat = []
        for _ in range(200):
            t0 = time.perf_counter_ns()
            nv.must(nv.rm_control(ctl, tree.client, group, nv.NVA06C_CTRL_CMD_GET_TIMESLICE,
                                  nv.TIMESLICE.pack(0))[:2], "get timeslice")
            lat.append(time.perf_counter_ns() - t0)
        lat.sort()
        return lat[100] / 1000, lat[197] / 1000
    finally:
        os.close(ctl)


@pytest.mark.parametrize("tenants", ["frame", "runlist"], indirect=True)
def test_a_1s_timeslice_still_gets_its_weights_share(tenants: Tenants) -> None:
    """In frame mode the daemon switches the tenants on and off and sets no
    timeslice; in runlist mode it sets each group's: either way, not 1 s."""
    a, b = tenants.a, tenants.b
    before = a.nvsim().timeslice_us
    a.send(f"work {ASK_US}")
    ask = nv.TIMESLICE.pack(ASK_US).hex()
    assert a.read() == {"set": [0, nv.NV_OK, ask], "get": [0, nv.NV_OK, ask]}
    b.send("work 0")
    wait_for(lambda: min(a.nvsim().busy_ns, b.nvsim().busy_ns) > 0, WAIT_S,
             "the daemon to run both tenants")
    share = measure(a, b, 10.0)
    print(f"a (asked for {ASK_US} us slices): {share:.2f}% of the GPU; nvsim timeslice "
          f"{a.nvsim().timeslice_us} us")
    assert abs(share - 50) <= TOL, share
    assert a.nvsim().timeslice_us != ASK_US
    if tenants.mode == "frame":
        assert a.nvsim().timeslice_us == before


def measure(a: Tenant, b: Tenant, seconds: float) -> float:
    """a's % of the two tenants' GPU time (nvsim's busy counters) over one
    window of `seconds`, after SETTLE_S (fixed: a share that lands late shows)."""
    time.sleep(SETTLE_S)
    a0, b0 = a.nvsim().busy_ns, b.nvsim().busy_ns
    time.sleep(seconds)
    da, db = a.nvsim().busy_ns - a0, b.nvsim().busy_ns - b0
    share = 100 * da / (da + db)
    print(f"window {seconds:.1f} s: a {share:.2f}%, b {100 - share:.2f}%")
    return share
