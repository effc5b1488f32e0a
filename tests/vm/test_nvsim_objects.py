"""nvsim's RM object tree (VM tier): allocs and frees of clients, devices,
subdevices, memory and the other classes, their errors, files owning their
clients, the capacity of each GPU and its cascade frees, the object bound,
RM controls and VID_HEAP_CONTROL.

Straight on /dev/nvsim, with no vgpu: the `nvsim_env`, `fds` and `ctl`
fixtures of tests/vm/conftest.py load nvsim for the module when it is not
loaded (tests/support/nvsim.py).

    scripts/test-vm -k test_nvsim_objects
"""

from __future__ import annotations

import struct

import pytest

from tests.support import nvclient as nv
from tests.support.nvsim import BAD_PTR, FB_ALL, KERNEL_PTR, MIB, PAGE, fb, heap_free

pytestmark = pytest.mark.vm


def test_full_sequence(nvsim_env, ctl):
    hc, hd, hs, hm = 0xC0DE0001, 0x5C000001, 0x5C000002, 0x5C000003
    r = nv.rm_alloc(ctl, 0, 0, hc, nv.NV01_ROOT_CLIENT)
    assert (r.errno, r.status, r.handle) == (0, nv.NV_OK, hc)
    r = nv.rm_alloc(ctl, hc, hc, hd, nv.NV01_DEVICE_0, nv.device_params(0))
    assert (r.errno, r.status, r.handle) == (0, nv.NV_OK, hd)
    r = nv.rm_alloc(ctl, hc, hd, hs, nv.NV20_SUBDEVICE_0, nv.subdevice_params(0))
    assert (r.errno, r.status, r.handle) == (0, nv.NV_OK, hs)
    tree = nv.Tree(hc, hd, hs)
    cap = nvsim_env.capacity_kib
    assert fb(ctl, tree) == {nv.FB_RAM_SIZE: cap, nv.FB_TOTAL_RAM_SIZE: cap,
                             nv.FB_HEAP_SIZE: cap, nv.FB_HEAP_FREE: cap,
                             nv.FB_USABLE_RAM_SIZE: cap}

    r = nv.alloc_memory(ctl, hc, hd, 3 * MIB + 1, handle=hm)
    assert (r.errno, r.status, r.handle) == (0, nv.NV_OK, hm)
    out = nv.memory_result(r.params)
    assert out["size"] == 3 * MIB + PAGE
    assert out["limit"] == out["size"] - 1
    assert heap_free(ctl, tree) == cap - (3 * MIB + PAGE) // 1024

    assert nv.rm_free(ctl, hc, hd, hm) == (0, nv.NV_OK)
    assert heap_free(ctl, tree) == cap
    assert nv.rm_free(ctl, hc, hd, hm) == (0, nv.NV_ERR_INVALID_OBJECT_HANDLE)
    assert nv.rm_free(ctl, hc, 0, hc) == (0, nv.NV_OK)
    assert nv.rm_free(ctl, hc, 0, hc) == (0, nv.NV_ERR_INVALID_CLIENT)
    assert nv.fb_get_info_v2(ctl, hc, hs, FB_ALL)[:2] == (0, nv.NV_ERR_INVALID_CLIENT)


def test_generated_handles_and_nvos64(ctl):
    r = nv.rm_alloc(ctl, 0, 0, 0, nv.NV01_ROOT_CLIENT, size64=True)
    assert (r.errno, r.status) == (0, nv.NV_OK)
    assert r.handle & 0xFFF00000 == 0xC1D00000
    hc = r.handle
    r = nv.rm_alloc(ctl, hc, hc, 0, nv.NV01_DEVICE_0, nv.device_params(0), size64=True)
    assert (r.errno, r.status) == (0, nv.NV_OK)
    assert r.handle & 0xFFF80000 == 0xCAF00000
    hd = r.handle
    r = nv.rm_alloc(ctl, hc, hd, 0, nv.NV20_SUBDEVICE_0, None)  # params optional
    assert (r.errno, r.status) == (0, nv.NV_OK)
    assert r.handle not in (hc, hd)
    # Classes 0 and 1 allocate a client too.
    r = nv.rm_alloc(ctl, 0, 0, 0, 0)
    assert (r.errno, r.status) == (0, nv.NV_OK)
    # Client handles are one global space.
    r = nv.rm_alloc(ctl, 0, 0, hc, nv.NV01_ROOT_CLIENT)
    assert r.status == nv.NV_ERR_INSERT_DUPLICATE_NAME
    # Other classes of the tree.
    assert nv.rm_alloc(ctl, hc, hd, 0, nv.FERMI_VASPACE_A, None).status == nv.NV_OK
    va = nv.VASPACE_ALLOC.pack(0, 0, 0, 0, 0, 0, 0, 0)
    assert nv.rm_alloc(ctl, hc, hd, 0, nv.FERMI_VASPACE_A, va).status == nv.NV_OK
    tsg = nv.TSG_ALLOC.pack(0, 0, 0, 1, 0)
    assert nv.rm_alloc(ctl, hc, hd, 0, nv.KEPLER_CHANNEL_GROUP_A, tsg).status == nv.NV_OK
    r = nv.alloc_memory(ctl, hc, hd, 1 << 40, hclass=nv.NV50_MEMORY_VIRTUAL)
    assert r.status == nv.NV_OK


def test_alloc_errors(nvsim_env, ctl):
    t = nv.build_tree(ctl)
    c, d, s = t.client, t.device, t.subdevice
    dp = nv.device_params(0)
    cases = [
        (nv.rm_alloc(ctl, c, d, 0, 0x1234, None), nv.NV_ERR_INVALID_CLASS),
        (nv.rm_alloc(ctl, 0x0BAD0BAD, 0x0BAD0BAD, 0, nv.NV01_DEVICE_0, dp),
         nv.NV_ERR_INVALID_CLIENT),
        (nv.rm_alloc(ctl, c, 0x0BAD0BAD, 0, nv.NV20_SUBDEVICE_0, None),
         nv.NV_ERR_INVALID_OBJECT_PARENT),
        (nv.rm_alloc(ctl, c, c, s, nv.NV01_DEVICE_0, dp), nv.NV_ERR_INSERT_DUPLICATE_NAME),
        (nv.rm_alloc(ctl, c, c, 0, nv.NV01_DEVICE_0, None), nv.NV_ERR_INVALID_ARGUMENT),
        (nv.rm_alloc(ctl, c, c, 0, nv.NV01_DEVICE_0, None, params_size=56),
         nv.NV_ERR_INVALID_ARGUMENT),
        (nv.rm_alloc(ctl, c, c, 0, nv.NV01_DEVICE_0, None, params_ptr=BAD_PTR, params_size=56),
         nv.NV_ERR_INVALID_ADDRESS),
        (nv.rm_alloc(ctl, c, c, 0, nv.NV01_DEVICE_0, None, params_ptr=KERNEL_PTR,
                     params_size=56), nv.NV_ERR_INVALID_ADDRESS),
        (nv.rm_alloc(ctl, c, c, 0, nv.NV01_DEVICE_0, nv.device_params(nvsim_env.gpus)),
         nv.NV_ERR_INVALID_STATE),
        (nv.rm_alloc(ctl, c, c, 0, nv.NV01_DEVICE_0, nv.device_params(32)),
         nv.NV_ERR_INVALID_ARGUMENT),
        (nv.rm_alloc(ctl, c, d, 0, nv.NV20_SUBDEVICE_0, nv.subdevice_params(1)),
         nv.NV_ERR_INVALID_ARGUMENT),
        (nv.rm_alloc(ctl, c, c, 0, nv.NV20_SUBDEVICE_0, None), nv.NV_ERR_INVALID_OBJECT_PARENT),
        (nv.rm_alloc(ctl, c, d, 0, nv.NV01_DEVICE_0, dp), nv.NV_ERR_INVALID_OBJECT_PARENT),
        (nv.alloc_memory(ctl, c, c, MIB), nv.NV_ERR_INVALID_OBJECT_PARENT),
        (nv.alloc_memory(ctl, c, d, 0), nv.NV_ERR_INVALID_ARGUMENT),
        (nv.rm_alloc(ctl, c, d, 0, nv.NV01_MEMORY_LOCAL_USER, None, params_ptr=BAD_PTR),
         nv.NV_ERR_INVALID_ADDRESS),
        (nv.rm_alloc(ctl, c, s, 0, nv.KEPLER_CHANNEL_GROUP_A, None),
         nv.NV_ERR_INVALID_OBJECT_PARENT),
    ]
    for i, (r, want) in enumerate(cases):
        assert (i, r.errno, r.status) == (i, 0, want)
    # Memory may hang off the subdevice too; the capacity is untouched by failures.
    assert nv.alloc_memory(ctl, c, s, MIB).status == nv.NV_OK
    assert heap_free(ctl, t) == nvsim_env.capacity_kib - 1024


@pytest.mark.parametrize("size64", [False, True], ids=["NVOS21", "NVOS64"])
def test_alloc_params_are_read_by_their_class_size(nvsim_env, ctl, size64):
    """As the driver (serverAllocApiCopyIn): alloc params are read by the size
    their class takes; NVOS21/NVOS64 paramsSize is never looked at (libcuda
    leaves it 0, tests/data/traces/h200-*). The results are written back by
    that size too."""
    t = nv.build_tree(ctl)
    for psize in (0, 8, 127, 129, 0xFFFFFFFF):
        r = nv.alloc_memory(ctl, t.client, t.device, 3 * MIB, size64=size64,
                            params_size=psize)
        assert (psize, r.errno, r.status) == (psize, 0, nv.NV_OK)
        assert r.params is not None and nv.memory_result(r.params)["size"] == 3 * MIB
    assert heap_free(ctl, t) == nvsim_env.capacity_kib - 5 * 3 * 1024
    dev = nv.rm_alloc(ctl, t.client, t.client, 0, nv.NV01_DEVICE_0, nv.device_params(0),
                      size64=size64, params_size=57)
    assert (dev.errno, dev.status) == (0, nv.NV_OK)


def test_clients_belong_to_their_file(fds):
    a, b = fds.ctl(), fds.ctl()
    t = nv.build_tree(a)
    assert nv.fb_get_info_v2(b, t.client, t.subdevice, FB_ALL)[:2] == (0, nv.NV_ERR_INVALID_CLIENT)
    assert nv.rm_free(b, t.client, 0, t.client) == (0, nv.NV_ERR_INVALID_CLIENT)
    assert nv.alloc_memory(b, t.client, t.device, MIB).status == nv.NV_ERR_INVALID_CLIENT


def test_capacity_exhaustion(nvsim_env, ctl):
    t = nv.build_tree(ctl, device_id=nvsim_env.gpus - 1)
    cap = nvsim_env.mem_mib * MIB
    assert nv.alloc_memory(ctl, t.client, t.device, cap + 1).status == nv.NV_ERR_NO_MEMORY
    a = nv.alloc_memory(ctl, t.client, t.device, cap // 2)
    b = nv.alloc_memory(ctl, t.client, t.device, cap // 2)
    assert (a.status, b.status) == (nv.NV_OK, nv.NV_OK)
    assert heap_free(ctl, t) == 0
    r = nv.alloc_memory(ctl, t.client, t.device, PAGE)
    assert (r.errno, r.status) == (0, nv.NV_ERR_NO_MEMORY)
    r = nv.alloc_memory(ctl, t.client, t.device, PAGE, hclass=nv.NV01_MEMORY_LOCAL_PRIVILEGED)
    assert r.status == nv.NV_ERR_NO_MEMORY
    # Virtual ranges are not charged.
    assert nv.alloc_memory(ctl, t.client, t.device, cap, hclass=nv.NV50_MEMORY_VIRTUAL).status == 0
    assert nv.rm_free(ctl, t.client, t.device, a.handle) == (0, nv.NV_OK)
    assert nv.alloc_memory(ctl, t.client, t.device, cap // 4).status == nv.NV_OK
    # The other GPU is independent.
    if nvsim_env.gpus > 1:
        t0 = nv.build_tree(ctl, device_id=0)
        assert nv.alloc_memory(ctl, t0.client, t0.device, cap // 2).status == nv.NV_OK


def test_cascade_free_returns_capacity(nvsim_env, ctl):
    t = nv.build_tree(ctl)
    c = nv.alloc_client(ctl)
    d = nv.alloc_device(ctl, c, 0)
    s = nv.alloc_subdevice(ctl, c, d)
    part = nvsim_env.mem_mib // 8 * MIB
    mems = [nv.alloc_memory(ctl, c, d, part).handle for _ in range(3)]
    mems.append(nv.alloc_memory(ctl, c, s, part).handle)
    assert heap_free(ctl, t) == nvsim_env.capacity_kib - 4 * part // 1024
    assert nv.rm_free(ctl, c, c, d) == (0, nv.NV_OK)
    assert heap_free(ctl, t) == nvsim_env.capacity_kib
    for h in [s, *mems]:
        assert nv.rm_free(ctl, c, d, h) == (0, nv.NV_ERR_INVALID_OBJECT_HANDLE)
    # The client survives its device.
    d2 = nv.alloc_device(ctl, c, 0)
    assert nv.alloc_memory(ctl, c, d2, part).status == nv.NV_OK
    assert nv.rm_free(ctl, c, 0, c) == (0, nv.NV_OK)
    assert heap_free(ctl, t) == nvsim_env.capacity_kib


def test_close_frees_clients(nvsim_env, ctl, fds):
    t = nv.build_tree(ctl)
    other = fds.ctl()
    quarter = nvsim_env.mem_mib // 4 * MIB
    for _ in range(2):
        t2 = nv.build_tree(other)
        assert nv.alloc_memory(other, t2.client, t2.device, quarter).status == nv.NV_OK
    assert heap_free(ctl, t) == nvsim_env.capacity_kib - 2 * quarter // 1024
    fds.close(other)
    assert heap_free(ctl, t) == nvsim_env.capacity_kib


def test_object_bound(ctl):
    t = nv.build_tree(ctl)
    n = 3
    while True:
        r = nv.rm_alloc(ctl, t.client, t.device, 0, nv.FERMI_VASPACE_A, None)
        if r.status:
            break
        n += 1
    assert r.status == nv.NV_ERR_INSUFFICIENT_RESOURCES
    assert n == 4096
    assert nv.rm_alloc(ctl, 0, 0, 0, nv.NV01_ROOT_CLIENT).status == nv.NV_ERR_INSUFFICIENT_RESOURCES
    assert nv.rm_free(ctl, t.client, 0, t.device) == (0, nv.NV_OK)
    assert nv.rm_alloc(ctl, 0, 0, 0, nv.NV01_ROOT_CLIENT).status == nv.NV_OK


def test_controls(nvsim_env, ctl):
    t = nv.build_tree(ctl)
    cap = nvsim_env.capacity_kib
    assert nv.alloc_memory(ctl, t.client, t.device, 16 * MIB).status == 0
    e, st, vals = nv.fb_get_info(ctl, t.client, t.subdevice, FB_ALL)
    assert (e, st) == (0, nv.NV_OK)
    assert vals == {nv.FB_RAM_SIZE: cap, nv.FB_TOTAL_RAM_SIZE: cap, nv.FB_HEAP_SIZE: cap,
                    nv.FB_HEAP_FREE: cap - 16 * 1024, nv.FB_USABLE_RAM_SIZE: cap}
    v2 = nv.NV2080_CTRL_CMD_FB_GET_INFO_V2
    p = nv.fb_info_v2_params([nv.FB_HEAP_FREE])
    cases = [
        (nv.rm_control(ctl, t.client, t.subdevice, 0x20801399, p), nv.NV_ERR_NOT_SUPPORTED),
        (nv.rm_control(ctl, t.client, t.device, v2, p), nv.NV_ERR_NOT_SUPPORTED),
        (nv.rm_control(ctl, t.client, t.subdevice, v2, p[:-4]), nv.NV_ERR_INVALID_PARAM_STRUCT),
        (nv.rm_control(ctl, t.client, t.subdevice, v2, None, params_size=1028),
         nv.NV_ERR_INVALID_ARGUMENT),
        (nv.rm_control(ctl, t.client, t.subdevice, v2, None, params_ptr=BAD_PTR,
                       params_size=1028), nv.NV_ERR_INVALID_ADDRESS),
        (nv.rm_control(ctl, t.client, 0x0BAD0BAD, v2, p), nv.NV_ERR_INVALID_OBJECT_HANDLE),
        (nv.rm_control(ctl, 0x0BAD0BAD, t.subdevice, v2, p), nv.NV_ERR_INVALID_CLIENT),
        (nv.rm_control(ctl, t.client, t.subdevice, v2, nv.fb_info_v2_params([])),
         nv.NV_ERR_INVALID_ARGUMENT),
        (nv.rm_control(ctl, t.client, t.subdevice, v2, nv.fb_info_v2_params([0x100])),
         nv.NV_ERR_INVALID_ARGUMENT),
        (nv.rm_control(ctl, t.client, t.subdevice, nv.NV2080_CTRL_CMD_FB_GET_INFO,
                       nv.FB_INFO.pack(1, BAD_PTR)), nv.NV_ERR_INVALID_ADDRESS),
        (nv.rm_control(ctl, t.client, t.subdevice, nv.NV2080_CTRL_CMD_FB_GET_INFO,
                       nv.FB_INFO.pack(129, 0x1000)), nv.NV_ERR_INVALID_ARGUMENT),
    ]
    for i, (r, want) in enumerate(cases):
        assert (i, r[0], r[1]) == (i, 0, want)
    # Channel group scheduling state.
    tsg = nv.rm_alloc(ctl, t.client, t.device, 0, nv.KEPLER_CHANNEL_GROUP_A, None).handle
    get = nv.NVA06C_CTRL_CMD_GET_TIMESLICE
    assert nv.rm_control(ctl, t.client, tsg, get, struct.pack("<Q", 0))[1:] == (
        nv.NV_OK, struct.pack("<Q", 1024))
    assert nv.rm_control(ctl, t.client, tsg, nv.NVA06C_CTRL_CMD_SET_TIMESLICE,
                         struct.pack("<Q", 2000))[1] == nv.NV_OK
    out = nv.rm_control(ctl, t.client, tsg, get, struct.pack("<Q", 0))[2]
    assert out == struct.pack("<Q", 2000)
    assert nv.rm_control(ctl, t.client, tsg, nv.NVA06C_CTRL_CMD_GPFIFO_SCHEDULE,
                         bytes([1, 0, 0]))[1] == nv.NV_OK
    assert nv.rm_control(ctl, t.client, t.subdevice, get, struct.pack("<Q", 0))[1] == (
        nv.NV_ERR_NOT_SUPPORTED)


def test_vid_heap(nvsim_env, ctl):
    t = nv.build_tree(ctl)
    cap = nvsim_env.mem_mib * MIB
    e, st, h, size = nv.vid_heap_alloc(ctl, t.client, t.device, 2 * MIB)
    assert (e, st, size) == (0, nv.NV_OK, 2 * MIB)
    assert h & 0xFFF80000 == 0xCAF00000
    e, st, h2, _ = nv.vid_heap_alloc(ctl, t.client, t.device, MIB, handle=0x5EED0001)
    assert (e, st, h2) == (0, nv.NV_OK, 0x5EED0001)
    e, st, hdr, out = nv.vid_heap(ctl, t.client, t.device, nv.NVOS32_FUNCTION_INFO)
    assert (e, st) == (0, nv.NV_OK)
    assert hdr == {"total": cap, "free": cap - 3 * MIB}
    assert nv.NVOS32_INFO.unpack_from(out)[2] == cap - 3 * MIB
    assert heap_free(ctl, t) == (cap - 3 * MIB) // 1024
    assert nv.vid_heap_free(ctl, t.client, t.device, h) == (0, nv.NV_OK)
    assert nv.vid_heap_free(ctl, t.client, t.device, h) == (0, nv.NV_ERR_INVALID_OBJECT_HANDLE)
    assert nv.vid_heap_alloc(ctl, t.client, t.device, cap)[1] == nv.NV_ERR_NO_MEMORY
    assert nv.vid_heap(ctl, t.client, t.device, 99)[1] == nv.NV_ERR_INVALID_ARGUMENT
    assert nv.vid_heap(ctl, t.client, t.device, nv.NVOS32_FUNCTION_FREE,
                       nv.NVOS32_FREE.pack(0, h2, 0))[1] == nv.NV_ERR_INVALID_FLAGS
    assert nv.vid_heap(ctl, 0x0BAD0BAD, t.device, 5)[1] == nv.NV_ERR_INVALID_CLIENT
    # Memory from the heap is an ordinary object: RM_FREE frees it too.
    assert nv.rm_free(ctl, t.client, t.device, h2) == (0, nv.NV_OK)
    assert heap_free(ctl, t) == cap // 1024
