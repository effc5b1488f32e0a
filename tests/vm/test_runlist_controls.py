"""SCHEDULE's TIMESLICE and PREEMPT ops (protocol v7) and INTERLEAVE (v8) against
the real module over nvsim (VM tier), judged by nvsim's own counters
(/proc/driver/nvsim).

The groups belong to clients of /dev/vgpu/nvidiactl files this process opens
(one file and client per tenant); this process is also the daemon that
schedules them, through their owners' files. The hostile tenant is an
unprivileged uid (tests/support/hostile.py) that calls PREEMPT and
SET_INTERLEAVE_LEVEL itself.

    scripts/vm-run -- python -m pytest -q -m vm tests/vm/test_runlist_controls.py
"""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.guest import get_param
from tests.support.hostile import spawn_tenant
from tests.support.nvsim import ctxsw_ns
from tests.support.sched import aio, list_contexts, schedule
from tests.support.vgpu_genl import Genl, NlError
from vgpud.kernel.uapi import Node, Sched, SchedResult, SchedState

pytestmark = pytest.mark.vm

MS = 1_000_000
MAX_PENDING = 10_000 * MS  # nvsim's cap on a group's pending work
OK = SchedResult(0, nv.NV_OK)
CMD_SCHEDULE, A_SCHED = 9, 13
SCHED = struct.Struct("=QIIII")


@dataclass(frozen=True)
class Group:
    """A channel group of a client of one /dev/vgpu/nvidiactl file of ours."""

    fd: int
    ctx: int
    client: int
    handle: int

    def sched(self, op: SchedState, arg: int = 0) -> Sched:
        return Sched(self.ctx, self.client, self.handle, op, arg)

    def row(self) -> nv.ProcGroup:
        (row,) = [g for g in nv.proc_groups() if (g.client, g.group) == (self.client,
                                                                          self.handle)]
        return row

    def top_up(self) -> None:
        """Keeps the queue full, so that the group stays saturated."""
        pending = self.row().pending_ns
        if pending < MAX_PENDING // 2:
            nv.must(nv.submit_work(self.fd, self.client, self.handle, MAX_PENDING - pending),
                    "submit")


@pytest.fixture
def groups(vgpu: Path) -> Iterator[Callable[[], Group]]:
    """Makes groups on GPU 0, each in a file (a context) and a client of its own."""
    fds: list[int] = []

    def make() -> Group:
        fd = os.open(vgpu / "nvidiactl", os.O_RDWR)
        fds.append(fd)
        tree = nv.build_tree(fd, 0)
        handle = nv.alloc_channel_group(fd, tree.client, tree.device)
        mine = sorted(c.ctx_id for c in aio(list_contexts())
                      if c.tgid == os.getpid() and c.node == Node.CTL)
        return Group(fd, mine[len(fds) - 1], tree.client, handle)  # contexts in open order

    yield make
    for fd in fds:
        os.close(fd)


def busy_ratio(a: Group, b: Group, seconds: float = 2.0) -> float:
    """a's busy time over b's over one window of `seconds`, both topped up every
    0.5 s (a fixed window: a ratio that converges late shows in it)."""
    before = (a.row().busy_ns, b.row().busy_ns)
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(0.5, left))
        a.top_up()
        b.top_up()
    ra, rb = a.row(), b.row()
    return (ra.busy_ns - before[0]) / max(rb.busy_ns - before[1], 1)


def test_timeslices_from_schedule_set_the_shares(groups: Callable[[], Group]) -> None:
    a, b = groups(), groups()
    assert aio(schedule([a.sched(SchedState.TIMESLICE, 2048),
                         b.sched(SchedState.TIMESLICE, 1024)])) == [OK, OK]
    assert (a.row().timeslice_us, b.row().timeslice_us) == (2048, 1024)
    a.top_up()
    b.top_up()
    ratio = busy_ratio(a, b)
    print(f"runlist: TIMESLICE 2048/1024 us through SCHEDULE: busy ratio {ratio:.3f}")
    assert 1.85 < ratio < 2.15, ratio  # 66.7% +- 1.6 points of the GPU
    assert int(get_param("vgpu", "sched_offs")) == 0  # neither op is remembered


def test_preempt_of_the_running_group(groups: Callable[[], Group]) -> None:
    a, b, idle = groups(), groups(), groups()
    ctxsw = ctxsw_ns()
    assert ctxsw > 0
    # a's slice is 10 s: whenever b's 1 ms turn is over, a is the group on the engine.
    assert aio(schedule([a.sched(SchedState.TIMESLICE, 10_000_000)])) == [OK]
    a.top_up()
    b.top_up()
    time.sleep(0.2)
    e0, a0, b0 = nv.proc_engines()[0], a.row(), b.row()
    tries = 20
    for _ in range(tries):
        assert aio(schedule([a.sched(SchedState.PREEMPT)])) == [OK]
        time.sleep(0.02)
    # A group with no work is on no engine: NV_OK, and nothing changes.
    assert aio(schedule([idle.sched(SchedState.PREEMPT)])) == [OK]
    time.sleep(0.05)
    e1, a1, b1 = nv.proc_engines()[0], a.row(), b.row()
    preempts = a1.preempts - a0.preempts
    print(f"runlist: {preempts}/{tries} PREEMPTs hit the running group; switch_ns "
          f"+{e1.switch_ns - e0.switch_ns}; the other group ran {b1.busy_ns - b0.busy_ns} ns, "
          f"wake max {b1.wake_max_ns} ns")
    assert 1 <= preempts <= tries, (a0, a1)
    assert b1.preempts == b0.preempts and idle.row().preempts == 0
    assert e1.preempts - e0.preempts == preempts
    # Each preemption cost one context switch, in which nothing ran.
    assert e1.switch_ns - e0.switch_ns == preempts * ctxsw, (e0, e1)
    # b ran after them: a slice of 1 ms each, less turns skipped for overruns owed
    # (at most 8 slices: NVSIM_MAX_DEBT_SLICES).
    assert b1.busy_ns > b0.busy_ns
    assert b1.busy_ns - b0.busy_ns >= (preempts - 8) * MS // 2, (b0, b1)
    # Saturated and on, each waited (ready) while the other ran.
    assert b1.ready_ns > b0.ready_ns and a1.ready_ns > a0.ready_ns
    assert int(get_param("vgpu", "sched_offs")) == 0


def test_wake_latency_counters(groups: Callable[[], Group]) -> None:
    """Work given to a group with none, on an idle engine, runs at once: one wake."""
    g = groups()
    r0 = g.row()
    assert (r0.wake_n, r0.wake_sum_ns, r0.preempts, r0.ready_ns) == (0, 0, 0, 0)
    for n in (1, 2):
        nv.must(nv.submit_work(g.fd, g.client, g.handle, MS), "submit")
        end = time.monotonic() + 30
        while (r := g.row()).pending_ns and time.monotonic() < end:
            time.sleep(0.01)
        assert (r.pending_ns, r.wake_n) == (0, n), r
    assert r.wake_max_ns <= r.wake_sum_ns and r.wake_sum_ns < 100 * MS, r


def test_bad_timeslice_and_bad_ops(groups: Callable[[], Group]) -> None:
    a = groups()
    assert aio(schedule([a.sched(SchedState.TIMESLICE, 2048)])) == [OK]
    # Below the driver's minimum: its status comes back, nothing changes.
    assert aio(schedule([a.sched(SchedState.TIMESLICE, 0)])) == [
        SchedResult(0, nv.NV_ERR_NOT_SUPPORTED)]
    assert a.row().timeslice_us == 2048
    # The largest the u32 arg carries is the driver's to take (GET returns it).
    assert aio(schedule([a.sched(SchedState.TIMESLICE, 2**32 - 1)])) == [OK]
    assert a.row().timeslice_us == 2**32 - 1
    assert aio(schedule([a.sched(SchedState.TIMESLICE, 2048)])) == [OK]
    # An unknown op, or an arg its op does not take: the message is refused whole.
    g = Genl()
    try:
        g.register()
        good = SCHED.pack(a.ctx, a.client, a.handle, SchedState.TIMESLICE, 4096)
        for bad in ((6, 0), (0xFFFFFFFF, 0), (SchedState.PREEMPT, 1), (SchedState.ON, 7),
                    (SchedState.OFF, 1), (SchedState.OWNER_OFF, 4096)):
            with pytest.raises(NlError) as err:
                g.request(CMD_SCHEDULE, [(A_SCHED, good + SCHED.pack(
                    a.ctx, a.client, a.handle, *bad))])
            assert (bad, err.value.errno) == (bad, errno.EINVAL)
    finally:
        g.close()
    row = a.row()
    assert (row.timeslice_us, row.preempts, row.enabled) == (2048, 0, True)


def wakes(g: Group, n: int, work_ns: int, gap_s: float) -> float:
    """Gives ``g`` work ``n`` times, each after the last ran dry and ``gap_s`` more;
    nvsim's mean submit-to-run latency in us."""
    r0 = g.row()
    for _ in range(n):
        nv.must(nv.submit_work(g.fd, g.client, g.handle, work_ns), "submit")
        end = time.monotonic() + 30
        while g.row().pending_ns and time.monotonic() < end:
            time.sleep(0.001)
        time.sleep(gap_s)
    r1 = g.row()
    count = r1.wake_n - r0.wake_n
    assert count == n, (r0, r1)
    return (r1.wake_sum_ns - r0.wake_sum_ns) / count / 1e3


def test_interleave_level_high_runs_after_every_other_slice(
        groups: Callable[[], Group]) -> None:
    """Three saturated groups with 4 ms slices make a 12 ms round. A group that
    wakes 2 ms after its last work ran waits for most of that round at MEDIUM
    (the driver's default), and for the rest of the slice running at HIGH: the
    runlist puts a HIGH group after every lower one."""
    busy = [groups() for _ in range(3)]
    waker = groups()
    assert waker.row().level == nv.LEVEL_MEDIUM
    assert aio(schedule([g.sched(SchedState.TIMESLICE, 4096) for g in busy])) == [OK] * 3
    for g in busy:
        g.top_up()
    time.sleep(0.2)
    medium = wakes(waker, 30, 200_000, 0.002)
    assert aio(schedule([waker.sched(SchedState.INTERLEAVE, nv.LEVEL_HIGH)])) == [OK]
    assert waker.row().level == nv.LEVEL_HIGH
    for g in busy:
        g.top_up()
    high = wakes(waker, 30, 200_000, 0.002)
    print(f"runlist: wake after 2 ms idle behind 3 x 4096 us slices: mean {medium:.0f} us "
          f"at MEDIUM, {high:.0f} us at HIGH")
    assert high < medium / 2, (medium, high)
    assert high < 4096 + 1000, high  # within the slice running, TCG's late timers aside
    # The others still share the rest by their slices (equal here).
    for g in busy:
        g.top_up()
    shares = [g.row().busy_ns for g in busy]
    assert max(shares) - min(shares) < 0.05 * sum(shares), shares
    assert int(get_param("vgpu", "sched_offs")) == 0  # not remembered either


def test_bad_interleave_levels_and_a_daemon_without_cap_sys_nice(
        groups: Callable[[], Group]) -> None:
    """A level that is none of the three is the driver's NV_ERR_INVALID_ARGUMENT;
    the control needs CAP_SYS_NICE of the caller, the daemon's process."""
    a = groups()
    for level in (3, 2**32 - 1):
        assert aio(schedule([a.sched(SchedState.INTERLEAVE, level)])) == [
            SchedResult(0, nv.NV_ERR_INVALID_ARGUMENT)]
    assert a.row().level == nv.LEVEL_MEDIUM
    code = ("import json, sys\n"
            "from tests.support.sched import aio, schedule\n"
            "from vgpud.kernel.uapi import Sched\n"
            "print(json.dumps(aio(schedule([Sched(*json.loads(sys.argv[1]))]))))\n")
    entry = json.dumps([a.ctx, a.client, a.handle, int(SchedState.INTERLEAVE), nv.LEVEL_HIGH])
    out = subprocess.run(["setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice",
                          sys.executable, "-c", code, entry], check=True, text=True,
                         capture_output=True, cwd=Path(__file__).parents[2]).stdout
    assert json.loads(out) == [[0, nv.NV_ERR_INSUFFICIENT_PERMISSIONS]], out
    assert a.row().level == nv.LEVEL_MEDIUM


# The tenant: its own group first, then the victim's (argv: client, group), with
# hostile PREEMPT params, and SET_INTERLEAVE_LEVEL on its own group (also from
# a user namespace of its own). Prints the (errno, status) of each call.
TENANT = r"""
import json, os, sys
from tests.support import nvclient as nv
victim_client, victim_group = int(sys.argv[1]), int(sys.argv[2])
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
t = nv.build_tree(fd, 0)
own = nv.alloc_channel_group(fd, t.client, t.device)
cmd = nv.NVA06C_CTRL_CMD_PREEMPT
out = {}
for name, (client, group) in {"own": (t.client, own),
                              "victim": (victim_client, victim_group)}.items():
    out[name] = [
        nv.preempt(fd, client, group, 1, 1, 2**32 - 1),
        nv.preempt(fd, client, group, 0, 1, nv.PREEMPT_MAX_MANUAL_TIMEOUT_US + 1),
        nv.preempt(fd, client, group, 0xff, 0xff, 0xffffffff),
        nv.rm_control(fd, client, group, cmd, bytes(7))[:2],
        nv.rm_control(fd, client, group, cmd, bytes(9))[:2],
        nv.rm_control(fd, client, group, cmd, None, params_size=8,
                      params_ptr=0xDEAD000000000000)[:2],
    ]
out["victim_ok"] = nv.preempt(fd, victim_client, victim_group)
out["level"] = nv.set_interleave_level(fd, t.client, own, nv.LEVEL_HIGH)
# Every capability, in a user namespace of its own: CAP_SYS_NICE counts in the
# initial one only.
import ctypes
assert ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0  # CLONE_NEWUSER
out["level_userns"] = nv.set_interleave_level(fd, t.client, own, nv.LEVEL_HIGH)
out["own_level"] = [g.level for g in nv.proc_groups() if (g.client, g.group) == (t.client, own)]
print(json.dumps(out), flush=True)
"""


def test_tenant_preempt_with_hostile_params(groups: Callable[[], Group]) -> None:
    victim, other = groups(), groups()
    victim.top_up()
    other.top_up()
    time.sleep(0.1)
    e0, v0 = nv.proc_engines()[0], victim.row()
    argv = json.dumps([str(victim.client), str(victim.handle)])
    tenant = spawn_tenant(f"import sys; sys.argv[1:] = {argv}\n{TENANT}")
    out, err = tenant.communicate(timeout=300)
    assert tenant.returncode == 0, err
    res = {k: [tuple(x) for x in v] if k in ("own", "victim") else tuple(v)
           for k, v in json.loads(out).items()}
    # Raising its own group's level takes CAP_SYS_NICE, which the tenant lacks.
    assert res["level"] == res["level_userns"] == (0, nv.NV_ERR_INSUFFICIENT_PERMISSIONS)
    assert res["own_level"] == (nv.LEVEL_MEDIUM,)
    bad_arg, bad_struct = (0, nv.NV_ERR_INVALID_ARGUMENT), (0, nv.NV_ERR_INVALID_PARAM_STRUCT)
    assert res["own"][:3] == [bad_arg] * 3
    assert res["own"][3:5] == [bad_struct] * 2
    assert res["own"][5][1] != nv.NV_OK
    # Another client's group: that client is not the tenant's (its file's).
    assert all(r == (0, nv.NV_ERR_INVALID_CLIENT) for r in res["victim"]), res
    assert res["victim_ok"] == (0, nv.NV_ERR_INVALID_CLIENT)
    e1, v1 = nv.proc_engines()[0], victim.row()
    assert e1.preempts == e0.preempts and e1.switch_ns == e0.switch_ns
    assert (v1.preempts, v1.timeslice_us, v1.enabled) == (0, v0.timeslice_us, True)
