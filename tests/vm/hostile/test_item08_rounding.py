"""Item 8: the charge was the requested size, not the allocated one.

The driver rounds an allocation up to the page size it asks for
(NVOS32_ATTR_PAGE_SIZE: 4 KiB, BIG 64 KiB, HUGE 2 MiB or 512 MiB by attr2)
and to its alignment, and reports the size it allocated back in the params.
The daemon charged the size asked for: 4 KiB allocations with huge pages each
took 2 MiB of the GPU for 4 KiB of quota. Now the reservation is the size
rounded as the driver rounds it, and the charge is the size the driver
reports for the object it made (VGPU_CMD_OBJECT), reconciled with the
reservation; an object over the quota is freed and the call fails with
NV_ERR_NO_MEMORY.

The tenant (uid 1003, 64 MiB) allocates 4 KiB with HUGE (2 MiB) pages under
handles of its own, alternately with RM_ALLOC of NV01_MEMORY_LOCAL_USER and
with VID_HEAP_CONTROL ALLOC_SIZE, until the first refusal. Judged by nvsim:
the memory it holds for the tenant, sampled during the run, never exceeds
the quota, and the refusal is NV_ERR_NO_MEMORY.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.hostile import spawn_tenant
from tests.support.nvsim import Fds, HeapSampler
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm

MIB = 2**20
QUOTA = 64 * MIB

# 4 KiB with NVOS32_ATTR_PAGE_SIZE_HUGE and NVOS32_ATTR2_PAGE_SIZE_HUGE_2MB.
TENANT = r"""
import json, os, struct
from tests.support import nvclient as nv
HUGE, HUGE_2MB = 3 << 23, 1 << 20
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(fd)
ok, sizes, refusal = 0, set(), None
for n in range(4096):
    h = 0x1000 + n
    if n % 2:
        p = bytearray(nv.memory_params(4096))
        struct.pack_into("<II", p, 24, HUGE, HUGE_2MB)  # attr, attr2
        r = nv.rm_alloc(fd, tree.client, tree.subdevice, h, nv.NV01_MEMORY_LOCAL_USER,
                        bytes(p))
        e, st = r.errno, r.status
        size = nv.memory_result(r.params)["size"] if r.params else 0
    else:
        data = nv.NVOS32_ALLOC.pack(0, h, 0, nv.NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED,
                                    HUGE, 0, 0, 0, 0, 0, 0, 4096, 0, 0, 0, 0, 0, 0,
                                    HUGE_2MB, 0, 0)
        e, st, _, out = nv.vid_heap(fd, tree.client, tree.subdevice,
                                    nv.NVOS32_FUNCTION_ALLOC_SIZE, data)
        size = nv.NVOS32_ALLOC.unpack_from(out)[11]
    if e or st:
        refusal = [e, st]
        break
    ok += 1
    sizes.add(size)
print(json.dumps({"attempts": n + 1, "ok": ok, "sizes": sorted(sizes), "refusal": refusal}))
"""


def test_small_allocations_with_huge_pages_stay_within_the_quota(daemon: Daemon,
                                                                  nvsim: Path) -> None:
    fds = Fds(nv.NvNodes(nvsim))
    try:
        with HeapSampler(fds, period=0.05) as heap:
            tenant = spawn_tenant(TENANT)
            try:
                out, err = tenant.communicate(timeout=600)
            finally:
                tenant.kill()
            assert tenant.returncode == 0, err
        got = json.loads(out)
        print(f"4 KiB allocations with 2 MiB pages: {got}; nvsim held for the tenant at most "
              f"{max(heap.samples) / MIB:.1f} MiB in {len(heap.samples)} samples, "
              f"{heap.samples[-1] / MIB:.1f} MiB at the end (quota {QUOTA // MIB} MiB)")
        assert got["sizes"] == [2 * MIB]  # what the driver reports back
        assert max(heap.samples) <= QUOTA
        assert got["refusal"] == [0, nv.NV_ERR_NO_MEMORY]
        assert got["ok"] * 2 * MIB <= QUOTA
    finally:
        fds.close_all()
