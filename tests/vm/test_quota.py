"""Per-tenant memory quotas end to end: nvsim + vgpu + vgpud --config + D-Bus.

Tenants are matched by cgroup: each workload process is started inside its
tenant's cgroup v2 (created under /sys/fs/cgroup for the test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.bus import PrivateBus
from tests.support.guest import (
    NVSIM_DIR,
    NVSIM_KO,
    VGPU_DIR,
    VGPU_KO,
    VGPU_OVER_NVSIM,
    insmod,
    remove_cgroup,
    rmmod,
    wait_path,
)
from tests.support.workloads import CgroupWorkload as Workload
from vgpud.store.journal import current_identity

pytestmark = pytest.mark.vm

CGROOT = Path("/sys/fs/cgroup")
MiB = 1 << 20

CONFIG = """\
[daemon]
state_path = "{state}"
charges_path = "{charges}"

[[tenant]]
name = "a"
memory = "1GiB"
match = [{{ cgroup = "/vgpu-test-a*" }}]

[[tenant]]
name = "b"
memory = "2GiB"
match = [{{ cgroup = "/vgpu-test-b*" }}]
"""


@pytest.fixture
def nvsim() -> Iterator[Path]:
    """nvsim with 4 GiB GPUs: room for both tenants' limits on GPU 0."""
    insmod(NVSIM_KO, "gpus=2", "mem_mib=4096")
    wait_path(NVSIM_DIR / "nvidiactl")
    yield NVSIM_DIR
    assert rmmod("nvsim").returncode == 0


@pytest.fixture
def cgroups() -> Iterator[dict[str, Path]]:
    if not (CGROOT / "cgroup.controllers").exists():
        pytest.skip("cgroup v2 is not mounted at /sys/fs/cgroup in this guest")
    groups = {name: CGROOT / f"vgpu-test-{name}" for name in ("a", "b")}
    for path in groups.values():
        path.mkdir(exist_ok=True)
    yield groups
    for path in groups.values():
        remove_cgroup(path)


@pytest.fixture
def quota_daemon(vgpu: Path, daemon_factory, tmp_path: Path) -> Iterator[tuple]:
    bus = PrivateBus()
    os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = bus.address
    config = tmp_path / "vgpud.toml"
    config.write_text(CONFIG.format(state=tmp_path / "state.json",
                                    charges=tmp_path / "run" / "charges"))
    daemon = daemon_factory("--config", str(config)).start()
    try:
        yield daemon, config
    finally:
        daemon.kill()
        print(daemon.log())  # shown by pytest when the test fails
        bus.close()
        del os.environ["DBUS_SYSTEM_BUS_ADDRESS"]


def once(cgroup: Path, *args: str) -> dict:
    """A workload's one line of output, once it has exited (its cgroup can go)."""
    w = Workload(cgroup, *args)
    line = w.lines(1)[0]
    w.proc.communicate(timeout=30)
    return line


def vgpuctl(*args: str) -> dict | list:
    out = subprocess.run([sys.executable, "-m", "vgpud.cli", *args, "--json"], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def used(tenant: str) -> int:
    info = vgpuctl("tenant", "show", tenant)
    assert isinstance(info, dict)
    return sum(int(v) for v in info["memory_used"].values())


def test_two_tenants_by_cgroup(quota_daemon, cgroups, nvsim: Path) -> None:
    # Tenant a: 3 processes x 2 x 128 MiB held = 768 MiB charged, exactly.
    holders = [Workload(cgroups["a"], "alloc", "128MiB", "2", "--hold") for _ in range(3)]
    b = Workload(cgroups["b"], "alloc", "512MiB", "3", "--hold")
    try:
        for w in holders:
            assert [r["status"] for r in w.lines(2)] == [0, 0]
            w.wait_holding()
        assert [r["status"] for r in b.lines(3)] == [0, 0, 0]
        b.wait_holding()
        assert used("a") == 768 * MiB
        assert used("b") == 1536 * MiB

        # a's next 512 MiB would exceed 1 GiB: an ordinary out-of-memory, and
        # nvsim never sees the allocation (its free memory does not move).
        ctl = nv.NvNodes(str(nvsim)).open_ctl()
        try:
            tree = nv.build_tree(ctl)
            free_before = nv.heap_free_kib(ctl, tree)
            over = Workload(cgroups["a"], "alloc", "512MiB", "1")
            assert over.lines(1)[0]["status"] == 0x51
            over.release()
            assert nv.heap_free_kib(ctl, tree) == free_before
        finally:
            os.close(ctl)

        # The tenant's view: its limit is the whole GPU.
        view = Workload(cgroups["a"], "fbinfo").lines(1)[0]
        assert view["total_ram_size"] == (1 << 30) >> 10
        assert view["heap_free"] == (256 * MiB) >> 10

        # SIGKILL of a holder releases its charge.
        holders[0].kill()
        holders = holders[1:]
        assert used("a") == 512 * MiB
        assert used("b") == 1536 * MiB
    finally:
        for w in [*holders, b]:
            if w.proc.poll() is None:
                w.release()
    assert used("a") == 0 and used("b") == 0


def test_live_limit_changes(quota_daemon, cgroups) -> None:
    w = Workload(cgroups["a"], "alloc", "256MiB", "4", "--hold")
    try:
        assert [r["status"] for r in w.lines(4)] == [0] * 4
        w.wait_holding()
        # Lowering below usage frees nothing and refuses the next allocation.
        subprocess.run([sys.executable, "-m", "vgpud.cli", "tenant", "set", "a",
                        "--memory", "512MiB"], check=True)
        assert used("a") == 1024 * MiB
        assert Workload(cgroups["a"], "alloc", "4MiB", "1").lines(1)[0]["status"] == 0x51
        # Raising applies at once.
        subprocess.run([sys.executable, "-m", "vgpud.cli", "tenant", "set", "a",
                        "--memory", "2GiB"], check=True)
        assert Workload(cgroups["a"], "alloc", "512MiB", "1").lines(1)[0]["status"] == 0
    finally:
        w.release()


def test_no_tenant_means_the_open_is_refused(quota_daemon) -> None:
    # The test process itself is in no tenant's cgroup and there is no default.
    with pytest.raises(PermissionError):
        nv.NvNodes("/dev/vgpu").open_ctl()


def test_legacy_fb_info_and_heap_info_report_the_limit(quota_daemon, cgroups) -> None:
    holder = Workload(cgroups["a"], "alloc", "256MiB", "1", "--hold")
    try:
        assert holder.lines(1)[0]["status"] == 0
        holder.wait_holding()
        # FB_GET_INFO: its list, in the caller's memory, rewritten by the daemon
        view = once(cgroups["a"], "fbinfo1")
        assert (view["errno"], view["status"]) == (0, 0)
        assert view["total_ram_size"] == view["heap_size"] == (1 << 30) >> 10
        assert view["heap_free"] == (768 * MiB) >> 10
        # RM_VID_HEAP_CONTROL INFO: bytes
        heap = once(cgroups["a"], "heapinfo")
        assert (heap["errno"], heap["status"]) == (0, 0)
        assert (heap["total"], heap["free"]) == (1 << 30, 768 * MiB)
        assert heap["largest"] <= 768 * MiB
        # tenant b's own view, on the same GPU
        heap = once(cgroups["b"], "heapinfo")
        assert (heap["total"], heap["free"]) == (2 << 30, 2 << 30)
    finally:
        holder.release()


def test_sigkill_and_restart_keep_the_charges(quota_daemon, cgroups, daemon_factory) -> None:
    daemon, config = quota_daemon
    kept = Workload(cgroups["a"], "alloc", "256MiB", "3", "--hold")
    gone = Workload(cgroups["a"], "alloc", "128MiB", "1", "--hold")
    restarted = None
    try:
        assert [r["status"] for r in kept.lines(3)] == [0, 0, 0]
        kept.wait_holding()
        assert gone.lines(1)[0]["status"] == 0
        gone.wait_holding()
        assert used("a") == 896 * MiB

        daemon.kill()  # SIGKILL
        gone.release()  # its context closes while no daemon runs: the CLOSE event is lost
        restarted = daemon_factory("--config", str(config)).start()

        assert used("a") == 768 * MiB
        assert once(cgroups["a"], "alloc", "512MiB", "1")["status"] == 0x51
        assert once(cgroups["a"], "alloc", "256MiB", "1")["status"] == 0
        assert used("a") == 768 * MiB  # that one closed again
    except BaseException:
        if restarted is not None:
            print(restarted.log())
        raise
    finally:
        for w in (kept, gone):
            if w.proc.poll() is None:
                w.release()
    assert used("a") == 0


def test_each_load_of_vgpu_is_another_journal_identity(nvsim: Path) -> None:
    """Context ids restart at each load: a journal must not outlive its load."""
    identities = []
    for _ in range(2):
        insmod(VGPU_KO, *VGPU_OVER_NVSIM)
        wait_path(VGPU_DIR / "nvidiactl")
        identities.append(current_identity())
        assert rmmod("vgpu").returncode == 0
    first, second = identities
    assert first.boot_id == second.boot_id
    assert first.module != second.module
    assert current_identity().module == "absent"
