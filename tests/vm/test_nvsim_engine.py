"""nvsim's work engine: channel groups run simulated work, one at a time per GPU.

VM tier, straight on /dev/nvsim (one test through /dev/vgpu).  What the
engine defines exactly is asserted exactly: busy + pending == submitted, no
time for a disabled group, and a saturated engine's busy time equals the
time that passed between two reads (bracketed by the clock read before and
after each, so a test descheduled between them cannot fail it).  Shares and
rates depend on the engine's thread waking at each slice's end: they are
read over windows that grow until they converge (a late wake-up's overrun is
owed and paid back by the engine), within a few percent.

    flock /tmp/vgpu-vm.lock scripts/test-vm -k nvsim_engine
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.guest import NVSIM_KO, insmod, loaded, rmmod, wait_path

pytestmark = pytest.mark.vm

MS = 1_000_000
SEC = 1_000_000_000
MAX_PENDING = 10 * SEC
PROC_DIR = Path("/proc/driver/nvsim")


@dataclass
class Group:
    ctl: int
    client: int
    handle: int

    def submit(self, ns: int) -> None:
        nv.must(nv.submit_work(self.ctl, self.client, self.handle, ns), "submit")

    def stats(self) -> nv.WorkStats:
        e, st, s = nv.work_stats(self.ctl, self.client, self.handle)
        assert (e, st) == (0, nv.NV_OK) and s is not None
        return s

    def busy(self) -> int:
        return self.stats().busy_ns

    def enable(self, on: bool) -> None:
        nv.must(nv.gpfifo_schedule(self.ctl, self.client, self.handle, on), "schedule")

    def timeslice(self, us: int) -> None:
        nv.must(nv.set_timeslice(self.ctl, self.client, self.handle, us), "timeslice")

    def free(self) -> None:
        nv.must(nv.rm_free(self.ctl, self.client, self.client, self.handle), "free")

    def level(self, level: int) -> None:
        nv.must(nv.set_interleave_level(self.ctl, self.client, self.handle, level), "level")


@pytest.fixture
def ctl(nvsim: Path) -> Iterator[int]:
    fd = nv.NvNodes(str(nvsim)).open_ctl()
    yield fd
    os.close(fd)


def new_group(ctl: int, gpu: int = 0, tree: nv.Tree | None = None) -> Group:
    t = tree or nv.build_tree(ctl, gpu)
    return Group(ctl, t.client, nv.alloc_channel_group(ctl, t.client, t.device))


def engine(gpu: int) -> nv.ProcEngine:
    return nv.proc_engines()[gpu]


def wait_until(cond, timeout: float = 10.0, step: float = 0.005) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(step)


def saturate(*groups: Group) -> None:
    """Fills every group's queue and waits until the engine runs them."""
    for g in groups:
        g.submit(MAX_PENDING)
    wait_until(lambda: all(g.busy() > 0 for g in groups))


@dataclass(frozen=True)
class Window:
    busy: list[int]  # ns each group ran
    inner: int  # ns that surely passed between the two reads
    outer: int  # ns that passed at most
    switches: int  # of the engine of the first group

    def saturated(self) -> bool:
        """All of the window went to these groups (one engine, never idle)."""
        return self.inner <= sum(self.busy) <= self.outer


def snapshot(groups: list[Group]) -> tuple[int, int, list[int], int]:
    """(clock before, clock after, each group's busy ns, switches) from one read of the
    proc files: the groups' counters are charged up to a moment between the clocks."""
    t0 = time.monotonic_ns()
    rows = {(g.client, g.group): g.busy_ns for g in nv.proc_groups()}
    switches = engine(0).switches
    t1 = time.monotonic_ns()
    return t0, t1, [rows[(g.client, g.handle)] for g in groups], switches


def window(groups: list[Group], seconds: float = 1.0) -> Window:
    """The groups' busy time over one window of `seconds` (fixed: a share that
    converges late shows in it). Enabled groups' queues are topped up every
    0.2 s, so that saturated groups stay so."""
    a0, a1, before, s0 = snapshot(groups)
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(0.2, left))
        for g in groups:
            s = g.stats()
            if s.enabled and s.pending_ns < MAX_PENDING:
                g.submit(MAX_PENDING - s.pending_ns)
    b0, b1, after, s1 = snapshot(groups)
    return Window([y - x for x, y in zip(before, after, strict=True)], b0 - a1, b1 - a0,
                  s1 - s0)


# ---- running work ----

def test_submit_runs_to_completion(ctl):
    g = new_group(ctl)
    s = g.stats()
    assert s == nv.WorkStats(0, 0, True, 1024)
    g.submit(40 * MS)
    g.submit(60 * MS)
    # busy + pending is what was submitted, at every read.
    seen = []
    while (s := g.stats()).pending_ns:
        assert s.busy_ns + s.pending_ns == 100 * MS
        seen.append(s.busy_ns)
        time.sleep(0.01)
    assert s.busy_ns == 100 * MS
    assert seen and seen == sorted(seen)
    # Nothing more runs: the engine is idle.
    e0 = engine(0)
    time.sleep(0.1)
    e1 = engine(0)
    assert e1.busy_ns == e0.busy_ns and e1.idle_ns > e0.idle_ns
    assert e1.busy_ns == 100 * MS


def rate_ok(w: Window, slice_us: int = 1024) -> bool:
    """Round robin at the time slice: a slice never ends early, so at most one switch
    per slice (1.05 for the reads); and the engine preempts, more than one switch per
    20 slices. A late engine thread lengthens slices (0.5 a slice on a loaded 2-core
    host), so no tighter lower bound holds there."""
    slice_ns = slice_us * 1000
    return w.outer / (20 * slice_ns) < w.switches < 1.05 * w.inner / slice_ns


def test_two_groups_share_equally(ctl):
    a, b = new_group(ctl), new_group(ctl)
    saturate(a, b)
    e0 = engine(0)
    w = window([a, b], 2.0)
    e1 = engine(0)
    assert abs(w.busy[0] / sum(w.busy) - 0.5) < 0.03, w
    # One at a time, and all of the time.
    assert w.saturated(), w
    # Saturated, the engine is never idle: slices hand over directly.
    assert e1.idle_ns == e0.idle_ns
    # Round robin at the time slice (1024 us).
    assert rate_ok(w), w


def test_timeslice_ratio(ctl):
    a, b = new_group(ctl), new_group(ctl)
    a.timeslice(2048)
    assert a.stats().timeslice_us == 2048
    saturate(a, b)
    w = window([a, b], 2.0)
    assert 1.85 < w.busy[0] / w.busy[1] < 2.15, w


def test_interleave_levels_order_the_runlist(ctl):
    """ctrla06c.h's runlist: with L = 2 LOW groups and M = 1 MEDIUM, the MEDIUM
    group appears L times and each LOW once (m l1 m l2: 50 / 25 / 25 of the
    GPU, at equal slices); a HIGH group comes after each of them (M + 1) * L
    times (h m h l1 h m h l2: half the GPU)."""
    med, low1, low2 = new_group(ctl), new_group(ctl), new_group(ctl)
    low1.level(nv.LEVEL_LOW)
    low2.level(nv.LEVEL_LOW)
    saturate(med, low1, low2)

    def near(want: list[float]):
        return lambda w: all(abs(b / sum(w.busy) - x) < 0.03
                             for b, x in zip(w.busy, want, strict=True))

    want = [0.5, 0.25, 0.25]
    w = window([med, low1, low2], 2.0)
    assert near(want)(w), w
    high = new_group(ctl)
    high.level(nv.LEVEL_HIGH)
    saturate(high)
    want = [0.25, 0.125, 0.125, 0.5]
    w = window([med, low1, low2, high], 2.0)
    assert near(want)(w), w
    levels = {(g.client, g.group): g.level for g in nv.proc_groups()}
    assert [levels[(g.client, g.handle)] for g in (med, low1, low2, high)] == [1, 0, 0, 2]


def test_lone_group_runs_without_switches(ctl):
    g = new_group(ctl)
    saturate(g)
    e0 = engine(0)
    w = window([g], 0.5)
    e1 = engine(0)
    assert e1.switches == e0.switches
    assert w.saturated(), w


def test_disabled_group_gets_no_time(ctl):
    a, b = new_group(ctl), new_group(ctl)
    saturate(a, b)
    idle = engine(0).idle_ns
    a.enable(False)
    assert a.stats().enabled is False
    w = window([a, b], 0.5)
    assert w.busy[0] == 0
    assert w.saturated(), w
    # The disable handed the engine to b at once, whoever was running.
    assert engine(0).idle_ns == idle
    # Work submitted while disabled waits.
    s = a.stats()
    more = min(MS, MAX_PENDING - s.pending_ns)
    a.submit(more)
    time.sleep(0.05)
    assert a.stats() == nv.WorkStats(s.busy_ns, s.pending_ns + more, False, 1024)
    a.enable(True)
    time.sleep(0.05)
    w = window([a, b], 1.0)
    assert abs(w.busy[0] / sum(w.busy) - 0.5) < 0.05, w


def test_disable_preempts_the_running_group(ctl):
    a = new_group(ctl)
    saturate(a)
    a.enable(False)
    busy = a.busy()
    time.sleep(0.2)
    assert a.busy() == busy
    # The engine goes idle at once: all of the window is idle time.
    e0 = engine(0)
    time.sleep(0.2)
    e1 = engine(0)
    assert e1.busy_ns == e0.busy_ns


def test_gpus_run_in_parallel(ctl):
    a, b = new_group(ctl, 0), new_group(ctl, 1)
    assert [(p.gpu, p.client, p.group) for p in nv.proc_groups()] == [
        (0, a.client, a.handle), (1, b.client, b.handle)]
    saturate(a, b)
    w = window([a, b], 1.0)
    # each engine saturated all of the window: in parallel
    assert all(w.inner <= busy <= w.outer for busy in w.busy), w


def test_busy_plus_idle_is_wall_time(ctl):
    a = new_group(ctl)
    a0 = time.monotonic_ns()
    e0 = nv.proc_engines()
    a1 = time.monotonic_ns()
    a.submit(300 * MS)
    time.sleep(1.0)
    b0 = time.monotonic_ns()
    e1 = nv.proc_engines()
    b1 = time.monotonic_ns()
    for x, y in zip(e0, e1, strict=True):
        elapsed = (y.busy_ns + y.idle_ns) - (x.busy_ns + x.idle_ns)
        # Both are CLOCK_MONOTONIC: the engine's time is within the reads' brackets.
        assert b0 - a1 <= elapsed <= b1 - a0, (x, y, b0 - a1, b1 - a0)
    assert e1[0].busy_ns - e0[0].busy_ns == 300 * MS
    assert e1[1].busy_ns == e0[1].busy_ns


def test_timeslice_change_takes_effect(ctl):
    a, b = new_group(ctl), new_group(ctl)
    saturate(a, b)
    b.timeslice(3072)
    time.sleep(0.05)
    w = window([a, b], 2.0)
    assert 2.7 < w.busy[1] / w.busy[0] < 3.3, w


# ---- lifetimes ----

def test_free_running_group(ctl):
    t = nv.build_tree(ctl)
    a, b = new_group(ctl, tree=t), new_group(ctl, tree=t)
    saturate(a, b)
    e0 = engine(0)
    a.free()
    assert [(p.client, p.group) for p in nv.proc_groups()] == [(b.client, b.handle)]
    assert nv.work_stats(ctl, a.client, a.handle)[1] == nv.NV_ERR_INVALID_OBJECT_HANDLE
    w = window([b], 0.5)
    assert w.saturated(), w
    # A cascade from the device frees b while it runs; then the client.
    c = new_group(ctl, tree=t)
    c.submit(SEC)
    nv.must(nv.rm_free(ctl, t.client, t.client, t.device), "free device")
    assert nv.proc_groups() == []
    e1 = engine(0)
    time.sleep(0.1)
    assert engine(0).busy_ns == e1.busy_ns
    assert e1.busy_ns > e0.busy_ns
    d = new_group(ctl)
    d.submit(MAX_PENDING)
    wait_until(lambda: d.busy() > 0)
    nv.must(nv.rm_free(ctl, d.client, 0, d.client), "free client")
    assert nv.proc_groups() == []


def test_close_fd_while_running(nvsim):
    nodes = nv.NvNodes(str(nvsim))
    for _ in range(5):
        fd = nodes.open_ctl()
        groups = [new_group(fd, gpu) for gpu in (0, 1, 0)]
        for g in groups:
            g.submit(MAX_PENDING)
        wait_until(lambda groups=groups: groups[0].busy() > 0 and groups[1].busy() > 0)
        os.close(fd)
        assert nv.proc_groups() == []
    e0 = nv.proc_engines()
    time.sleep(0.1)
    assert [e.busy_ns for e in nv.proc_engines()] == [e.busy_ns for e in e0]


def test_rmmod_right_after_submit():
    if loaded("nvsim"):
        pytest.skip("nvsim is loaded by someone else")
    for i in range(4):
        insmod(NVSIM_KO, "gpus=2", "mem_mib=64")
        try:
            wait_path(Path("/dev/nvsim/nvidiactl"))
            fd = nv.NvNodes().open_ctl()
            try:
                for gpu in (0, 1):
                    g = new_group(fd, gpu)
                    g.submit(MAX_PENDING)
                    if i % 2:
                        g.enable(False)
                        g.enable(True)
            finally:
                os.close(fd)
        finally:
            res = rmmod("nvsim")
        assert res.returncode == 0, res.stderr
        assert not PROC_DIR.exists()
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(FileNotFoundError):
            assert not comm.read_text().startswith("nvsim-engine")


# ---- views ----

def test_proc_views(ctl):
    assert PROC_DIR.joinpath("groups").read_text().splitlines() == [nv.PROC_GROUPS_HEADER]
    lines = PROC_DIR.joinpath("engines").read_text().splitlines()
    assert lines[0] == nv.PROC_ENGINES_HEADER and len(lines) == 3
    assert [e.gpu for e in nv.proc_engines()] == [0, 1]
    a = new_group(ctl, 1)
    a.submit(20 * MS)
    wait_until(lambda: a.stats().pending_ns == 0)
    # The engine's timer woke its thread at the end of a's work (and of each
    # slice before it); the lateness counters add up.
    e = nv.proc_engines()[1]
    assert e.timer_wakes >= 1 and e.late_1ms <= e.timer_wakes
    assert 0 <= e.late_sum_ns <= e.timer_wakes * e.late_max_ns
    b = new_group(ctl, 0)
    b.enable(False)
    b.timeslice(3000)
    b.submit(5 * MS)
    line = next(x for x in PROC_DIR.joinpath("groups").read_text().splitlines()
                if x.startswith("0 "))
    fields = line.split(" ")
    head, wait = " ".join(fields[:8]), fields[8]
    assert head == f"0 {b.client:#x} {b.handle:#x} {os.getpid()} 0 3000 {5 * MS} 0"
    assert fields[9:] == ["0"] * 5 + ["1"]  # off: never ready, preempted, woken; MEDIUM
    # Off with work pending: b waits (wait_ns grows); a, on, never waited.
    time.sleep(0.05)
    rows = {(p.client, p.group): p for p in nv.proc_groups()}
    assert rows[b.client, b.handle].wait_ns > int(wait) > 0
    assert rows[a.client, a.handle].wait_ns == 0
    # Handles are per client: a row is named by client and group.
    assert len(rows) == 2
    # GET_WORK_STATS and the proc view agree (both are still).
    for g in (a, b):
        s = g.stats()
        p = rows[g.client, g.handle]
        assert p.tgid == os.getpid()
        assert (p.busy_ns, p.pending_ns, p.enabled, p.timeslice_us) == (
            s.busy_ns, s.pending_ns, s.enabled, s.timeslice_us)
    assert rows[a.client, a.handle].gpu == 1
    assert rows[a.client, a.handle].busy_ns == 20 * MS
    assert rows[b.client, b.handle].gpu == 0


def test_stats_agree_while_running(ctl):
    a = new_group(ctl)
    saturate(a)
    s0 = a.stats()
    p = next(x for x in nv.proc_groups() if x.group == a.handle)
    s1 = a.stats()
    assert s0.busy_ns <= p.busy_ns <= s1.busy_ns
    assert p.busy_ns + p.pending_ns == s0.busy_ns + s0.pending_ns


# ---- bad input ----

def test_submit_bad_input(nvsim, ctl):
    t = nv.build_tree(ctl)
    g = new_group(ctl, tree=t)
    g.enable(False)
    mem = nv.must(nv.alloc_memory(ctl, t.client, t.device, 1 << 20), "mem").handle
    nr = nv.ESC_NVSIM_SUBMIT_WORK
    good = nv.SUBMIT_WORK.pack(t.client, g.handle, MS, 0, 0)
    # Sizes are exact, directly and through XFER; the GPU and UVM nodes refuse it.
    for size in (0, 8, 23, 25, 32):
        b = nv.cbuf(good.ljust(32, b"\0"))
        assert nv.nv_ioctl(ctl, nr, b, size=size) == 22, size
        assert nv.nv_ioctl(ctl, nr, b, size=size, xfer=True) == 22, size
    gpu = os.open(nvsim / "nvidia0", os.O_RDWR)
    uvm = os.open(nvsim / "nvidia-uvm", os.O_RDWR)
    try:
        assert nv.nv_ioctl(gpu, nr, nv.cbuf(good)) == 22
        assert nv.nv_ioctl(uvm, nr, nv.cbuf(good)) == 22
    finally:
        os.close(gpu)
        os.close(uvm)
    assert nv.nv_ioctl(ctl, nr, 0xDEAD000000000000, size=24) == 14
    other = nv.NvNodes(str(nvsim)).open_ctl()
    try:
        oc = nv.alloc_client(other)
        cases = [
            (nv.submit_work(ctl, 0x0BAD0BAD, g.handle, MS), nv.NV_ERR_INVALID_CLIENT),
            (nv.submit_work(ctl, oc, g.handle, MS), nv.NV_ERR_INVALID_CLIENT),
            (nv.submit_work(other, t.client, g.handle, MS), nv.NV_ERR_INVALID_CLIENT),
            (nv.submit_work(ctl, t.client, 0x0BAD0BAD, MS), nv.NV_ERR_INVALID_OBJECT_HANDLE),
            (nv.submit_work(ctl, t.client, 0, MS), nv.NV_ERR_INVALID_OBJECT_HANDLE),
            (nv.submit_work(ctl, t.client, t.client, MS), nv.NV_ERR_INVALID_OBJECT_HANDLE),
            (nv.submit_work(ctl, t.client, t.device, MS), nv.NV_ERR_INVALID_OBJECT_HANDLE),
            (nv.submit_work(ctl, t.client, t.subdevice, MS), nv.NV_ERR_INVALID_OBJECT_HANDLE),
            (nv.submit_work(ctl, t.client, mem, MS), nv.NV_ERR_INVALID_OBJECT_HANDLE),
            (nv.submit_work(ctl, t.client, g.handle, 0), nv.NV_ERR_INVALID_ARGUMENT),
            (nv.submit_work(ctl, t.client, g.handle, MS, reserved=1),
             nv.NV_ERR_INVALID_ARGUMENT),
            (nv.submit_work(ctl, t.client, g.handle, 2**64 - 1),
             nv.NV_ERR_INSUFFICIENT_RESOURCES),
            (nv.submit_work(ctl, t.client, g.handle, MAX_PENDING + 1),
             nv.NV_ERR_INSUFFICIENT_RESOURCES),
        ]
    finally:
        os.close(other)
    for i, (r, want) in enumerate(cases):
        assert (i, r) == (i, (0, want))
    assert g.stats().pending_ns == 0
    # The cap is on pending work: filling it exactly works, one more ns does not.
    assert nv.submit_work(ctl, t.client, g.handle, MAX_PENDING - 5, xfer=True) == (0, 0)
    assert nv.submit_work(ctl, t.client, g.handle, 5) == (0, 0)
    assert nv.submit_work(ctl, t.client, g.handle, 1) == (0, nv.NV_ERR_INSUFFICIENT_RESOURCES)
    assert g.stats() == nv.WorkStats(0, MAX_PENDING, False, 1024)


def test_work_stats_bad_input(ctl):
    t = nv.build_tree(ctl)
    g = new_group(ctl, tree=t)
    cmd = nv.NVSIM_CTRL_CMD_GET_WORK_STATS
    z = bytes(nv.WORK_STATS.size)
    cases = [
        (nv.rm_control(ctl, t.client, g.handle, cmd, z[:16]), nv.NV_ERR_INVALID_PARAM_STRUCT),
        (nv.rm_control(ctl, t.client, g.handle, cmd, z + z), nv.NV_ERR_INVALID_PARAM_STRUCT),
        (nv.rm_control(ctl, t.client, g.handle, cmd, None), nv.NV_ERR_INVALID_PARAM_STRUCT),
        (nv.rm_control(ctl, t.client, g.handle, cmd, None, params_size=24),
         nv.NV_ERR_INVALID_ARGUMENT),
        (nv.rm_control(ctl, t.client, g.handle, cmd, None, params_ptr=0xDEAD000000000000,
                       params_size=24), nv.NV_ERR_INVALID_ADDRESS),
        (nv.rm_control(ctl, t.client, t.subdevice, cmd, z), nv.NV_ERR_NOT_SUPPORTED),
        (nv.rm_control(ctl, t.client, t.device, cmd, z), nv.NV_ERR_NOT_SUPPORTED),
        (nv.rm_control(ctl, t.client, 0x0BAD0BAD, cmd, z), nv.NV_ERR_INVALID_OBJECT_HANDLE),
        (nv.rm_control(ctl, 0x0BAD0BAD, g.handle, cmd, z), nv.NV_ERR_INVALID_CLIENT),
    ]
    for i, (r, want) in enumerate(cases):
        assert (i, r[0], r[1]) == (i, 0, want)
    assert nv.work_stats(ctl, t.client, g.handle, xfer=True)[2] == nv.WorkStats(0, 0, True, 1024)


def test_engine_fuzz(ctl):
    """Random submits, schedules, slices, frees and stats; every call answers."""
    rng = random.Random(int(os.environ.get("NVSIM_FUZZ_SEED", "7")))
    t = nv.build_tree(ctl)
    groups = [new_group(ctl, gpu) for gpu in (0, 1, 0, 1)]
    handles = [g.handle for g in groups] + [t.device, t.subdevice, 0, 0xFFFFFFFF]
    clients = [t.client] + [g.client for g in groups] + [0, 0x0BAD0BAD]
    ok = {nv.NV_OK, nv.NV_ERR_INVALID_CLIENT, nv.NV_ERR_INVALID_OBJECT_HANDLE,
          nv.NV_ERR_INVALID_ARGUMENT, nv.NV_ERR_INSUFFICIENT_RESOURCES,
          nv.NV_ERR_NOT_SUPPORTED}
    for _ in range(int(os.environ.get("NVSIM_FUZZ_CALLS", "3000"))):
        c, h = rng.choice(clients), rng.choice(handles)
        op = rng.randrange(6)
        if op == 0:
            work = rng.choice([0, 1, MS, rng.getrandbits(64), rng.getrandbits(34)])
            r = nv.submit_work(ctl, c, h, work, reserved=rng.choice([0, 0, 0, 1]),
                               xfer=rng.random() < 0.2)
        elif op == 1:
            r = nv.gpfifo_schedule(ctl, c, h, rng.random() < 0.5)
        elif op == 2:
            r = nv.set_timeslice(ctl, c, h, rng.choice([0, 1, 100, 1024, 2**64 - 1]))
        elif op == 3:
            r = nv.work_stats(ctl, c, h)[:2]
        elif op == 4 and rng.random() < 0.05:
            r = nv.rm_free(ctl, c, c, h)
        else:
            raw = nv.cbuf(rng.randbytes(nv.SUBMIT_WORK.size))
            r = (nv.nv_ioctl(ctl, nv.ESC_NVSIM_SUBMIT_WORK, raw),
                 nv.SUBMIT_WORK.unpack(raw.raw)[3])
        assert r[0] == 0 and r[1] in ok, (op, c, h, r)
    for p in nv.proc_groups():
        assert p.pending_ns <= MAX_PENDING
    for c in clients[:-2]:
        nv.rm_free(ctl, c, c, c)
    assert nv.proc_groups() == []
    # A group with a huge time slice still yields to a disable.
    g = new_group(ctl)
    g.timeslice(2**64 - 1)
    assert g.stats().timeslice_us == 2**32 - 1
    saturate(g)
    g.enable(False)
    busy = g.busy()
    time.sleep(0.05)
    assert g.busy() == busy


# ---- through the interposer ----

def test_submit_through_vgpu(vgpu):
    fd = nv.NvNodes(str(vgpu)).open_ctl()
    try:
        g = new_group(fd, 1)
        before = nv.rm_calls()
        g.submit(30 * MS)
        assert nv.rm_calls() == before + 1
        wait_until(lambda: g.stats().pending_ns == 0)
        assert g.stats() == nv.WorkStats(30 * MS, 0, True, 1024)
        assert nv.proc_groups()[0].tgid == os.getpid()
    finally:
        os.close(fd)
    assert nv.proc_groups() == []
