"""The VM guest as the tests see it: the modules' paths, loading and unloading
them, their parameters, and cgroups (scripts/vm-run boots the guest)."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NVSIM_KO = ROOT / "kmod/nvsim/nvsim.ko"
VGPU_KO = ROOT / "kmod/vgpu/vgpu.ko"
NVSIM_DIR = Path("/dev/nvsim")
VGPU_DIR = Path("/dev/vgpu")
# vgpu's parameters over nvsim: where its nodes are and the module owning them.
VGPU_OVER_NVSIM = (f"backing_dir={NVSIM_DIR}", "backing_driver=nvsim", "backing_uvm_driver=nvsim")


def in_guest() -> bool:
    """True inside the test VM: root, module loading works, modules built."""
    return (
        os.geteuid() == 0
        and os.environ.get("VGPU_KVER") == os.uname().release
        and NVSIM_KO.exists()
        and VGPU_KO.exists()
    )


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=False, capture_output=True, text=True)


def loaded(name: str) -> bool:
    return Path(f"/sys/module/{name}").exists()


def insmod(ko: Path, *params: str) -> None:
    res = run("insmod", str(ko), *params)
    assert res.returncode == 0, f"insmod {ko.name} {params}: {res.stderr}"


def rmmod(name: str) -> subprocess.CompletedProcess[str]:
    return run("rmmod", name)


def wait_path(path: Path, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def insmod_vgpu() -> None:
    """vgpu over nvsim, as the VM tests load it (a short upcall timeout keeps
    failure tests fast); returns once its nodes are there."""
    insmod(VGPU_KO, *VGPU_OVER_NVSIM, "upcall_timeout_ms=2000")
    wait_path(VGPU_DIR / "nvidiactl")


def remove_cgroup(path: Path, timeout: float = 10.0) -> None:
    """Kill what is left in it, then rmdir once the killed have been reaped."""
    (path / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + timeout
    while True:
        try:
            path.rmdir()
            return
        except OSError as exc:  # EBUSY while a killed member is still exiting
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def set_param(module: str, name: str, value: str) -> None:
    Path(f"/sys/module/{module}/parameters/{name}").write_text(value)


def get_param(module: str, name: str) -> str:
    return Path(f"/sys/module/{module}/parameters/{name}").read_text().strip()


def nvsim_loaded(mem_mib: int, *params: str) -> Iterator[Path]:
    """nvsim with 2 GPUs of mem_mib (and params), unloaded (and checked) after the test."""
    insmod(NVSIM_KO, "gpus=2", f"mem_mib={mem_mib}", *params)
    wait_path(NVSIM_DIR / "nvidiactl")
    yield NVSIM_DIR
    res = rmmod("nvsim")
    assert res.returncode == 0, f"rmmod nvsim: {res.stderr}"


def wait_for(pred, timeout: float = 60, what: str = "condition") -> None:
    """Polls pred() every 20 ms until it is true; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Env:
    """The loaded vgpu module: its nodes, its backing directory, whether that is nvsim."""

    def __init__(self, dev: Path) -> None:
        self.dev = dev
        self.backing = Path(Path("/sys/module/vgpu/parameters/backing_dir").read_text().strip())
        self.nvsim = loaded("nvsim") and self.backing == Path("/dev/nvsim")

    def open(self, name: str = "nvidiactl", flags: int = os.O_RDWR) -> int:
        return os.open(self.dev / name, flags)
