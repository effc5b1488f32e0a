"""Fixtures of the VM tier: real modules in a real kernel, the real daemon.

These tests run as root inside the guest booted by scripts/vm-run; on any
other machine they are skipped, since the kernel modules cannot be loaded.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vgpud_proc import Daemon

ROOT = Path(__file__).resolve().parents[2]
NVSIM_KO = ROOT / "kmod/nvsim/nvsim.ko"
VGPU_KO = ROOT / "kmod/vgpu/vgpu.ko"
NVSIM_DIR = Path("/dev/nvsim")
VGPU_DIR = Path("/dev/vgpu")


def in_guest() -> bool:
    """True inside the test VM: root, module loading works, modules built."""
    return (
        os.geteuid() == 0
        and os.environ.get("VGPU_KVER") == os.uname().release
        and NVSIM_KO.exists()
        and VGPU_KO.exists()
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if in_guest():
        return
    skip = pytest.mark.skip(reason="needs the VM tier (scripts/test-vm): modules cannot load here")
    for item in items:
        if "vm" in item.keywords:
            item.add_marker(skip)


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


def nvsim_loaded(mem_mib: int) -> Iterator[Path]:
    """nvsim with 2 GPUs of mem_mib, unloaded (and checked) after the test."""
    insmod(NVSIM_KO, "gpus=2", f"mem_mib={mem_mib}")
    wait_path(NVSIM_DIR / "nvidiactl")
    yield NVSIM_DIR
    res = rmmod("nvsim")
    assert res.returncode == 0, f"rmmod nvsim: {res.stderr}"


@pytest.fixture
def nvsim() -> Iterator[Path]:
    """nvsim with 2 GPUs of 1 GiB."""
    yield from nvsim_loaded(1024)


@pytest.fixture
def vgpu(nvsim: Path) -> Iterator[Path]:
    """vgpu over nvsim; a short upcall timeout keeps failure tests fast."""
    insmod(VGPU_KO, f"backing_dir={nvsim}", "upcall_timeout_ms=2000")
    wait_path(VGPU_DIR / "nvidiactl")
    yield VGPU_DIR
    res = rmmod("vgpu")
    assert res.returncode == 0, f"rmmod vgpu (something still open?): {res.stderr}"


@pytest.fixture
def daemon_factory() -> Iterator[type[Daemon]]:
    started: list[Daemon] = []

    class Tracked(Daemon):
        def start(self, timeout: float = 60.0) -> Daemon:
            started.append(self)
            return super().start(timeout)

    yield Tracked
    for d in started:
        d.kill()
