"""Item 1: a tenant chooses the file behind an emulated node.

vgpu once opened its backing node by path, in the caller's mount namespace:
a tenant in `unshare -Urm` that bound /dev/vgpu/nvidiactl over the backing
/dev/nvsim/nvidiactl made one open of /dev/vgpu/nvidiactl recurse until the
kernel stack overflowed ("BUG: TASK stack guard page was hit", vgpu_open and
chrdev_open repeating: the guest died, so this test is not run on that
code), and any other file bound there became the "driver". Now the module
resolves its backing nodes once, at load: whatever the tenant binds, every
open of an emulated node opens nvsim's node exactly once (nvsim's `opens`)
and every call reaches nvsim (its `rm_calls`).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.guest import NVSIM_DIR, get_param
from tests.support.hostile import backing_fds, spawn_tenant, uid_pids

pytestmark = pytest.mark.vm

# Shared by both attacks: opens the emulated nodes named, makes two calls on
# each nvidiactl (CARD_INFO, a root client), prints what it saw, then holds
# its files until killed, so that the test can look at them.
CALLS = r"""
import json, os, subprocess, tempfile, time
from tests.support import nvclient as nv

def bind(src, dst):
    subprocess.run(["mount", "--bind", src, dst], check=True)

def attack(paths):
    fds, seen = [], []
    for path in paths:
        fd = os.open(path, os.O_RDWR)
        fds.append(fd)
        if path.endswith("nvidiactl"):
            ret, _ = nv.card_info(fd)
            seen.append([ret, nv.alloc_client(fd)])
    print(json.dumps({"opens": len(fds), "calls": 2 * len(seen), "seen": seen}), flush=True)
    time.sleep(600)
"""

# The emulated node bound over its own backing path, in the tenant's own
# user and mount namespace; then opened under both names, 50 times.
RECURSE = CALLS + r"""
for name in ("nvidiactl", "nvidia0", "nvidia1"):
    bind(f"/dev/vgpu/{name}", f"/dev/nvsim/{name}")
attack(["/dev/vgpu/nvidiactl"] * 49 + ["/dev/nvsim/nvidiactl", "/dev/vgpu/nvidia0"])
"""

# Files of the tenant's choosing bound over the backing paths: a file of its
# own and /dev/null.
REPLACE = CALLS + r"""
fake = os.path.join(tempfile.mkdtemp(), "nvidiactl")
open(fake, "w").close()
bind(fake, "/dev/nvsim/nvidiactl")
bind("/dev/null", "/dev/nvsim/nvidia0")
attack(["/dev/vgpu/nvidiactl", "/dev/vgpu/nvidia0"])
"""


def counters() -> tuple[int, int]:
    return int(get_param("nvsim", "opens")), int(get_param("nvsim", "rm_calls"))


def backing_rdevs() -> set[int]:
    return {os.stat(p).st_rdev for p in NVSIM_DIR.iterdir()}


@pytest.fixture
def tenant() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        p.kill()
        p.communicate()


def run_attack(code: str, started: list[subprocess.Popen[str]]) -> dict:
    """The attack as uid 1003 in `unshare -Urm`; its report once it holds its files."""
    p = spawn_tenant(code, userns=True)
    started.append(p)
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        p.wait()
        pytest.fail(f"tenant exited {p.returncode}: {p.stderr.read() if p.stderr else ''}")
    return json.loads(line)


@pytest.mark.parametrize("code", [RECURSE, REPLACE], ids=["emulated-node", "own-files"])
def test_bound_backing_path_changes_nothing(vgpu: Path, tenant, code: str) -> None:
    opens0, calls0 = counters()
    seen = run_attack(code, tenant)
    opens1, calls1 = counters()
    print(f"attempts: {seen['opens']} opens, {seen['calls']} calls")
    assert [ret for ret, _ in seen["seen"]] == [0] * len(seen["seen"])
    assert all(client != 0 for _, client in seen["seen"])
    # One nvsim open per emulated open, every call at nvsim: the real backing.
    assert (opens1 - opens0, calls1 - calls0) == (seen["opens"], seen["calls"])
    assert backing_fds(uid_pids(), backing_rdevs()) == []
