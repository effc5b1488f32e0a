"""Item 3: fd translation handed out the real driver's file.

For REGISTER_FD and the fd fields of RM_MAP_MEMORY / RM_ALLOC_MEMORY the
module installed the backing file at a temporary fd in the caller's fd table
for the length of the driver call. A sibling thread dup-ing the lowest free
fds, or a fork in that window, kept an fd on the real driver for good. Now
the temporary fd is an inert proxy file of the module's own (no ioctl, no
mmap, no read or write; the backing device number only during the call), and
a field that names no emulated file reaches the driver as -1.

The tenant (uid 1003) races in C (tests/support/attack_fdwin.c) for at least
10 s and 10^5 calls, with two thieves and forks, keeping what it gets.
Judged by what its processes hold: /proc/<pid>/fd of every uid-1003 process,
scanned during the race and at its end, names no backing node (st_rdev of a
node under /dev/nvsim). During the race a proxy of a call in flight has the
backing device number, so that scan counts only fds whose path is a driver
node; at the end no call is in flight and no fd may have it at all.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hostile import attacker_binary, backing_fds, spawn_tenant, uid_pids
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm



@pytest.fixture(scope="module")
def attacker() -> Iterator[Path]:
    with attacker_binary("attack_fdwin") as exe:
        yield exe


def backing_rdevs(nvsim: Path) -> set[int]:
    return {os.stat(p).st_rdev for p in nvsim.iterdir() if p.is_char_device()}


class Scanner:
    """Scans, as root, the fds of every uid-1003 process while the race runs."""

    def __init__(self, rdevs: set[int]) -> None:
        self.rdevs = rdevs
        self.found: set[str] = set()
        self.in_flight = 0
        self.scans = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for hit in backing_fds(uid_pids(), self.rdevs):
                # "pid:fd -> path": a driver node, or a proxy of a call in flight.
                if hit.split(" -> ", 1)[1].startswith("/dev/"):
                    self.found.add(hit)
                else:
                    self.in_flight += 1
            self.scans += 1

    def __enter__(self) -> Scanner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def race(vgpu: Path, nvsim: Path, attacker: Path) -> None:
    rdevs = backing_rdevs(nvsim)
    args = [str(attacker), str(vgpu), "10", "120", "100000", "2", "16"]
    tenant = spawn_tenant(f"import os; os.execv({args[0]!r}, {args!r})", stdin=True)
    try:
        with Scanner(rdevs) as during:
            assert tenant.stdout is not None
            line = tenant.stdout.readline()
        # The race is over; the tenant and its children hold what they got.
        pids = uid_pids()
        at_end = backing_fds(pids, rdevs)
        _, err = tenant.communicate("\n", timeout=300)
    finally:
        tenant.kill()
    assert tenant.returncode == 0, err
    fields = line.split()
    print(f"race: {line.strip()}; {len(pids)} tenant processes; during: {len(during.found)} "
          f"fds on a backing node in {during.scans} scans ({during.in_flight} proxies in "
          f"flight); at the end: {len(at_end)} fds on a backing node")
    assert int(fields[1]) >= 100000
    assert not during.found, sorted(during.found)[:20]
    assert not at_end, at_end[:20]


def test_fd_window_without_daemon(vgpu: Path, nvsim: Path, attacker: Path) -> None:
    race(vgpu, nvsim, attacker)


def test_fd_window_with_daemon(vgpu: Path, nvsim: Path, attacker: Path,
                               daemon: Daemon) -> None:
    race(vgpu, nvsim, attacker)
