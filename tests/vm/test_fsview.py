"""The file view (vgpud.fsview) of the real daemon on nvsim, used with real
file I/O: cat and echo as root, as a member of the admin group and as another
user; a hostile-input pass; and the mount through vgpud-fsmount for a daemon
without CAP_SYS_ADMIN.

dmem.current is judged against nvsim's own accounting (its heap, read as
root through nvsim's nodes), not against the daemon's view alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support import tenant_workload
from tests.support.guest import NVSIM_DIR, ROOT, nvsim_loaded
from tests.support.nvsim import heap_free
from tests.support.vgpud_proc import Daemon
from tests.support.workloads import writes

pytestmark = pytest.mark.vm

MiB = 1 << 20
ADMIN_GID = 100  # "users": the admin group of the config below
HELPER_SOCKET = Path("/run/vgpud-fsmount.sock")

CONFIG = """\
[daemon]
state_path = "{state}"
charges_path = "{charges}"
admin_group = "users"

[fs]
mountpoint = "{mountpoint}"

[[tenant]]
name = "a"
memory = "1GiB"
match = [{{ uid = 0 }}]

[[tenant]]
name = "b"
memory = "2GiB"
"""


@pytest.fixture
def nvsim() -> Iterator[Path]:
    """nvsim with 2 GPUs of 4 GiB."""
    yield from nvsim_loaded(4096)


@pytest.fixture
def view_config(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The config, and the view's mountpoint (under a directory all may traverse)."""
    subprocess.run(["modprobe", "fuse"], check=True)
    public = Path(tempfile.mkdtemp(prefix="vgpud-fs-"))
    public.chmod(0o755)
    config = tmp_path / "vgpud.toml"
    config.write_text(CONFIG.format(state=tmp_path / "state.json",
                                    charges=tmp_path / "charges", mountpoint=public / "fs"))
    yield config, public / "fs"
    subprocess.run(["umount", "-l", str(public / "fs")], capture_output=True, check=False)
    shutil.rmtree(public, ignore_errors=True)


@contextmanager
def serving(daemon: Daemon, says: str) -> Iterator[Daemon]:
    """The daemon started, once its log ``says`` the view is mounted (it
    mounts after READY=1); its log printed afterwards (shown on failure)."""
    daemon.start()
    try:
        wait_for(lambda: says in daemon.log(), timeout=180)
        yield daemon
    finally:
        print(daemon.log())


def mounted(where: Path) -> str | None:
    """The mountinfo line of ``where``, if something is mounted there."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if line.split()[4] == str(where):
            return line
    return None


def shell(script: str, *ids: str) -> subprocess.CompletedProcess[str]:
    """bash -c ``script``, as root or under ``setpriv IDS``."""
    argv = ["bash", "-c", script]
    if ids:
        argv = ["setpriv", *ids, *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def wait_for(what: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


class Holder:
    """A tenant workload holding allocations on GPU 0 until released."""

    def __init__(self, size: str, count: int) -> None:
        self.proc = subprocess.Popen(
            tenant_workload.command("/dev/vgpu", "alloc", size, str(count), "--hold"), cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.status = [json.loads(self.proc.stdout.readline())["status"] for _ in range(count)]
        assert self.proc.stdout.readline().strip() == "holding"

    def release(self) -> None:
        self.proc.communicate("\n", timeout=60)


def alloc_status(size: str) -> int:
    out = subprocess.run(tenant_workload.command("/dev/vgpu", "alloc", size, "1"), cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return int(json.loads(out.splitlines()[0])["status"])


def test_file_view(vgpu: Path, daemon_factory: type[Daemon],
                   view_config: tuple[Path, Path], tmp_path: Path) -> None:
    config, fs = view_config
    with serving(daemon_factory("--config", str(config), "--no-dbus", fs=True),
                 f"file view at {fs}") as daemon:
        file_view_checks(daemon, fs, tmp_path)


def file_view_checks(daemon: Daemon, fs: Path, tmp_path: Path) -> None:
    a = fs / "tenants" / "a"
    line = mounted(fs)
    assert line is not None and "default_permissions" in line and "allow_other" in line
    assert shell(f"cat {a}/dmem.max").stdout == (
        f"nvidia/gpu0/vidmem {1024 * MiB}\nnvidia/gpu1/vidmem {1024 * MiB}\n")
    assert shell(f"cat {fs}/gpus").stdout == (
        f"nvidia/gpu0 index=0 total={4096 * MiB} name=nvsim\n"
        f"nvidia/gpu1 index=1 total={4096 * MiB} name=nvsim\n")

    # dmem.current is what nvsim itself says tenant a holds.
    ctl = nv.NvNodes(str(NVSIM_DIR)).open_ctl()
    try:
        tree = nv.build_tree(ctl, 0)
        free0 = heap_free(ctl, tree)
        holder = Holder("128MiB", 3)
        try:
            assert holder.status == [0, 0, 0]
            held = (free0 - heap_free(ctl, tree)) * 1024
            assert held == 384 * MiB
            assert (a / "dmem.current").read_text() == (
                f"nvidia/gpu0/vidmem {held}\nnvidia/gpu1/vidmem 0\n")
            wait_for(lambda: f"tgid={holder.proc.pid} uid=0 gpu=- bytes={held}\n"
                     in (a / "contexts").read_text())

            # echo > as root: the Manager applies it (persisted, enforced).
            assert shell(f"echo {512 * MiB} > {a}/dmem.max").returncode == 0
            assert json.loads((tmp_path / "state.json").read_text())["changed"]["a"][
                "memory"] == "512MiB"
            assert alloc_status("256MiB") == 0x51  # 384 + 256 MiB > 512 MiB
        finally:
            holder.release()
        assert (a / "dmem.current").read_text() == "nvidia/gpu0/vidmem 0\nnvidia/gpu1/vidmem 0\n"
        assert (a / "dmem.peak").read_text() == (
            f"nvidia/gpu0/vidmem {384 * MiB}\nnvidia/gpu1/vidmem 0\n")
        assert heap_free(ctl, tree) == free0
    finally:
        os.close(ctl)

    # An admin-group member may write; another user gets EACCES from the kernel.
    member = ("--reuid=4242", "--regid=4242", f"--groups={ADMIN_GID}")
    other = ("--reuid=4242", "--regid=4242", "--clear-groups")
    assert shell(f"echo 300 > {a}/gpu.weight", *member).returncode == 0
    res = shell(f"echo 900 > {a}/gpu.weight", *other)
    assert "Permission denied" in res.stderr
    assert shell(f"cat {a}/gpu.weight", *other).stdout == "300\n"
    res = shell(f"echo max > {a}/gpu.max", *other)
    assert "Permission denied" in res.stderr
    assert shell(f"echo 40 > {a}/gpu.max").returncode == 0
    assert "Invalid argument" in shell(f"echo 0 > {a}/gpu.weight").stderr

    # Hostile input leaves the values as they were.
    before = {n: (a / n).read_text() for n in ("dmem.max", "gpu.weight", "gpu.max")}
    assert writes(a / "dmem.max", b"9" * 2**20) == ["EINVAL"]
    assert writes(a / "dmem.max", b"nvidia/gpu0/vid", b"mem 4096\n") == ["EINVAL", "EINVAL"]
    assert writes(a / "gpu.weight", b"7\x00\n") == ["EINVAL"]
    assert writes(a / "gpu.weight", b"\x00" * 64) == ["EINVAL"]
    assert writes(a / "gpu.max", "5\u00a0".encode()) == ["EINVAL"]
    assert {n: (a / n).read_text() for n in before} == before

    # Concurrent writers: each write is applied whole; the last one stays.
    def writer(value: int) -> list[list[int | str]]:
        return [writes(a / "gpu.weight", f"{value}\n".encode()) for _ in range(20)]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(writer, range(501, 509)))
    assert [r for rs in results for r in rs] == [[4]] * 160
    shown = int((a / "gpu.weight").read_text())
    assert 501 <= shown <= 508
    assert json.loads((tmp_path / "state.json").read_text())["changed"]["a"]["weight"] == shown

    assert daemon.stop() == 0
    assert mounted(fs) is None


def test_mount_through_the_helper_without_cap_sys_admin(
        vgpu: Path, daemon_factory: type[Daemon], view_config: tuple[Path, Path]) -> None:
    config, fs = view_config
    HELPER_SOCKET.unlink(missing_ok=True)
    helper = subprocess.Popen([sys.executable, "-c",
                               "from vgpud.fsview.helper import main; main()",
                               "--config", str(config), "--listen", str(HELPER_SOCKET)],
                              cwd=ROOT)
    try:
        wait_for(HELPER_SOCKET.exists)
        drop = ("setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin")
        with serving(daemon_factory("--config", str(config), "--no-dbus", fs=True, prefix=drop),
                     f"file view at {fs}") as daemon:
            helper_checks(daemon, fs)
    finally:
        helper.terminate()
        helper.wait(timeout=30)
        HELPER_SOCKET.unlink(missing_ok=True)


def helper_checks(daemon: Daemon, fs: Path) -> None:
    assert daemon.proc is not None
    status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
    cap_eff = int(next(x for x in status.splitlines() if x.startswith("CapEff:")).split()[1], 16)
    assert not cap_eff >> 21 & 1  # no CAP_SYS_ADMIN
    assert f"no CAP_SYS_ADMIN: vgpud-fsmount mounted the view at {fs}" in daemon.log()
    line = mounted(fs)
    assert line is not None and "fuse.vgpud" in line
    assert "nosuid" in line and "nodev" in line and "noexec" in line
    assert "default_permissions" in line and "allow_other" in line
    a = fs / "tenants" / "a"
    other = ("--reuid=4242", "--regid=4242", "--clear-groups")
    assert shell(f"echo 250 > {a}/gpu.weight").returncode == 0
    assert shell(f"cat {a}/gpu.weight", *other).stdout == "250\n"
    assert "Permission denied" in shell(f"echo 1 > {a}/gpu.weight", *other).stderr
    assert daemon.stop() == 0
    assert mounted(fs) is None
