"""Item 9: memory the quota never sees.

The daemon's filter sent up only the classes it charged (local memory) and
the tree classes; every other RM_ALLOC went straight to the driver. So a
tenant with a 64 MiB quota could take the GPU's memory as NV_MEMORY_FABRIC
(0xF8, video memory in 2 MiB pages), reach the driver with any memory class
the daemon did not know, and create channel groups (each with its context
buffers in video memory) without bound. Now every RM_ALLOC goes up: fabric
classes and memory classes the daemon does not know are refused as the driver
refuses a class it has no constructor for (NV_ERR_INVALID_CLASS), and objects
that make video memory implicitly are counted per tenant against a limit
(channel groups: 256 by default), over which the driver's out-of-resources
status (NV_ERR_INSUFFICIENT_RESOURCES) is the answer.

Judged by nvsim: the GPU's free heap read as root through nvsim's own nodes
while the tenant (uid 1003) loops fabric allocations for DURATION seconds;
nvsim's call count for the unknown classes; and nvsim's own list of channel
groups (/proc/driver/nvsim/groups), sampled while the tenant makes groups
with fresh handles for DURATION seconds (freeing some whenever refused).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.hostile import run_tenant, spawn_tenant
from tests.support.nvsim import Fds, heap_free
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm

QUOTA_MIB = 64
DURATION = 10.0
GROUP_LIMIT = 256  # the documented default of limits.channel_groups
# The group loop runs DURATION seconds and at least this many attempts (a
# loaded TCG guest makes a few tens a second), at most GROUP_MAX_S seconds.
GROUP_ATTEMPTS = 3 * GROUP_LIMIT
GROUP_MAX_S = 300.0
# Memory classes a tenant has no business allocating, or that no driver has:
# NV01_MEMORY_LOCAL_PHYSICAL, NV_MEMORY_FABRIC_IMPORT_V2, NV_MEMORY_MULTICAST_FABRIC,
# NV_MEMORY_EXTENDED_USER, NV01_MEMORY_HW_RESOURCES, and unassigned numbers.
UNKNOWN = (0xC2, 0xF9, 0xFD, 0x42, 0xB1, 0xEE, 0x3D, 0xFF)

# Allocates 4 MiB fabric objects under the subdevice, keeping what it gets;
# when refused, frees half and goes on.
FABRIC = r"""
import collections, json, os, time
from tests.support import nvclient as nv
ctl = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(ctl)
print("ready", flush=True)
seen, held = collections.Counter(), []
end = time.monotonic() + DURATION
while time.monotonic() < end:
    r = nv.alloc_fabric(ctl, tree.client, tree.subdevice, 4 << 20)
    seen[f"{r.errno}/{r.status:#x}"] += 1
    if r.errno == 0 and r.status == 0:
        held.append(r.handle)
        continue
    for h in held[: len(held) // 2 + 1]:
        nv.rm_free(ctl, tree.client, tree.subdevice, h)
    del held[: len(held) // 2 + 1]
print(json.dumps(seen), flush=True)
"""

PROBE = r"""
import collections, json, os
from tests.support import nvclient as nv
ctl = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(ctl)
seen = collections.Counter()
for c in UNKNOWN:
    for _ in range(10):
        r = nv.rm_alloc(ctl, tree.client, tree.device, 0, c, nv.memory_params(2 << 20))
        seen[f"{r.errno}/{r.status:#x}"] += 1
print(json.dumps(seen))
"""

# Makes channel groups with fresh (generated) handles; when refused, frees
# half of what it holds and goes on. Prints its client handle first.
GROUPS = r"""
import collections, json, os, time
from tests.support import nvclient as nv
ctl = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(ctl)
print(tree.client, flush=True)
seen, held = collections.Counter(), []
start = time.monotonic()
n = 0
while (time.monotonic() < start + DURATION or n < ATTEMPTS) and \
        time.monotonic() < start + MAX_S:
    n += 1
    r = nv.rm_alloc(ctl, tree.client, tree.device, 0, nv.KEPLER_CHANNEL_GROUP_A,
                    nv.TSG_ALLOC.pack(0, 0, 0, 0, 0))
    seen[f"{r.errno}/{r.status:#x}"] += 1
    if r.errno == 0 and r.status == 0:
        held.append(r.handle)
        continue
    for h in held[: len(held) // 2 + 1]:
        nv.rm_free(ctl, tree.client, tree.device, h)
    del held[: len(held) // 2 + 1]
print(json.dumps(seen), flush=True)
"""


def test_fabric_memory_is_refused(daemon: Daemon, nvsim: Path) -> None:
    fds = Fds(nv.NvNodes(nvsim))
    try:
        ctl = fds.ctl()
        root = nv.build_tree(ctl)
        base = heap_free(ctl, root)
        p = spawn_tenant(f"DURATION = {DURATION}\n{FABRIC}")
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.stderr else ""
        worst = samples = 0
        while p.poll() is None:
            worst = max(worst, base - heap_free(ctl, root))
            samples += 1
            time.sleep(0.05)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        worst = max(worst, base - heap_free(ctl, root))
        seen = json.loads(out.splitlines()[-1])
        attempts = sum(seen.values())
        print(f"attempts: {attempts} fabric allocations in {DURATION:.0f} s: {seen}; nvsim "
              f"held at most {worst / 1024:.0f} MiB for a {QUOTA_MIB} MiB tenant "
              f"({samples + 1} samples)")
        assert attempts >= 2 * (QUOTA_MIB // 4)
        assert worst <= QUOTA_MIB * 1024
        assert worst == 0  # fabric memory is refused outright, not charged
        assert seen == {f"0/{nv.NV_ERR_INVALID_CLASS:#x}": attempts}, seen
    finally:
        fds.close_all()


def test_unknown_memory_class_never_reaches_nvsim(daemon: Daemon, nvsim: Path) -> None:
    calls = nv.rm_calls()
    res = run_tenant(f"UNKNOWN = {UNKNOWN!r}\n{PROBE}", timeout=600)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout.splitlines()[-1])
    print(f"attempts: {10 * len(UNKNOWN)} allocations of unknown memory classes: {seen}; "
          f"nvsim saw {nv.rm_calls() - calls} calls")
    assert seen == {f"0/{nv.NV_ERR_INVALID_CLASS:#x}": 10 * len(UNKNOWN)}
    # nvsim saw the tree (client, device, subdevice) and nothing else.
    assert nv.rm_calls() == calls + 3


def test_channel_groups_are_bounded(daemon: Daemon, nvsim: Path) -> None:
    p = spawn_tenant(f"DURATION = {DURATION}\nATTEMPTS = {GROUP_ATTEMPTS}\n"
                     f"MAX_S = {GROUP_MAX_S}\n{GROUPS}")
    assert p.stdout is not None
    first = p.stdout.readline().strip()
    assert first.isdigit(), first + (p.stderr.read() if p.stderr else "")
    client = int(first)
    worst = samples = 0
    while p.poll() is None:
        worst = max(worst, sum(1 for g in nv.proc_groups() if g.client == client))
        samples += 1
        time.sleep(0.05)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    worst = max(worst, sum(1 for g in nv.proc_groups() if g.client == client))
    seen = json.loads(out.splitlines()[-1])
    attempts = sum(seen.values())
    print(f"attempts: {attempts} channel groups: {seen}; nvsim held "
          f"at most {worst} groups for the tenant (limit {GROUP_LIMIT}, {samples} samples)")
    assert attempts >= GROUP_ATTEMPTS
    assert worst <= GROUP_LIMIT
    assert seen.get("0/0x0", 0) > GROUP_LIMIT  # the limit was reached, and freed again
    assert set(seen) <= {"0/0x0", f"0/{nv.NV_ERR_INSUFFICIENT_RESOURCES:#x}"}, seen
