"""Item 12: late verdicts leak reservations.

When the module gives up on an upcall (its caller timed out or was killed),
the daemon still decides it when it gets to it, and reserved the memory of
an allocation that never happened; that reservation stayed until the file
closed, and the tenant lost that much of its quota. Now the module sends an
ABANDONED event after giving up, and the daemon gives the reservation back
(an abandoned OPEN's context is forgotten the same way).

The daemon is stopped (SIGSTOP) while the tenant (uid 1003, 64 MiB) asks for
48 MiB: the call times out (fail-closed, ETIMEDOUT). The daemon resumes,
decides the stale upcall and reads the ABANDONED event. The tenant then asks
for 48 MiB again: it gets them, and nvsim holds exactly 48 MiB for it.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.hostile import ALLOC_48MIB_PER_LINE, ask, spawn_tenant
from tests.support.nvsim import Fds, heap_free
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm

MIB = 2**20







def test_a_timed_out_allocation_gives_its_quota_back(daemon: Daemon, nvsim: Path) -> None:
    fds = Fds(nv.NvNodes(nvsim))
    tenant = spawn_tenant(ALLOC_48MIB_PER_LINE, stdin=True)
    try:
        root = nv.build_tree(fds.ctl(), 0)
        free0 = heap_free(fds.fds[0], root)
        assert tenant.stdout.readline().strip() == "ready"
        assert daemon.proc is not None
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            assert ask(tenant) == [errno.ETIMEDOUT, 0]  # fail-closed: no verdict in time
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert heap_free(fds.fds[0], root) == free0  # nothing was allocated
        assert ask(tenant) == [0, nv.NV_OK]  # the whole quota is there again
        held = (free0 - heap_free(fds.fds[0], root)) * 1024
        print(f"nvsim holds {held // MIB} MiB for the tenant (quota 64 MiB)")
        assert held == 48 * MIB
        assert ask(tenant)[1] == nv.NV_ERR_NO_MEMORY  # and no more than it
    finally:
        tenant.kill()
        tenant.wait()
        fds.close_all()
