"""Item 15: a process inherits another's tenant by taking its pid.

A pid binding named a number: when the bound process exited, the next
process given that pid (by the kernel's pid allocator, which any process
can drive by forking, or in the next boot) was resolved to the bound
tenant. Now the module sends the opener's start time with the OPEN upcall
and a binding names one process. The test binds a running process of the
tenant uid through the config's `pids`, lets it open (allowed as the bound
tenant), kills it, and has the kernel hand its pid to a new process of the
same uid (as root, through /proc/sys/kernel/ns_last_pid). That process
matches no rule: its opens must fail with EACCES, and nvsim's count of
opens must not move.
"""

from __future__ import annotations

import errno
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.guest import get_param
from tests.support.hostile import TENANT_UID, spawn_tenant, start_daemon
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm

TENANTS = """\
[[tenant]]
name = "bound"
memory = "64MiB"
pids = [{pid}]
"""

# Waits for a line on stdin, then opens nvidiactl and reports the errno (0: opened).
OPENER = r"""
import os, sys
sys.stdin.readline()
try:
    os.close(os.open("/dev/vgpu/nvidiactl", os.O_RDWR))
    print(0, flush=True)
except OSError as e:
    print(e.errno, flush=True)
"""


def opens() -> int:
    return int(get_param("nvsim", "opens"))


def spawn_opener(pid: int | None = None) -> subprocess.Popen[str]:
    """The opener as the tenant uid; with `pid`, the kernel gives it that pid."""
    if pid is not None:
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
    return spawn_tenant(OPENER, stdin=True)


def open_once(p: subprocess.Popen[str]) -> int:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("go\n")
    p.stdin.flush()
    return int(p.stdout.readline())


@pytest.fixture
def bound(vgpu: Path, daemon_factory, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Daemon]]:
    first = spawn_opener()
    daemon = start_daemon(daemon_factory, tmp_path, TENANTS.replace("{pid}", str(first.pid)))
    yield first, daemon
    print(daemon.log())


def test_a_reused_pid_is_not_bound(bound: tuple[subprocess.Popen, Daemon]) -> None:
    first, _daemon = bound
    pid = first.pid
    before = opens()
    assert open_once(first) == 0  # the bound process itself
    assert opens() == before + 1
    first.wait(timeout=60)

    tries = 0
    while True:  # another process may take the pid first: try again
        tries += 1
        second = spawn_opener(pid)
        if second.pid == pid:
            break
        second.send_signal(signal.SIGKILL)
        second.wait()
        assert tries < 20, f"the kernel would not hand out pid {pid} again"
        time.sleep(0.1)
    try:
        print(f"pid {pid} reused after {tries} tries (uid {TENANT_UID})")
        assert open_once(second) == errno.EACCES
        assert opens() == before + 1
    finally:
        second.kill()
        second.wait()
