"""Item 16a: an opener the daemon refuses never reaches the driver.

vgpu once opened the backing driver's file before it asked the daemon, so a
refused tenant still made the driver open a file (and on a real GPU, start
it up). Now the OPEN verdict comes first. With the real daemon, uid 1003
matches no tenant (and there is no default tenant): its opens fail with
EACCES and nvsim's own count of opens does not move; an opener the daemon
allows (root, tenant "ops") moves it by one per open.
"""

from __future__ import annotations

import errno
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.guest import get_param
from tests.support.hostile import run_tenant, start_daemon
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm

ATTEMPTS = 200

TENANTS = """\
[[tenant]]
name = "ops"
memory = "256MiB"
match = [{ uid = 0 }]
"""

# Opens every emulated node ATTEMPTS times over; reports the errnos seen.
REFUSED = r"""
import collections, json, os
seen = collections.Counter()
for _ in range(ATTEMPTS):
    for name in ("nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm"):
        try:
            os.close(os.open(f"/dev/vgpu/{name}", os.O_RDWR))
            seen["0"] += 1
        except OSError as e:
            seen[str(e.errno)] += 1
print(json.dumps(seen))
"""


@pytest.fixture
def refusing_daemon(vgpu: Path, daemon_factory, tmp_path: Path) -> Iterator[Daemon]:
    daemon = start_daemon(daemon_factory, tmp_path, TENANTS)
    yield daemon
    print(daemon.log())


def opens() -> int:
    return int(get_param("nvsim", "opens"))


def test_refused_opener_never_reaches_nvsim(vgpu: Path, refusing_daemon: Daemon) -> None:
    before = opens()
    res = run_tenant(f"ATTEMPTS = {ATTEMPTS}\n{REFUSED}", timeout=600)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout.splitlines()[-1])
    print(f"attempts: {4 * ATTEMPTS} opens refused")
    assert seen == {str(errno.EACCES): 4 * ATTEMPTS}
    assert opens() == before

    # The counter moves for an opener the daemon allows: one nvsim open each.
    with open(vgpu / "nvidiactl", "rb", buffering=0), open(vgpu / "nvidia0", "rb", buffering=0):
        assert opens() == before + 2
