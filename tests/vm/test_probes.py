"""The latency probes (ebpf/, vgpud/probes/) in the real kernel, with real bcc.

Each test starts the real daemon with its probes (one bcc compile each) and a
tenant process (uid 1003, tenant "a"; uid 1004 is tenant "b"), then reads
the histograms the way an operator does: `vgpuctl latency --json` over a
private system bus. Durations are made known by nvsim's injected delay
(delay_nr / delay_us) and by stopping the daemon, and checked against bcc's
own funclatency on nvsim's ioctl handler; slot wait against nvsim's own
wait_ns counter (/proc/driver/nvsim/groups).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.bus import PrivateBus
from tests.support.guest import (
    NVSIM_DIR,
    ROOT,
    insmod_vgpu,
    remove_cgroup,
    rmmod,
    set_param,
    wait_for,
)
from tests.support.hostile import TENANT_UID, spawn_tenant
from tests.support.sched import TRACEFS
from tests.support.tdma import CGROOT, Tenants, config_text
from tests.support.vgpud_proc import Daemon
from vgpud.nvidia.escapes import Ctrl, Escape
from vgpud.probes.bcc_probes import (
    BACKING_HANDLERS,
    SCHEDULE_HANDLER,
    kprobe_modules,
    module_load_id,
)
from vgpud.probes.histograms import slot_bounds

pytestmark = pytest.mark.vm

FB_KIND = f"RM_CONTROL:{Ctrl.FB_GET_INFO_V2:#x}"
OTHER_UID = TENANT_UID + 1

CONFIG = f"""\
[daemon]
state_path = "{{state}}"
charges_path = "{{charges}}"

[probes]
interval_ms = 200

[[tenant]]
name = "a"
memory = "256MiB"
match = [{{{{ uid = {TENANT_UID} }}}}]

[[tenant]]
name = "b"
memory = "256MiB"
match = [{{{{ uid = {OTHER_UID} }}}}]
"""

# A tenant that builds its tree, says "ready" and its pid, then for each line
# "N" makes N FB_GET_INFO_V2 calls and answers "done".
FB_CALLER = r"""
import os, sys
from tests.support import nvclient as nv
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(fd)
print("ready", os.getpid(), flush=True)
for line in sys.stdin:
    for _ in range(int(line)):
        nv.must(nv.fb_get_info_v2(fd, tree.client, tree.subdevice, [0]), "fb info")
    print("done", flush=True)
"""


@pytest.fixture
def probe_daemon(vgpu: Path, daemon_factory, tmp_path: Path) -> Iterator[Daemon]:
    if not (TRACEFS / "events").exists():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=False)
    bus = PrivateBus()
    os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = bus.address
    config = tmp_path / "vgpud.toml"
    config.write_text(CONFIG.format(state=tmp_path / "state.json", charges=tmp_path / "charges"))
    daemon = daemon_factory("--config", str(config), probes=True).start()
    try:
        wait_probes_on(daemon)
        yield daemon
    finally:
        daemon.stop()
        print(daemon.log())
        bus.close()
        del os.environ["DBUS_SYSTEM_BUS_ADDRESS"]
        set_param("nvsim", "delay_us", "0")
        set_param("nvsim", "delay_nr", "-1")


def wait_probes_on(daemon: Daemon, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while "latency probes attached" not in daemon.log():
        assert "latency probes off" not in daemon.log(), daemon.log()
        assert time.monotonic() < deadline, f"no probes after {timeout} s:\n{daemon.log()}"
        time.sleep(0.5)


def vgpuctl(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "vgpud.cli", *args], check=True,
                          capture_output=True, text=True, cwd=ROOT).stdout


def latency(tenant: str, kind: str = "") -> dict[tuple[str, str], list[int]]:
    """(kind, histogram) -> counts by bucket, from `vgpuctl latency --json`."""
    rows = json.loads(vgpuctl("latency", "--tenant", tenant, "--kind", kind, "--by-kind",
                              "--json"))[tenant]
    return {(r["kind"], r["histogram"]): r["counts"] for r in rows}


def settled(tenant: str, kind: str, hist: str, n: int, timeout: float = 60) -> list[int]:
    """The counts once the daemon has read ``n`` events of (kind, hist)."""
    deadline = time.monotonic() + timeout
    while True:
        counts = latency(tenant, kind).get((kind, hist), [])
        if sum(counts) >= n or time.monotonic() > deadline:
            return counts
        time.sleep(0.3)


class Caller:
    def __init__(self, uid: int = TENANT_UID) -> None:
        self.proc = spawn_tenant(FB_CALLER, stdin=True, uid=uid)
        word, pid = self._line().split()
        assert word == "ready"
        self.pid = int(pid)

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read() if self.proc.stderr else "tenant died"
        return line.strip()

    def send(self, n: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()

    def calls(self, n: int) -> None:
        self.send(n)
        assert self._line() == "done"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def slot_of(ns: int) -> int:
    return ns.bit_length()


def test_exact_counts_per_tenant_and_kind(probe_daemon: Daemon) -> None:
    n = 37
    a = Caller()
    b = Caller(OTHER_UID)
    try:
        a.calls(n)
        total = settled("a", FB_KIND, "total", n)
        upcall = settled("a", FB_KIND, "upcall", n)
        driver = settled("a", FB_KIND, "driver", n)
        time.sleep(1)  # a few more reads: nothing more comes
        after = latency("a", FB_KIND)
        theirs = latency("b")
    finally:
        a.close()
        b.close()
    print(f"a: total {total}, upcall {upcall}, driver {driver}; b: {theirs}")
    # FB_GET_INFO_V2 of a tenant with a limit: IOCTL + POST upcalls, one driver call.
    assert sum(total) == sum(upcall) == sum(driver) == n
    assert after[(FB_KIND, "total")] == total
    assert all(kind != FB_KIND for kind, _ in theirs), theirs
    # b built its tree (RM_ALLOC of tree classes): those are its calls, not a's.
    assert sum(sum(c) for (_, h), c in theirs.items() if h == "total") >= 3


def test_injected_driver_delay_lands_in_its_bucket(probe_daemon: Daemon) -> None:
    delay_us, n = 9000, 20
    want = slot_of(delay_us * 1000)
    a = Caller()
    try:
        set_param("nvsim", "delay_nr", str(int(Escape.RM_CONTROL)))
        set_param("nvsim", "delay_us", str(delay_us))
        a.calls(n)
        set_param("nvsim", "delay_us", "0")
        driver = settled("a", FB_KIND, "driver", n)
        upcall = latency("a", FB_KIND)[(FB_KIND, "upcall")]
    finally:
        a.close()
    low, high = slot_bounds(want)
    print(f"delay {delay_us} us -> bucket {want} ({low}..{high} ns); driver {driver}")
    assert sum(driver) == n
    assert not any(driver[:want]), "a driver call shorter than the injected delay"
    assert driver[want] > n // 2, "the delay's bucket is not the driver time's p50"
    # The daemon was not slowed: its wait stays below the driver's delay.
    assert sum(upcall[:want]) > n // 2, upcall


SYS_IOCTL = 16  # x86-64


def in_ioctl(pid: int) -> bool:
    """The process sleeps in ioctl(2): its call went up and waits for a verdict."""
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0] == str(SYS_IOCTL)
    except (OSError, IndexError):
        return False


def stopped(pid: int) -> bool:
    """Every thread of the process is stopped (SIGSTOP takes effect at each
    thread's next entry to the kernel: a thread running on another vCPU
    may answer one more call first)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended
            states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
    return all(state == "T" for state in states)


def test_upcall_wait_moves_only_when_the_daemon_is_slow(probe_daemon: Daemon) -> None:
    stalled, n = 3, 10
    # Buckets from here on hold 2^29 ns (537 ms) and more: far above any verdict
    # of a running daemon, below the 0.8 s a stopped one makes a caller wait
    # (once its call is up: a slow guest may take that long to make it).
    slow = slot_of(2**29)
    a = Caller()
    assert probe_daemon.proc is not None
    try:
        a.calls(n)
        quick = settled("a", FB_KIND, "upcall", n)
        assert not any(quick[slow:]), f"a verdict took over 537 ms unstopped: {quick}"
        for _ in range(stalled):
            probe_daemon.proc.send_signal(signal.SIGSTOP)
            try:
                wait_for(lambda: stopped(probe_daemon.proc.pid), 60, "the daemon to stop")
                a.send(1)
                wait_for(lambda: in_ioctl(a.pid), 60, "the call to wait for its verdict")
                time.sleep(0.8)
            finally:
                probe_daemon.proc.send_signal(signal.SIGCONT)
            assert a._line() == "done"
        upcall = settled("a", FB_KIND, "upcall", n + stalled)
        driver = latency("a", FB_KIND)[(FB_KIND, "driver")]
    finally:
        a.close()
    print(f"upcall {upcall}; driver {driver}")
    assert sum(upcall[slow:]) == stalled
    assert not any(driver[slow:]), "the driver's time moved with the daemon's"


FUNCLATENCY = shutil.which("funclatency-bpfcc") or shutil.which("funclatency")
_ROW = re.compile(r"^\s*(\d+)\s*->\s*(\d+)\s*:\s*(\d+)\s*\|")


@pytest.mark.skipif(FUNCLATENCY is None, reason="bcc's funclatency (bpfcc-tools) not installed")
def test_driver_time_agrees_with_funclatency(probe_daemon: Daemon) -> None:
    """bcc's own tool on nvsim_ioctl, for the tenant's process: the same count
    of driver calls and the same p50 bucket as vgpud's driver-time histogram."""
    delay_us, n = 3000, 25
    a = Caller()
    assert FUNCLATENCY is not None
    # Unbuffered: its "Tracing ..." line says it is attached.
    tool = subprocess.Popen([FUNCLATENCY, "-p", str(a.pid), "nvsim_ioctl"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert tool.stdout is not None
        head = tool.stdout.readline()
        assert "Tracing" in head, head + tool.stdout.read()
        set_param("nvsim", "delay_nr", str(int(Escape.RM_CONTROL)))
        set_param("nvsim", "delay_us", str(delay_us))
        a.calls(n)
        set_param("nvsim", "delay_us", "0")
        ours_by_kind = latency("a")
        tool.send_signal(signal.SIGINT)
        out, _ = tool.communicate(timeout=120)
    finally:
        if tool.poll() is None:
            tool.kill()
        a.close()
    theirs = [0] * 65
    for line in out.splitlines():
        m = _ROW.match(line)
        if m:
            theirs[int(m.group(1)).bit_length()] += int(m.group(3))
    ours = [0] * 65
    for (_, hist), counts in ours_by_kind.items():
        if hist == "driver":
            for slot, c in enumerate(counts):
                ours[slot] += c
    print(f"funclatency:\n{out}\nvgpud driver histogram: {ours}")
    assert sum(theirs) == n  # the tree was built before the tool attached
    assert sum(ours) >= n
    ours_fb = ours_by_kind[(FB_KIND, "driver")]

    def p50(counts: list[int]) -> int:
        seen = 0
        for slot, c in enumerate(counts):
            seen += c
            if 2 * seen >= sum(counts):
                return slot
        raise AssertionError("empty")

    assert sum(ours_fb) == n
    assert p50(ours_fb) == p50(theirs)


def test_probes_detach_at_stop(vgpu: Path, probe_daemon: Daemon) -> None:
    """The module is pinned while the probes are attached, and only then."""
    assert int(Path("/sys/module/vgpu/refcnt").read_text()) > 0
    assert probe_daemon.stop() == 0
    assert int(Path("/sys/module/vgpu/refcnt").read_text()) == 0


def test_no_bcc_the_daemon_serves_and_says_why(vgpu: Path, daemon_factory,
                                               tmp_path: Path) -> None:
    fake = tmp_path / "nobcc" / "bcc"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('bcc hidden by the test')\n")
    bus = PrivateBus()
    os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = bus.address
    old_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{fake.parent}:{old_path}"
    config = tmp_path / "vgpud.toml"
    config.write_text(CONFIG.format(state=tmp_path / "state.json", charges=tmp_path / "charges"))
    try:
        daemon = daemon_factory("--config", str(config), probes=True).start()
        os.environ["PYTHONPATH"] = old_path
        a = Caller()
        try:
            a.calls(2)  # decided by the daemon: FB_GET_INFO_V2 with a limit
        finally:
            a.close()
        status = json.loads(vgpuctl("status", "--json"))
        res = subprocess.run([sys.executable, "-m", "vgpud.cli", "latency", "--tenant", "a"],
                             capture_output=True, text=True, cwd=ROOT)
    finally:
        os.environ["PYTHONPATH"] = old_path
        bus.close()
        del os.environ["DBUS_SYSTEM_BUS_ADDRESS"]
    print(daemon.log())
    assert "latency probes off: bcc is not importable" in daemon.log()
    assert status["probes"].startswith("off: bcc is not importable"), status
    assert res.returncode == 1 and "ProbesOff" in res.stderr + res.stdout, res
    assert int(Path("/sys/module/vgpu/refcnt").read_text()) == 0
    assert (NVSIM_DIR / "nvidiactl").exists()


def test_slot_wait_follows_the_weights_and_nvsims_counters(vgpu: Path, daemon_factory,
                                                          tmp_path: Path) -> None:
    """Two saturating tenants at weights 3:1: the 1-weight tenant waits longer with
    work pending, and each tenant's slot wait (the sum of its episodes) agrees
    with nvsim's own wait_ns to within one frame, once their work has drained."""
    if not (CGROOT / "cgroup.controllers").exists():
        pytest.skip("cgroup v2 is not mounted at /sys/fs/cgroup in this guest")
    frame_ns = 100_000_000
    groups = [CGROOT / f"vgpu-tdma-t{i}" for i in range(2)]
    for path in groups:
        path.mkdir(exist_ok=True)
    config = tmp_path / "vgpud.toml"
    config.write_text(config_text(tmp_path / "state.json", [300, 100]).replace(
        "[daemon]\n", f'[daemon]\ncharges_path = "{tmp_path / "charges"}"\n')
        + "\n[probes]\ninterval_ms = 200\n")
    bus = PrivateBus()
    os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = bus.address
    daemon = daemon_factory("--config", str(config), log_level="info", probes=True).start()
    tenants = None
    try:
        wait_probes_on(daemon)
        assert "tracepoint nvsim:nvsim_group_work" in daemon.log()
        tenants = Tenants(2, queue_ms=500, period_ms=100)
        wait_for(lambda: min(tenants.busy()) > 0, 60, "the daemon to run both tenants")
        time.sleep(5)
        for i in range(2):
            tenants.command(i, "idle")
        wait_for(lambda: max(tenants.all_pending()) == 0, 120, "both tenants' work to drain")
        truth = {g.client: g.wait_ns for g in nv.proc_groups()}
        nvsim_wait = [truth[c] for c in tenants.clients]
        time.sleep(1)  # the daemon's next reads
        ours = []
        for name in ("t0", "t1"):
            rows = json.loads(vgpuctl("latency", "--tenant", name, "--kind", "SCHEDULE",
                                      "--by-kind", "--json"))[name]
            ours.append(next((r["sum_ns"] for r in rows if r["histogram"] == "slot"), 0))
    finally:
        if tenants is not None:
            tenants.close()
        daemon.stop()
        print(daemon.log())
        bus.close()
        del os.environ["DBUS_SYSTEM_BUS_ADDRESS"]
        for path in groups:
            remove_cgroup(path)
    print(f"slot wait t0 (weight 3) / t1 (weight 1): probes {ours} ns, nvsim {nvsim_wait} ns")
    assert ours[1] > ours[0], "the 1-weight tenant should wait longer"
    for mine, theirs in zip(ours, nvsim_wait, strict=True):
        assert abs(mine - theirs) <= frame_ns, (ours, nvsim_wait)


# A tenant that wraps N escapes of numbers it picks (0x1000 and up) in
# IOCTL_XFER_CMD: one call each, refused by the driver (EINVAL).
XFER_FLOOD = r"""
import ctypes, os, sys
from tests.support import nvclient as nv
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
buf = ctypes.create_string_buffer(32)
for nr in range(0x1000, 0x1000 + int(sys.argv[1])):
    nv.nv_ioctl(fd, nr, buf, xfer=True)
print("done", flush=True)
"""


def test_a_tenant_cannot_fill_the_map_with_numbers_it_picks(probe_daemon: Daemon) -> None:
    """uid 1003 sends 3,000 escapes under 3,000 numbers of its own: they land in one
    histogram (OTHER), all counted (nvsim received them all), and another tenant's
    calls meanwhile are counted exactly."""
    n, fb = 3000, 20
    before = int(Path("/sys/module/nvsim/parameters/rm_calls").read_text())
    b = Caller(OTHER_UID)
    try:
        flood = spawn_tenant(XFER_FLOOD.replace("sys.argv[1]", str(n)))
        b.calls(fb)
        out, err = flood.communicate(timeout=600)
        assert out.strip() == "done", err
        received = int(Path("/sys/module/nvsim/parameters/rm_calls").read_text()) - before
        mine = settled("a", "OTHER", "total", n)
        kinds = latency("a")
        theirs = settled("b", FB_KIND, "total", fb)
    finally:
        b.close()
    print(f"a's kinds: {sorted({k for k, _ in kinds})}; nvsim received {received}")
    assert received >= n + fb
    assert sum(mine) == n
    assert len({k for k, _ in kinds}) <= 4, kinds  # OTHER, and the OPEN upcall
    assert sum(theirs) == fb


def test_a_probed_modules_reload_is_told_by_its_load_id(vgpu: Path) -> None:
    """How the probes find their kprobes' targets and tell that one was
    reloaded (to attach again) without /proc/kallsyms, which the helper's
    sandbox hides: each handler's module from tracefs's traceable functions,
    and the inode of that module's sysfs directory, new at each load."""
    if not (TRACEFS / "events").exists():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=False)
    assert kprobe_modules([*BACKING_HANDLERS, SCHEDULE_HANDLER]) == {
        "nvsim_ioctl": "nvsim", SCHEDULE_HANDLER: "vgpu"}
    before = module_load_id("vgpu")
    assert before is not None and module_load_id("nvsim") is not None
    assert rmmod("vgpu").returncode == 0
    assert module_load_id("vgpu") is None
    insmod_vgpu()
    assert module_load_id("vgpu") not in (before, None)
