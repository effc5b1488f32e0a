"""vgpud as installed, run by systemd as PID 1 of a booted Debian 12.

Runs inside the image of scripts/build-sysimage booted by scripts/sysimage-run
(one boot for the file):

    scripts/sysimage-run -- python -m pytest -q -p no:cacheprovider -m vm -s \
        tests/vm/test_systemd_boot.py

The system's own vgpud.service, D-Bus policy and modprobe.d files are used as
shipped. The tests add only what a simulated host needs: nvsim in place of
the NVIDIA driver (loaded by hand, with a modprobe.d line that points vgpu at
its nodes), a config with one tenant, users, and a shorter watchdog (a
runtime drop-in). Charges are judged by nvsim's own accounting too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support import tenant_workload
from tests.support.guest import NVSIM_DIR, NVSIM_KO, ROOT, insmod, loaded, rmmod, wait_path
from tests.support.sched import TRACEFS
from tests.support.sysimage import (
    VGPUCTL,
    add_user,
    as_user,
    booted,
    journal,
    main_pid,
    set_dropin,
    sh,
    show,
    wait_restarted,
    wait_until,
)
from tests.vm.test_probes import FB_KIND
from tests.vm.test_probes_helper import Caller

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(not booted(), reason="needs the booted image (scripts/sysimage-run)"),
]

MiB = 1 << 20
TENANT_UID = 2001
CONFIG = Path("/etc/vgpud/vgpud.toml")
NVSIM_OPTIONS = Path("/etc/modprobe.d/zz-vgpu-over-nvsim.conf")
# Shorter than the shipped 30 s, long enough for a loaded TCG guest's event
# loop to keep pinging.
WATCHDOG_S = 20
VIEW = Path("/run/vgpud/fs")  # the shipped [fs] mountpoint
CONFIG_TEXT = """\
[daemon]
admin_group = "vgpu-admin"

[metrics]
enabled = true
listen = "127.0.0.1:9400"

[[tenant]]
name = "a"
memory = "{memory}"
match = [{{ uid = {uid} }}]
"""


@pytest.fixture(scope="module")
def system(request: pytest.FixtureRequest) -> Iterator[None]:
    """The simulated host, vgpu not loaded and vgpud not started."""
    sh("systemctl", "is-system-running", "--wait", check=False)
    assert not loaded("vgpu")
    add_user("vgpu-tenant", TENANT_UID)
    add_user("vgpu-op", 2002, "vgpu-admin")
    add_user("vgpu-other", 2003)
    NVSIM_OPTIONS.write_text(
        "options vgpu backing_dir=/dev/nvsim backing_driver=nvsim backing_uvm_driver=nvsim\n")
    CONFIG.write_text(CONFIG_TEXT.format(memory="1GiB", uid=TENANT_UID))
    insmod(NVSIM_KO, "gpus=2", "mem_mib=1024")
    wait_path(NVSIM_DIR / "nvidiactl")
    # As docs/operations.md says: the file view's mount helper is socket-activated.
    sh("systemctl", "enable", "--now", "vgpud-fsmount.socket")
    # A loaded TCG guest can take minutes to start Python: no start timeout.
    set_dropin("test", f"[Service]\nWatchdogSec={WATCHDOG_S}\nTimeoutStartSec=infinity\n")
    yield
    if request.session.testsfailed:  # what CI's log needs to tell why
        print(sh("systemctl", "status", "--no-pager", "--full", "--lines=0", "vgpud",
                 check=False).stdout)
        for unit in ("vgpud.service", "vgpud-fsmount@*.service", "vgpud-probes.service",
                     "vgpud-metrics@*.service"):
            print(f"\n--- journal of {unit} ---\n" + "\n".join(journal(unit)[-150:]))
    sh("systemctl", "stop", "vgpud", check=False)
    # The stop waits (5 s at most) for vgpud-probes to detach the programs
    # that pin vgpu; a loaded TCG guest may take longer.
    wait_until(lambda: Path("/sys/module/vgpu/refcnt").read_text().strip() == "0",
               "vgpu no longer pinned", timeout=60)
    for module in ("vgpu", "nvsim"):
        assert rmmod(module).returncode == 0, f"rmmod {module}"


@pytest.fixture(scope="module")
def started(system: None) -> float:
    """`systemctl start vgpud`, timed; it returns once the unit is active."""
    t0 = time.monotonic()
    sh("systemctl", "start", "vgpud")
    seconds = time.monotonic() - t0
    print(f"\nsystemctl start vgpud: {seconds:.1f} s")
    return seconds


def vgpuctl(*args: str, user: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh(str(VGPUCTL), *args, user=user, check=check)


def tenant(user: str | None = None) -> dict:
    info = json.loads(vgpuctl("tenant", "show", "a", "--json", user=user).stdout)
    assert isinstance(info, dict)
    return info


def used() -> int:
    return sum(int(v) for v in tenant()["memory_used"].values())


def test_the_module_is_loaded_by_the_unit(started: float) -> None:
    """Not before start (the fixture checked), then by ExecStartPre's modprobe,
    with the options of /etc/modprobe.d."""
    assert loaded("vgpu")
    assert Path("/sys/module/vgpu/parameters/backing_dir").read_text().strip() == "/dev/nvsim"
    pre = show("ExecStartPre")["ExecStartPre"]
    assert "argv[]=/sbin/modprobe vgpu ;" in pre and "code=exited ; status=0 }" in pre, pre


def test_active_only_after_ready(started: float) -> None:
    """start returned (Type=notify): by then the daemon had registered with
    the module and owned its bus name, and said so before systemd's Started."""
    state = show("ActiveState", "SubState", "Type", "NotifyAccess", "StatusText")
    assert state == {"ActiveState": "active", "SubState": "running", "Type": "notify",
                     "NotifyAccess": "main", "StatusText": "serving upcalls"}
    assert sh("busctl", "--system", "status", "org.vgpud1").returncode == 0
    lines = journal()
    registered = next(i for i, s in enumerate(lines) if "registered with vgpu module" in s)
    started_at = next(i for i, s in enumerate(lines) if s.startswith("Started "))
    assert registered < started_at, lines


def test_reload_applies_a_changed_config(started: float) -> None:
    pid = main_pid()
    assert tenant()["memory_limit"] == "1GiB"
    CONFIG.write_text(CONFIG_TEXT.format(memory="768MiB", uid=TENANT_UID))
    sh("systemctl", "reload", "vgpud")
    wait_until(lambda: tenant()["memory_limit"] == "768MiB", "config reloaded")
    assert main_pid() == pid
    assert any(f"reloaded {CONFIG}" in line for line in journal())


def test_vgpuctl_over_the_system_bus(started: float) -> None:
    """Root and the admin group may change a tenant; another user may read only."""
    vgpuctl("tenant", "set", "a", "--weight", "200")
    assert tenant()["weight"] == 200
    vgpuctl("tenant", "set", "a", "--weight", "300", user="vgpu-op")
    assert tenant()["weight"] == 300
    refused = vgpuctl("tenant", "set", "a", "--weight", "400", user="vgpu-other", check=False)
    assert refused.returncode == 77 and "vgpu-admin" in refused.stderr, refused  # EX_NOPERM
    assert tenant(user="vgpu-other")["weight"] == 300


class Holder:
    """tenant_workload alloc --hold, run as the tenant's uid."""

    def __init__(self, size: str, count: int) -> None:
        self.count = count
        self.proc = subprocess.Popen(
            tenant_workload.command("/dev/vgpu", "alloc", size, str(count), "--hold"),
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            **as_user(TENANT_UID))  # type: ignore[call-overload]

    def statuses(self, n: int | None = None) -> list[int]:
        assert self.proc.stdout is not None
        return [json.loads(self.proc.stdout.readline())["status"]
                for _ in range(self.count if n is None else n)]

    def wait_holding(self) -> None:
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "holding"

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.communicate("\n", timeout=60)


def nvsim_free_kib() -> int:
    ctl = nv.NvNodes(str(NVSIM_DIR)).open_ctl()
    try:
        return nv.heap_free_kib(ctl, nv.build_tree(ctl))
    finally:
        os.close(ctl)


def test_sigkill_restart_keeps_the_charges(started: float) -> None:
    free = nvsim_free_kib()
    holder = Holder("256MiB", 2)
    try:
        assert holder.statuses() == [0, 0]
        holder.wait_holding()
        assert used() == 512 * MiB
        assert free - nvsim_free_kib() == (512 * MiB) >> 10

        pid = main_pid()
        sh("systemctl", "kill", "--signal=SIGKILL", "vgpud")
        wait_restarted(pid, timeout=600)

        assert used() == 512 * MiB
        # 512 MiB held + 512 MiB more > the 768 MiB limit: refused, and nvsim
        # never sees it.
        over = Holder("512MiB", 1)
        assert over.statuses() == [0x51]
        over.release()
        assert free - nvsim_free_kib() == (512 * MiB) >> 10
    finally:
        holder.release()
    wait_until(lambda: used() == 0, "charges released")
    assert nvsim_free_kib() == free


def test_watchdog_restarts_a_daemon_that_stops_answering(started: float) -> None:
    restarts = int(show("NRestarts")["NRestarts"])
    pid = main_pid()
    os.kill(pid, 19)  # SIGSTOP: no more WATCHDOG=1
    t0 = time.monotonic()
    wait_restarted(pid, timeout=600)
    print(f"\nwatchdog restart after {time.monotonic() - t0:.1f} s")
    assert int(show("NRestarts")["NRestarts"]) == restarts + 1
    assert any("Watchdog timeout" in line for line in journal())
    assert used() == 0 and tenant()["memory_limit"] == "768MiB"


def test_the_file_view_is_mounted_by_the_helper(started: float) -> None:
    """[fs] on, as shipped: vgpud, which has no CAP_SYS_ADMIN, had
    vgpud-fsmount@.service mount the view, and had it mounted again after the
    restarts above. Everyone reads; the kernel lets the admin group write and
    refuses others; a write is applied like vgpuctl's."""
    wait_until(lambda: os.path.ismount(VIEW) and (VIEW / "gpus").exists(), "file view mounted")
    assert any("Started" in line for line in journal("vgpud-fsmount@*.service"))
    dmem = VIEW / "tenants" / "a" / "dmem.max"

    def limits(user: str) -> set[str]:
        lines = sh("cat", str(dmem), user=user).stdout.splitlines()
        assert lines and all(re.fullmatch(r"nvidia/\S+/vidmem [0-9]+", s) for s in lines), lines
        return {s.rsplit(" ", 1)[1] for s in lines}

    assert limits("vgpu-other") == {str(768 * MiB)}
    refused = sh("sh", "-c", f"echo {512 * MiB} > {dmem}", user="vgpu-other", check=False)
    assert refused.returncode != 0 and "Permission denied" in refused.stderr, refused
    assert limits("vgpu-other") == {str(768 * MiB)}
    sh("sh", "-c", f"echo {512 * MiB} > {dmem}", user="vgpu-op")
    assert limits("vgpu-tenant") == {str(512 * MiB)}
    assert tenant()["memory_limit"] in ("512MiB", str(512 * MiB))
    vgpuctl("tenant", "set", "a", "--memory", "768MiB")
    assert limits("vgpu-other") == {str(768 * MiB)}


def scrape_metric(line_start: str) -> float | None:
    """The value of the sample whose line starts with ``line_start``, or None."""
    try:
        with urllib.request.urlopen("http://127.0.0.1:9400/metrics", timeout=30) as reply:
            body = reply.read().decode()
    except OSError:
        return None
    return next((float(s.rsplit(" ", 1)[1]) for s in body.splitlines()
                 if s.startswith(line_start)), None)


def exporters() -> list[dict[str, str]]:
    """The running vgpud-metrics@ instances: unit, pid, uid, effective caps."""
    out = sh("systemctl", "list-units", "--plain", "--no-legend", "--state=running",
             "vgpud-metrics@*.service").stdout
    found = []
    for unit in (line.split()[0] for line in out.splitlines() if line.strip()):
        pid = show("MainPID", unit=unit)["MainPID"]
        status = dict(line.split(":", 1) for line in
                      Path(f"/proc/{pid}/status").read_text().splitlines())
        found.append({"unit": unit, "pid": pid, "uid": status["Uid"].split()[1],
                      "caps": status["CapEff"].strip() + status["CapBnd"].strip()})
    return found


def test_metrics_are_served_without_privilege(started: float) -> None:
    """[metrics] on: the daemon binds the port in its sandbox (IPAddressAllow=
    localhost) and passes it to vgpud-metrics@.service, which answers a scrape
    on loopback with the tenant's exact figures, after the restarts above. The
    process that parses HTTP is that unit's alone: a dynamic user (not root)
    with no capability; nothing but the daemon runs in vgpud.service."""
    limit = 'vgpud_memory_limit_bytes{gpu="0",gpu_uuid="",tenant="a"}'
    used_0 = 'vgpud_memory_used_bytes{gpu="0",gpu_uuid="",tenant="a"}'
    wait_until(lambda: scrape_metric(limit) == 768 * MiB, "the limit scraped", timeout=300)
    (exporter,) = exporters()
    print(f"\n{exporter}")
    assert exporter["uid"] != "0" and exporter["caps"] == "0" * 32, exporter
    cgroup = Path("/sys/fs/cgroup/system.slice/vgpud.service/cgroup.procs")
    assert cgroup.read_text().split() == [str(main_pid())]
    holder = Holder("128MiB", 1)
    try:
        assert holder.statuses() == [0]
        holder.wait_holding()
        wait_until(lambda: scrape_metric(used_0) == 128 * MiB, "the charge scraped")
    finally:
        holder.release()
    wait_until(lambda: scrape_metric(used_0) == 0, "the release scraped")
    sh("kill", "-KILL", exporter["pid"])  # the daemon connects again: another instance
    wait_until(lambda: scrape_metric(limit) == 768 * MiB, "scraped from the next exporter")
    assert [e["unit"] for e in exporters()] != [exporter["unit"]]


HELPER_SOCKETS = ("/run/vgpud-metrics.sock", "/run/vgpud-probes.sock",
                  "/run/vgpud-fsmount.sock")
CONNECT = ("import socket, sys\n"
           "try:\n"
           "    socket.socket(socket.AF_UNIX).connect(sys.argv[1])\n"
           "except OSError as exc:\n"
           "    print(type(exc).__name__)\n"
           "else:\n"
           "    print('connected')\n")


def test_a_tenant_cannot_reach_the_helpers(started: float) -> None:
    """The helpers act on what root's daemon sends them (a port to serve, a
    /dev/fuse to mount, probes to load): their sockets, as systemd made
    them, refuse a tenant and an admin-group member at connect(2)."""
    for path in HELPER_SOCKETS:
        assert Path(path).is_socket(), path
        for user in ("vgpu-tenant", "vgpu-op"):
            said = sh("python3", "-c", CONNECT, path, user=user).stdout.strip()
            assert said == "PermissionError", (path, user, said)


def latency(tenant: str) -> dict[tuple[str, str], list[int]]:
    rows = json.loads(vgpuctl("latency", "--tenant", tenant, "--by-kind", "--json").stdout)
    return {(r["kind"], r["histogram"]): r["counts"] for r in rows.get(tenant, [])}


def test_the_probes_are_loaded_by_their_helper(started: float) -> None:
    """[probes] as shipped: vgpud, which has neither CAP_BPF nor CAP_PERFMON,
    had the socket-activated vgpud-probes.service compile the programs with bcc
    against the installed headers and attach them, inside that unit's sandbox,
    after the restarts above; a tenant's calls are counted there exactly."""
    assert (TRACEFS / "events" / "vgpu").is_dir()  # systemd mounted tracefs

    def status() -> str:
        return str(json.loads(vgpuctl("status", "--json").stdout)["probes"])

    wait_until(lambda: status().startswith("on: "), "the probes attached", timeout=600)
    print(f"\n{status()}")
    assert any("Started" in line for line in journal("vgpud-probes.service"))
    n = 19
    caller = Caller(TENANT_UID)
    try:
        caller.calls(n)
        wait_until(lambda: sum(latency("a").get((FB_KIND, "driver"), [])) >= n, "counted")
        time.sleep(2)  # later reads add nothing
        counts = latency("a")
    finally:
        caller.close()
    assert sum(counts[(FB_KIND, "total")]) == sum(counts[(FB_KIND, "driver")]) == n, counts


def test_the_loaded_unit_scores_within_bound(started: float) -> None:
    """systemd-analyze security of the unit as the running system loaded it."""
    out = sh("systemd-analyze", "security", "--no-pager", "vgpud.service").stdout
    last = out.strip().splitlines()[-1]
    print(f"\n{last}")
    score = float(last.split(": ")[1].split()[0])
    assert score <= 2.5, out
