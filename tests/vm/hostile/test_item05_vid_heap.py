"""Item 5: allocating VID_HEAP functions that were not filtered.

ALLOC_TILED_PITCH_HEIGHT (6, size = height x pitch) and ALLOC_SIZE_RANGE (14)
make video memory through the same construct as ALLOC_SIZE, but the daemon's
filter sent only ALLOC_SIZE, FREE and INFO up: a tenant with a 64 MiB quota
took as much of the GPU as nvsim had. Now every VID_HEAP_CONTROL goes up, the
two are charged as ALLOC_SIZE is, and a function the daemon does not know to
be harmless is refused as the driver refuses one it has no handler for
(NV_ERR_INVALID_ARGUMENT), before it reaches nvsim.

Judged by nvsim: the GPU's free heap read as root through nvsim's own nodes,
sampled while the tenant (uid 1003) loops both allocations for DURATION
seconds, never shows more than the quota held; nvsim's call count does not
move for the unknown functions.
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

MIB = 2**20
QUOTA_MIB = 64
DURATION = 10.0
UNKNOWN = (1, 4, 7, 13, 99, 0xFFFFFFFF)  # no handler in the driver

# Alternates 4 MiB tiled (1024 x 4096, size field 0) and 4 MiB ranged
# allocations, keeping what it gets; when refused, frees half and goes on.
FLOOD = r"""
import collections, json, os, time
from tests.support import nvclient as nv
ctl = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(ctl)
print("ready", flush=True)
seen, held = collections.Counter(), []
end = time.monotonic() + DURATION
while time.monotonic() < end:
    if len(held) % 2:
        r = nv.vid_heap_alloc_range(ctl, tree.client, tree.device, 4 << 20)
        kind = "range"
    else:
        r = nv.vid_heap_alloc_tiled(ctl, tree.client, tree.device, 1024, 4096)
        kind = "tiled"
    seen[f"{kind} {r.errno}/{r.status:#x}"] += 1
    if r.status == 0:
        held.append(r.handle)
        continue
    for h in held[: len(held) // 2 + 1]:
        nv.vid_heap_free(ctl, tree.client, tree.device, h)
    del held[: len(held) // 2 + 1]
print(json.dumps(seen), flush=True)
"""

PROBE = r"""
import collections, json, os
from tests.support import nvclient as nv
ctl = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(ctl)
seen = collections.Counter()
for f in UNKNOWN:
    for _ in range(10):
        e, st, _, _ = nv.vid_heap(ctl, tree.client, tree.device, f)
        seen[f"{e}/{st:#x}"] += 1
print(json.dumps(seen))
"""




def _flood(ctl: int, root: nv.Tree) -> tuple[dict[str, int], int, int]:
    """Runs FLOOD; returns its counts, the most nvsim held for it (KiB) and the
    number of samples."""
    base = heap_free(ctl, root)
    p = spawn_tenant(f"DURATION = {DURATION}\n{FLOOD}")
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
    return json.loads(out.splitlines()[-1]), worst, samples + 1


def test_tiled_and_ranged_allocations_are_charged(daemon: Daemon, nvsim: Path) -> None:
    fds = Fds(nv.NvNodes(nvsim))
    try:
        ctl = fds.ctl()
        root = nv.build_tree(ctl)
        seen, worst_kib, samples = _flood(ctl, root)
        attempts = sum(seen.values())
        print(f"attempts: {attempts} in {DURATION:.0f} s: {seen}; nvsim held at most "
              f"{worst_kib / 1024:.0f} MiB for a {QUOTA_MIB} MiB tenant ({samples} samples)")
        assert attempts >= 2 * (QUOTA_MIB // 4)
        assert seen.get("tiled 0/0x0", 0) and seen.get("range 0/0x0", 0)
        assert worst_kib <= QUOTA_MIB * 1024
        refused = nv.NV_ERR_NO_MEMORY
        assert set(seen) <= {"tiled 0/0x0", "range 0/0x0", f"tiled 0/{refused:#x}",
                             f"range 0/{refused:#x}"}, seen
    finally:
        fds.close_all()


def test_unknown_function_never_reaches_nvsim(daemon: Daemon, nvsim: Path) -> None:
    calls = nv.rm_calls()
    res = run_tenant(f"UNKNOWN = {UNKNOWN!r}\n{PROBE}", timeout=600)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout.splitlines()[-1])
    print(f"attempts: {10 * len(UNKNOWN)} unknown functions: {seen}; nvsim saw "
          f"{nv.rm_calls() - calls} calls")
    assert seen == {f"0/{nv.NV_ERR_INVALID_ARGUMENT:#x}": 10 * len(UNKNOWN)}
    # nvsim saw the tree (client, device, subdevice) and nothing else.
    assert nv.rm_calls() == calls + 3
