"""The latency probes loaded by vgpud-probes for a daemon without CAP_BPF.

The helper (vgpud.probes.helper, `--listen`) runs as root with exactly the
capabilities systemd/vgpud-probes.service's CapabilityBoundingSet gives it;
the daemon runs with `--probes-helper` and without CAP_BPF, CAP_PERFMON or
CAP_SYS_ADMIN (setpriv). A tenant's calls are counted exactly, as in
tests/vm/test_probes.py; stopping the daemon detaches (the vgpu module is no
longer pinned, the helper still runs); a lost helper turns the probes off with
the reason while quotas are served, and a new one turns them on again, the
counts read from the lost one kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.bus import PrivateBus
from tests.support.guest import ROOT, wait_for
from tests.support.hostile import TENANT_UID, spawn_tenant
from tests.support.sched import TRACEFS
from tests.support.vgpud_proc import Daemon
from tests.vm.test_probes import CONFIG, FB_CALLER, FB_KIND, OTHER_UID

pytestmark = pytest.mark.vm

UNIT = ROOT / "systemd" / "vgpud-probes.service"
# What the daemon must do without (setpriv names).
DAEMON_DROPS = "-bpf,-perfmon,-sys_admin"
CAP_BITS = {"sys_admin": 21, "syslog": 34, "perfmon": 38, "bpf": 39}

def unit_caps() -> list[str]:
    """The helper unit's capabilities, as setpriv names them."""
    for line in UNIT.read_text().splitlines():
        if line.startswith("CapabilityBoundingSet="):
            return [c.removeprefix("CAP_").lower() for c in line.split("=", 1)[1].split()]
    raise AssertionError(f"no CapabilityBoundingSet= in {UNIT}")


def cap_eff(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no CapEff for {pid}")


class Helper:
    """vgpud-probes --listen SOCK with the unit's capabilities and no others."""

    def __init__(self, sock: Path, log: Path) -> None:
        caps = ",".join(f"+{c}" for c in unit_caps())
        sock.unlink(missing_ok=True)  # ready once its own socket is there
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                ["setpriv", "--bounding-set", f"-all,{caps}", "--inh-caps", "-all",
                 sys.executable, "-c", "from vgpud.probes.helper import main; main()",
                 "--listen", str(sock)],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        self.log = log
        wait_for(lambda: sock.is_socket() or self.proc.poll() is not None, 300,
                 "the helper's socket")
        assert self.proc.poll() is None, log.read_text()
        assert cap_eff(self.proc.pid) == sum(1 << CAP_BITS[c] for c in unit_caps())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Caller:
    def __init__(self, uid: int = TENANT_UID) -> None:
        self.proc = spawn_tenant(FB_CALLER, stdin=True, uid=uid)
        assert self._line().startswith("ready ")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read() if self.proc.stderr else "tenant died"
        return line.strip()

    def calls(self, n: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        assert self._line() == "done"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def vgpuctl(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "vgpud.cli", *args], check=True,
                          capture_output=True, text=True, cwd=ROOT).stdout


def probes_status() -> str:
    return str(json.loads(vgpuctl("status", "--json"))["probes"])


def latency(tenant: str, kind: str = "") -> dict[tuple[str, str], list[int]]:
    rows = json.loads(vgpuctl("latency", "--tenant", tenant, "--kind", kind, "--by-kind",
                              "--json"))[tenant]
    return {(r["kind"], r["histogram"]): r["counts"] for r in rows}


def settled(tenant: str, kind: str, hist: str, n: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        counts = latency(tenant, kind).get((kind, hist), [])
        if sum(counts) >= n or time.monotonic() > deadline:
            return counts
        time.sleep(0.3)


def refcnt() -> int:
    return int(Path("/sys/module/vgpu/refcnt").read_text())


def wait_log(daemon: Daemon, text: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while text not in daemon.log():
        assert time.monotonic() < deadline, f"no {text!r} in {timeout} s:\n{daemon.log()}"
        time.sleep(0.5)


@pytest.fixture
def setup(vgpu: Path, daemon_factory, tmp_path: Path) -> Iterator[tuple[Daemon, Helper, Path]]:
    """(the daemon, the helper, its socket) with the probes on through the helper."""
    if not (TRACEFS / "events").exists():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=False)
    sock = tmp_path / "probes.sock"
    helper = Helper(sock, tmp_path / "helper.log")
    bus = PrivateBus()
    os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = bus.address
    config = tmp_path / "vgpud.toml"
    config.write_text(CONFIG.format(state=tmp_path / "state.json", charges=tmp_path / "charges"))
    daemon = daemon_factory("--config", str(config), "--probes-helper", str(sock), probes=True,
                            prefix=("setpriv", "--bounding-set", DAEMON_DROPS,
                                    "--inh-caps", DAEMON_DROPS))
    try:
        daemon.start()
        assert daemon.proc is not None
        dropped = sum(1 << CAP_BITS[c] for c in ("bpf", "perfmon", "sys_admin"))
        assert cap_eff(daemon.proc.pid) & dropped == 0
        wait_log(daemon, "latency probes attached")
        yield daemon, helper, sock
    finally:
        daemon.stop()
        print(daemon.log())
        helper.stop()
        print(helper.log.read_text())
        bus.close()
        del os.environ["DBUS_SYSTEM_BUS_ADDRESS"]


def test_exact_counts_through_the_helper_and_detach_at_stop(
        setup: tuple[Daemon, Helper, Path]) -> None:
    daemon, _, _ = setup
    assert probes_status().startswith("on: tracepoint vgpu:vgpu_ioctl_enter")
    n = 23
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
    assert sum(total) == sum(upcall) == sum(driver) == n
    assert after[(FB_KIND, "total")] == total
    assert all(kind != FB_KIND for kind, _ in theirs), theirs
    assert refcnt() > 0  # the helper's programs pin the module
    assert daemon.stop() == 0
    # The daemon's connection closed: the helper, still running, detached.
    wait_for(lambda: refcnt() == 0, 60, "the helper to detach")


def test_a_lost_helper_turns_the_probes_off_and_a_new_one_on(
        setup: tuple[Daemon, Helper, Path], tmp_path: Path) -> None:
    daemon, helper, sock = setup
    pins = refcnt()  # the helper's programs' alone
    kept = Caller()  # open across the loss: what the daemon read of it stays
    try:
        files = refcnt() - pins  # its open files pin vgpu too
        kept.calls(4)
        assert sum(settled("a", FB_KIND, "total", 4)) == 4
        helper.stop()  # SIGKILL: the kernel frees its programs
        wait_log(daemon, "latency probes: off: the probe helper was lost", 60)
        assert probes_status().startswith("off: the probe helper was lost: cannot reach")
        wait_for(lambda: refcnt() == files, 60, "the kernel to free the dead helper's programs")
        a = Caller()  # quotas are decided as before
        try:
            a.calls(3)
        finally:
            a.close()
        again = Helper(sock, tmp_path / "helper2.log")
        try:
            wait_for(lambda: probes_status().startswith("on: "), 300, "the probes on again")
            kept.calls(5)
            total = settled("a", FB_KIND, "total", 9)
        finally:
            again.stop()
    finally:
        kept.close()
    # The 4 read from the lost map, and the 5 of the new one; not the 3 made
    # while no program was attached.
    assert sum(total) == 9, total
