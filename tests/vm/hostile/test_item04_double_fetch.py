"""Item 4: a double fetch outside the shadow rules.

The module matched a call against the filter on its copy of the params, but
forwarded the caller's own pointer when no rule's key matched (and under a
rule without VGPU_RULE_F_SHADOW, and on fail-open): the driver read the
params again. A sibling thread flipping the key in between took the call
past the filter: here hClass between NV50_MEMORY_VIRTUAL (0x50A0, no rule,
not charged) and NV01_MEMORY_LOCAL_USER (0x40, charged), so that the module
saw a virtual range and the driver made video memory nobody charged. Now
every call the module read to match it runs on a shadow of what it read.

The tenant (uid 1003, 64 MiB) races in C (tests/support/attack_flip.c) for
at least 10 s and 10^5 calls, plain and wrapped in IOCTL_XFER_CMD, keeping
whatever it gets. Judged by nvsim: the video memory it holds for the tenant,
sampled during the race, never exceeds the quota.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.hostile import attacker_binary, spawn_tenant
from tests.support.nvsim import Fds, HeapSampler
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm

MIB = 2**20
QUOTA = 64 * MIB
SIZE = 16 * MIB

# The tenant builds its tree through vgpu, then hands the fd to the racer.
TENANT = r"""
import os, subprocess, sys
from tests.support import nvclient as nv
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(fd)
out = subprocess.run([sys.argv[1], str(fd), str(tree.client), str(tree.subdevice), *sys.argv[2:]],
                     pass_fds=(fd,), capture_output=True, text=True, check=True).stdout
print(out.strip())
"""


@pytest.fixture(scope="module")
def racer() -> Iterator[Path]:
    with attacker_binary("attack_flip") as exe:
        yield exe




@pytest.mark.parametrize("wrapped", [False, True], ids=["direct", "xfer"])
def test_flipping_the_class_gets_no_uncharged_memory(daemon: Daemon, nvsim: Path, racer: Path,
                                                      wrapped: bool) -> None:
    fds = Fds(nv.NvNodes(nvsim))
    try:
        with HeapSampler(fds) as heap:
            args = [str(racer), str(SIZE), hex(nv.NV50_MEMORY_VIRTUAL),
                    hex(nv.NV01_MEMORY_LOCAL_USER), "10", "120", "100000",
                    *(["xfer"] if wrapped else [])]
            tenant = spawn_tenant(f"import sys; sys.argv[1:] = {json.dumps(args)}\n{TENANT}")
            try:
                out, err = tenant.communicate(timeout=900)
            finally:
                tenant.kill()
            assert tenant.returncode == 0, err
        print(f"race ({'xfer' if wrapped else 'direct'}): {out.strip()}; nvsim held for the "
              f"tenant at most {max(heap.samples) // MIB} MiB in {len(heap.samples)} samples "
              f"(quota {QUOTA // MIB} MiB)")
        attempts = int(out.split()[1])
        assert attempts > 0
        assert max(heap.samples) <= QUOTA
    finally:
        fds.close_all()
