"""Fixtures of the VM tier: real modules in a real kernel, the real daemon.

These tests run as root inside the guest booted by scripts/vm-run; on any
other machine they are skipped, since the kernel modules cannot be loaded.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

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


def set_param(module: str, name: str, value: str) -> None:
    Path(f"/sys/module/{module}/parameters/{name}").write_text(value)


@pytest.fixture
def nvsim() -> Iterator[Path]:
    """nvsim with 2 GPUs of 1 GiB, unloaded (and checked) after the test."""
    insmod(NVSIM_KO, "gpus=2", "mem_mib=1024")
    wait_path(NVSIM_DIR / "nvidiactl")
    yield NVSIM_DIR
    res = rmmod("nvsim")
    assert res.returncode == 0, f"rmmod nvsim: {res.stderr}"


@pytest.fixture
def vgpu(nvsim: Path) -> Iterator[Path]:
    """vgpu over nvsim; a short upcall timeout keeps failure tests fast."""
    insmod(VGPU_KO, f"backing_dir={nvsim}", "upcall_timeout_ms=2000")
    wait_path(VGPU_DIR / "nvidiactl")
    yield VGPU_DIR
    res = rmmod("vgpu")
    assert res.returncode == 0, f"rmmod vgpu (something still open?): {res.stderr}"


class Daemon:
    """The real vgpud as a subprocess; READY=1 is read from a NOTIFY_SOCKET."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="vgpud-test-")
        self.log_path = Path(self.dir) / "vgpud.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> Daemon:
        sock_path = os.path.join(self.dir, f"notify-{time.monotonic_ns()}")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(sock_path)
        notify.settimeout(timeout)
        env = dict(os.environ, NOTIFY_SOCKET=sock_path)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vgpud.daemon", "--log-level", "debug", *self.args],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        try:
            while True:
                msg = notify.recv(4096).decode()
                if "READY=1" in msg.split("\n"):
                    break
        except TimeoutError:
            self.kill()
            raise AssertionError(f"vgpud not ready in {timeout}s:\n{self.log()}") from None
        finally:
            notify.close()
            os.unlink(sock_path)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        """SIGTERM and wait: a graceful drain exits 0."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
            return self.proc.wait(timeout=30)
        return self.proc.returncode


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
