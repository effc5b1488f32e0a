"""TDMA tenants in the VM: cgroups t0..tN-1 under /sys/fs/cgroup, the daemon's
config giving them weights, their workload (tests/support/tdma_workload.py),
and their GPU time read from nvsim's own counters (/proc/driver/nvsim/groups).
Used by tests/vm/test_tdma.py, tests/vm/test_runlist_mode.py and the
benchmarks; ``TdmaWorld`` is the cgroups, config, daemon and workloads of one
test, ``measure`` reads shares over one window after a fixed settle.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support import tdma_workload
from tests.support.bus import PrivateBus
from tests.support.guest import ROOT, remove_cgroup, wait_for
from tests.support.vgpud_proc import Daemon
from vgpud.admin.client import AdminClient

CGROOT = Path("/sys/fs/cgroup")


def config_text(state: Path, weights: Sequence[int], frame_ms: int = 100,
                mode: str = "frame", daemon: str = "",
                tenant: Mapping[int, str] | None = None) -> str:
    """Tenant i: cgroup t{i}, weights[i] (and the lines tenant[i]); ``daemon``:
    more [daemon] lines. Frame mode unless ``mode`` says otherwise."""
    text = (f'[daemon]\nstate_path = "{state}"\nframe_ms = {frame_ms}\n'
            f'sched_mode = "{mode}"\n{daemon}')
    for i, weight in enumerate(weights):
        text += (f'\n[[tenant]]\nname = "t{i}"\nweight = {weight}\n'
                 f'match = [{{ cgroup = "/vgpu-tdma-t{i}" }}]\n{(tenant or {}).get(i, "")}')
    return text


class Tenants:
    """The workload process(es) and what they allocated; tenant i is cgroup t{i}.

    Each tenant's pending work is kept at `queue_ms` or more, checked every
    `period_ms` (the workload's --target-ms and --period-ms)."""

    def __init__(self, count: int, per_process: int = 16, queue_ms: float = 40.0,
                 period_ms: float = 10.0, cgroups: Sequence[int] | None = None) -> None:
        """``count`` channel groups, group i in cgroup t{cgroups[i]} (t{i} by default):
        a tenant with several groups is listed several times. The methods take and
        give group indexes."""
        self.procs: list[subprocess.Popen[str]] = []
        self.where: list[tuple[int, int]] = []  # tenant -> (process, index in it)
        self.clients: list[int] = []
        cgroup = list(cgroups) if cgroups is not None else list(range(count))
        for first in range(0, count, per_process):
            ids = range(first, min(count, first + per_process))
            argv = ["/dev/vgpu", "--target-ms", str(queue_ms), "--period-ms", str(period_ms)]
            for i in ids:
                argv += ["--cgroup", str(CGROOT / f"vgpu-tdma-t{cgroup[i]}")]
            proc = subprocess.Popen(tdma_workload.command(*argv), cwd=ROOT,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.procs.append(proc)
            self.where += [(len(self.procs) - 1, j) for j in range(len(ids))]
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, "the workload died (see its stderr)"
            self.clients += [t["client"] for t in json.loads(line)["tenants"]]

    def command(self, tenant: int, what: str) -> None:
        proc, index = self.where[tenant]
        stdin = self.procs[proc].stdin
        assert stdin is not None
        stdin.write(f"{what} {index}\n")
        stdin.flush()

    def busy(self) -> list[int]:
        by_client = {g.client: g.busy_ns for g in nv.proc_groups()}
        return [by_client[c] for c in self.clients]

    def pending(self, tenant: int) -> int:
        return next(g.pending_ns for g in nv.proc_groups() if g.client == self.clients[tenant])

    def all_pending(self) -> list[int]:
        by_client = {g.client: g.pending_ns for g in nv.proc_groups()}
        return [by_client[c] for c in self.clients]

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def open_as_tenant(i: int) -> int:
    """A nvidiactl file of tenant i: opened from inside its cgroup, then back home."""
    home = CGROOT / Path(Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
                         ).relative_to("/")
    (CGROOT / f"vgpu-tdma-t{i}" / "cgroup.procs").write_text(str(os.getpid()))
    try:
        return os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
    finally:
        (home / "cgroup.procs").write_text(str(os.getpid()))


WAIT_S = 60.0  # the longest wait for a state the daemon must reach
SETTLE_S = 3.0  # from every tenant having run to the first window of shares
QUEUE_MS = 500  # work kept pending per tenant: a workload process starved a while stays ahead
PERIOD_MS = 100  # how often the workload tops the queues up: little CPU taken from the daemon


@dataclass(frozen=True)
class Window:
    shares: list[float]  # % of the tenants' GPU time (nvsim's busy counters)
    idle: float  # the engine's idle fraction
    seconds: float


def measure(busy: Callable[[], list[int]], seconds: float, settle: float = 0.0) -> Window:
    """Shares of the busy counters over one window of ``seconds``, after
    ``settle`` seconds: fixed before the first read, so a share that lands late
    shows in the window (a window grown until the shares look right would pass
    whenever they come)."""
    time.sleep(settle)
    before, engine0, start = busy(), nv.proc_engines()[0], time.monotonic()
    time.sleep(seconds)
    now, engine, took = busy(), nv.proc_engines()[0], time.monotonic() - start
    used = [b - a for a, b in zip(before, now, strict=True)]
    idle = engine.idle_ns - engine0.idle_ns
    window = Window([100 * u / max(sum(used), 1) for u in used],
                    idle / max(idle + engine.busy_ns - engine0.busy_ns, 1), took)
    print(window)
    return window


def near(*want: float, tol: float) -> Callable[[Window], bool]:
    """Every share within `tol` percentage points of `want`."""
    return lambda w: all(abs(g - x) <= tol for g, x in zip(w.shares, want, strict=True))


class TdmaWorld:
    """Cgroups, config, the daemon (D-Bus on a private bus, set up by the caller) and
    the workloads of a test, in one scheduling mode.

    ``world(weights)`` starts them; ``restart()`` SIGKILLs the daemon and starts
    another on the same config and charge journal."""

    def __init__(self, daemon_factory: type[Daemon], tmp: Path, mode: str = "frame") -> None:
        self.daemon_factory = daemon_factory
        self.mode = mode
        self.frame_s = 0.1
        self.config = tmp / "vgpud.toml"
        self.tmp = tmp
        self.made: list[Path] = []
        self.running: list[Tenants] = []
        self.daemons: list[Daemon] = []

    def __call__(self, weights: Sequence[int], frame_ms: int = 100, *, daemon: str = "",
                 tenant: Mapping[int, str] | None = None, cgroups: Sequence[int] | None = None,
                 wait: bool = True) -> Tenants:
        """Start tenants of these weights (the lines `daemon` and `tenant[i]` added to
        the config; groups in `cgroups`, see Tenants); return once the daemon has run
        each group (unless not `wait`)."""
        self.frame_s = frame_ms / 1000
        for i in range(len(weights)):
            path = CGROOT / f"vgpu-tdma-t{i}"
            path.mkdir(exist_ok=True)
            self.made.append(path)
        charges = f'charges_path = "{self.tmp / "run" / "charges"}"\n'
        self.config.write_text(config_text(self.tmp / "state.json", weights, frame_ms,
                                           self.mode, charges + daemon, tenant))
        self._start_daemon()
        count = len(cgroups) if cgroups is not None else len(weights)
        tenants = Tenants(count, queue_ms=QUEUE_MS, period_ms=PERIOD_MS, cgroups=cgroups)
        self.running.append(tenants)
        if wait:
            wait_for(lambda: min(tenants.busy()) > 0, WAIT_S, "the daemon to run every tenant")
            modes = asyncio.run(AdminClient.run(lambda c: c.manager_properties()))["SchedMode"]
            assert set(modes.values()) == {self.mode}, modes  # no fallback
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


def tdma_world(daemon_factory: type[Daemon], tmp: Path, mode: str = "frame",
               ) -> Iterator[TdmaWorld]:
    """The body of a test's fixture: skips without cgroup v2 or nvsim's engine; D-Bus
    on a private system bus while the world lives."""
    if not (CGROOT / "cgroup.controllers").exists():
        pytest.skip("cgroup v2 is not mounted at /sys/fs/cgroup in this guest")
    if not Path(nv.PROC_GROUPS).exists():
        pytest.skip("nvsim has no work engine (/proc/driver/nvsim/groups)")
    bus = PrivateBus()
    os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = bus.address
    world = TdmaWorld(daemon_factory, tmp, mode)
    try:
        yield world
    finally:
        world.close()
        bus.close()
        del os.environ["DBUS_SYSTEM_BUS_ADDRESS"]


def proc_group(client: int, group: int) -> nv.ProcGroup:
    return next(g for g in nv.proc_groups() if (g.client, g.group) == (client, group))


def wake_latencies(ctl: int, client: int, group: int, count: int, work_ns: int = 1_000_000,
                   gap_s: float = 0.04, timeout_s: float = 5.0) -> list[int]:
    """Give an idle group `work_ns` of work `count` times, each `gap_s` after the
    last ran dry (or `timeout_s` passed); each wake's submit-to-run latency (ns),
    from nvsim's counters: the wake_sum_ns the wake added (a submission that found
    work still pending is no wake, and is left out)."""
    out: list[int] = []
    for _ in range(count):
        before = proc_group(client, group)
        assert nv.submit_work(ctl, client, group, work_ns) == (0, nv.NV_OK)
        deadline = time.monotonic() + timeout_s
        while True:
            now = proc_group(client, group)
            if (now.wake_n > before.wake_n and now.pending_ns == 0) or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.005)
        if now.wake_n == before.wake_n + 1:
            out.append(now.wake_sum_ns - before.wake_sum_ns)
        time.sleep(gap_s)
    return out
