"""nvsim, the simulated NVIDIA driver, exercised directly through /dev/nvsim.

Runs inside the VM tier with the module loaded (nvsim_fixtures.py loads it
when it is missing); from the host:

    scripts/vm-run -- sh -c 'insmod kmod/nvsim/nvsim.ko gpus=2 mem_mib=1024 || exit 2;
        python3 -m pytest -q -p no:cacheprovider tests/vm/test_nvsim.py; rc=$?;
        rmmod nvsim || rc=3; if dmesg | grep -E "WARNING|BUG:|Oops|leaked"; then rc=4; fi;
        exit $rc'

NVSIM_FUZZ_SEED and NVSIM_FUZZ_CALLS change the fuzz run.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import random
import stat
import struct
import subprocess
import threading
from pathlib import Path

import pytest
from nvsim_fixtures import nvclient as nv
from nvsim_fixtures import nvsim_loaded

pytestmark = pytest.mark.vm

MIB = 1 << 20
PAGE = mmap.PAGESIZE
FB_ALL = [nv.FB_RAM_SIZE, nv.FB_TOTAL_RAM_SIZE, nv.FB_HEAP_SIZE, nv.FB_HEAP_FREE,
          nv.FB_USABLE_RAM_SIZE]
BAD_PTR = 0xDEAD000000000000  # non-canonical
KERNEL_PTR = 0xFFFFFFFF81000000
PARAMS = Path("/sys/module/nvsim/parameters")


@pytest.fixture(scope="module")
def nvsim_env():
    yield from nvsim_loaded()


class Fds:
    """Opens files and closes them all at teardown."""

    def __init__(self, nodes: nv.NvNodes):
        self.nodes = nodes
        self.fds: list[int] = []

    def keep(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def ctl(self) -> int:
        return self.keep(self.nodes.open_ctl())

    def gpu(self, i: int = 0) -> int:
        return self.keep(self.nodes.open_gpu(i))

    def close(self, fd: int) -> None:
        self.fds.remove(fd)
        os.close(fd)

    def close_all(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


@pytest.fixture
def fds(nvsim_env):
    f = Fds(nvsim_env.nodes)
    yield f
    f.close_all()


@pytest.fixture
def ctl(fds):
    return fds.ctl()


def fb(ctl: int, tree: nv.Tree) -> dict[int, int]:
    e, st, vals = nv.fb_get_info_v2(ctl, tree.client, tree.subdevice, FB_ALL)
    assert (e, st) == (0, nv.NV_OK)
    return vals


def heap_free(ctl: int, tree: nv.Tree) -> int:
    return fb(ctl, tree)[nv.FB_HEAP_FREE]


# ---- nodes and OS-level escapes ----

def test_nodes(nvsim_env):
    names = ["nvidiactl", "nvidia-uvm"] + [f"nvidia{i}" for i in range(nvsim_env.gpus)]
    majors = set()
    for name in names:
        st = os.stat(nvsim_env.nodes.path(name))
        assert stat.S_ISCHR(st.st_mode), name
        assert stat.S_IMODE(st.st_mode) == 0o666, name
        majors.add(os.major(st.st_rdev))
    assert len(majors) == 1
    assert os.minor(os.stat(nvsim_env.nodes.path("nvidiactl")).st_rdev) == 255
    assert os.minor(os.stat(nvsim_env.nodes.path("nvidia-uvm")).st_rdev) == 254
    for i in range(nvsim_env.gpus):
        assert os.minor(os.stat(nvsim_env.nodes.path(f"nvidia{i}")).st_rdev) == i
    assert not os.path.exists(nvsim_env.nodes.path(f"nvidia{nvsim_env.gpus}"))
    assert nvsim_env.nodes.gpu_count() == nvsim_env.gpus


def test_check_version(ctl, fds):
    assert nv.check_version(ctl) == (0, 1, "595.45.04")
    assert nv.check_version(ctl, b"595.45.04", cmd=0)[:2] == (0, 1)
    assert nv.check_version(ctl, b"595.99", cmd=ord("1"))[:2] == (0, 1)
    # A mismatch is -EINVAL, and the driver's string comes back.
    assert nv.check_version(ctl, b"1.0", cmd=0) == (errno.EINVAL, 1, "595.45.04")
    assert nv.check_version(ctl, xfer=True) == (0, 1, "595.45.04")
    # Only on the control node.
    assert nv.check_version(fds.gpu(0))[0] == errno.EINVAL


def test_card_info(nvsim_env, ctl, fds):
    e, cards = nv.card_info(ctl, 8)
    assert e == 0
    assert [c["minor"] for c in cards] == list(range(nvsim_env.gpus))
    assert all(c["vendor"] == 0x10DE for c in cards)
    assert all(c["fb_size"] == nvsim_env.mem_mib * MIB for c in cards)
    assert len({c["gpu_id"] for c in cards}) == nvsim_env.gpus
    # Too few entries for the GPUs, or not a multiple of 72 B.
    if nvsim_env.gpus > 1:
        assert nv.card_info(ctl, 1)[0] == errno.EINVAL
    assert nv.nv_ioctl(ctl, nv.ESC_CARD_INFO, nv.cbuf(73)) == errno.EINVAL
    assert nv.card_info(fds.gpu(0), 8)[0] == errno.EINVAL


def test_wait_open_complete_and_attach(nvsim_env, ctl, fds):
    b = nv.cbuf(b"\xff" * 8)
    assert nv.nv_ioctl(fds.gpu(0), nv.ESC_WAIT_OPEN_COMPLETE, b) == 0
    assert nv.WAIT_OPEN.unpack(b.raw) == (0, 0)
    _, cards = nv.card_info(ctl, 8)
    ids = b"".join(struct.pack("<I", c["gpu_id"]) for c in cards)
    assert nv.nv_ioctl(ctl, nv.ESC_ATTACH_GPUS_TO_FD, nv.cbuf(ids)) == 0
    assert nv.nv_ioctl(ctl, nv.ESC_ATTACH_GPUS_TO_FD, nv.cbuf(ids)) == errno.EINVAL
    bad = struct.pack("<I", 0x7777)
    assert nv.nv_ioctl(fds.ctl(), nv.ESC_ATTACH_GPUS_TO_FD, nv.cbuf(bad)) == errno.EINVAL


# ---- the object tree ----

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
        (nv.rm_alloc(ctl, c, c, 0, nv.NV01_DEVICE_0, dp + b"\0"), nv.NV_ERR_INVALID_PARAM_STRUCT),
        (nv.rm_alloc(ctl, c, c, 0, nv.NV01_DEVICE_0, None), nv.NV_ERR_INVALID_ARGUMENT),
        (nv.rm_alloc(ctl, c, c, 0, nv.NV01_DEVICE_0, None, params_size=56),
         nv.NV_ERR_INVALID_ARGUMENT),
        (nv.rm_alloc(ctl, c, c, 0, nv.NV01_DEVICE_0, dp, params_size=0),
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
        (nv.rm_alloc(ctl, c, d, 0, nv.NV01_MEMORY_LOCAL_USER, b"\0" * 64),
         nv.NV_ERR_INVALID_PARAM_STRUCT),
        (nv.rm_alloc(ctl, c, s, 0, nv.KEPLER_CHANNEL_GROUP_A, None),
         nv.NV_ERR_INVALID_OBJECT_PARENT),
    ]
    for i, (r, want) in enumerate(cases):
        assert (i, r.errno, r.status) == (i, 0, want)
    # Memory may hang off the subdevice too; the capacity is untouched by failures.
    assert nv.alloc_memory(ctl, c, s, MIB).status == nv.NV_OK
    assert heap_free(ctl, t) == nvsim_env.capacity_kib - 1024


def test_clients_belong_to_their_file(fds):
    a, b = fds.ctl(), fds.ctl()
    t = nv.build_tree(a)
    assert nv.fb_get_info_v2(b, t.client, t.subdevice, FB_ALL)[:2] == (0, nv.NV_ERR_INVALID_CLIENT)
    assert nv.rm_free(b, t.client, 0, t.client) == (0, nv.NV_ERR_INVALID_CLIENT)
    assert nv.alloc_memory(b, t.client, t.device, MIB).status == nv.NV_ERR_INVALID_CLIENT


# ---- sizes, dispatch, XFER ----

def test_exact_sizes(ctl, fds):
    g = fds.gpu(0)
    sizes = {
        nv.ESC_RM_FREE: 16, nv.ESC_RM_CONTROL: 32, nv.ESC_RM_MAP_MEMORY: 56,
        nv.ESC_RM_UNMAP_MEMORY: 32, nv.ESC_RM_VID_HEAP_CONTROL: 184,
        nv.ESC_CHECK_VERSION_STR: 72, nv.ESC_IOCTL_XFER_CMD: 16,
        nv.ESC_WAIT_OPEN_COMPLETE: 8,
    }
    buf = nv.cbuf(1024)
    for nr, size in sizes.items():
        for bad in (0, size - 1, size + 1, size + 8):
            assert nv.nv_ioctl(ctl, nr, buf, size=bad) == errno.EINVAL, (nr, bad)
            assert nv.nv_ioctl(ctl, nr, buf, size=bad, xfer=True) == errno.EINVAL, (nr, bad)
    for bad in (0, 3, 5, 8):
        assert nv.nv_ioctl(g, nv.ESC_REGISTER_FD, buf, size=bad) == errno.EINVAL
    for bad in (0, 24, 31, 33, 40, 47, 49, 56):
        assert nv.nv_ioctl(ctl, nv.ESC_RM_ALLOC, buf, size=bad) == errno.EINVAL, bad
    for bad in (0, 48, 55, 57):
        assert nv.nv_ioctl(g, nv.ESC_RM_ALLOC_MEMORY, buf, size=bad) == errno.EINVAL
    # Unknown escapes, and known escapes on the wrong node.
    for nr in (0x00, 0x20, 0x34, 0x99, 199, 205, 219, 255):
        assert nv.nv_ioctl(ctl, nr, buf, size=16) == errno.EINVAL, nr
    assert nv.nv_ioctl(g, nv.ESC_RM_ALLOC, nv.cbuf(32)) == errno.EINVAL
    assert nv.nv_ioctl(g, nv.ESC_RM_FREE, nv.cbuf(16)) == errno.EINVAL
    assert nv.nv_ioctl(ctl, nv.ESC_RM_ALLOC_MEMORY, nv.cbuf(56)) == errno.EINVAL
    # The command word's type and direction do not matter, only nr and size.
    b = nv.cbuf(nv.RM_API_VERSION.pack(ord("2"), 0, b""))
    cmd = (1 << 30) | (72 << 16) | (ord("Z") << 8) | nv.ESC_CHECK_VERSION_STR
    assert nv.raw_ioctl(ctl, cmd, b) == 0
    # A bad params pointer is -EFAULT.
    assert nv.raw_ioctl(ctl, nv.ioc(nv.ESC_RM_FREE, 16), BAD_PTR) == errno.EFAULT
    assert nv.raw_ioctl(ctl, nv.ioc(nv.ESC_RM_FREE, 16), 0) == errno.EFAULT


def test_xfer(nvsim_env, ctl):
    t = nv.build_tree(ctl, xfer=True)
    r = nv.alloc_memory(ctl, t.client, t.device, 8 * MIB, xfer=True)
    assert (r.errno, r.status) == (0, nv.NV_OK)
    e, st, vals = nv.fb_get_info_v2(ctl, t.client, t.subdevice, [nv.FB_HEAP_FREE], xfer=True)
    assert (e, st, vals) == (0, nv.NV_OK, {nv.FB_HEAP_FREE: nvsim_env.capacity_kib - 8 * 1024})
    assert nv.rm_free(ctl, t.client, t.device, r.handle, xfer=True) == (0, nv.NV_OK)
    # Inner size cap, nesting, bad pointers.
    big = nv.cbuf(nv.XFER_MAX + 8)
    x = nv.cbuf(nv.XFER.pack(nv.ESC_RM_FREE, nv.XFER_MAX + 1, nv.addr(big)))
    assert nv.raw_ioctl(ctl, nv.ioc(nv.ESC_IOCTL_XFER_CMD, 16), x) == errno.EINVAL
    inner = nv.cbuf(nv.XFER.pack(nv.ESC_RM_FREE, 16, nv.addr(big)))
    x = nv.cbuf(nv.XFER.pack(nv.ESC_IOCTL_XFER_CMD, 16, nv.addr(inner)))
    assert nv.raw_ioctl(ctl, nv.ioc(nv.ESC_IOCTL_XFER_CMD, 16), x) == errno.EINVAL
    x = nv.cbuf(nv.XFER.pack(nv.ESC_RM_FREE, 16, BAD_PTR))
    assert nv.raw_ioctl(ctl, nv.ioc(nv.ESC_IOCTL_XFER_CMD, 16), x) == errno.EFAULT
    x = nv.cbuf(nv.XFER.pack(0x12B, 32, nv.addr(big)))  # only the exact cmd counts
    assert nv.raw_ioctl(ctl, nv.ioc(nv.ESC_IOCTL_XFER_CMD, 16), x) == errno.EINVAL
    assert nv.raw_ioctl(ctl, nv.ioc(nv.ESC_IOCTL_XFER_CMD, 16), BAD_PTR) == errno.EFAULT


# ---- capacity ----

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


# ---- controls ----

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
    assert nv.vid_heap(ctl, t.client, t.device, 99)[1] == nv.NV_ERR_INVALID_FUNCTION
    assert nv.vid_heap(ctl, t.client, t.device, nv.NVOS32_FUNCTION_FREE,
                       nv.NVOS32_FREE.pack(0, h2, 0))[1] == nv.NV_ERR_INVALID_FLAGS
    assert nv.vid_heap(ctl, 0x0BAD0BAD, t.device, 5)[1] == nv.NV_ERR_INVALID_CLIENT
    # Memory from the heap is an ordinary object: RM_FREE frees it too.
    assert nv.rm_free(ctl, t.client, t.device, h2) == (0, nv.NV_OK)
    assert heap_free(ctl, t) == cap // 1024


# ---- REGISTER_FD, RM_ALLOC_MEMORY ----

def test_register_fd(nvsim_env, ctl, fds):
    g = fds.gpu(0)
    with open("/dev/null", "rb") as null:
        assert nv.register_fd(g, null.fileno()) == errno.EINVAL
    other_gpu = fds.gpu(nvsim_env.gpus - 1)
    assert nv.register_fd(g, other_gpu) == errno.EINVAL  # not a control file
    assert nv.register_fd(g, 9999) == errno.EINVAL
    assert nv.register_fd(g, -1) == errno.EINVAL
    assert nv.register_fd(ctl, ctl) == errno.EINVAL  # self
    assert nv.register_fd(g, ctl) == 0
    assert nv.register_fd(g, ctl) == errno.EINVAL  # once per file
    assert nv.register_fd(fds.gpu(0), ctl, xfer=True) == 0
    # A control file that is itself linked cannot be a target.
    ctl2 = fds.ctl()
    assert nv.register_fd(ctl2, ctl) == 0
    assert nv.register_fd(fds.gpu(0), ctl2) == errno.EINVAL
    # The link survives closing the ctl fd number: the file is held.
    g2 = fds.gpu(0)
    ctl3 = nvsim_env.nodes.open_ctl()
    t = nv.build_tree(ctl3)
    assert nv.register_fd(g2, ctl3) == 0
    os.close(ctl3)
    r = nv.rm_alloc_memory(g2, t.client, t.device, 0, nv.NV01_MEMORY_SYSTEM, 8192)
    assert r[:2] == (0, nv.NV_OK)


def test_rm_alloc_memory(nvsim_env, ctl, fds):
    t = nv.build_tree(ctl)
    g = fds.gpu(0)
    # Not registered: the clients of ctl are not reachable.
    r = nv.rm_alloc_memory(g, t.client, t.device, 0, nv.NV01_MEMORY_SYSTEM, 8192)
    assert r[:2] == (0, nv.NV_ERR_INVALID_CLIENT)
    assert nv.register_fd(g, ctl) == 0
    e, st, h, pmem = nv.rm_alloc_memory(g, t.client, t.device, 0x5A5A0001,
                                        nv.NV01_MEMORY_SYSTEM, 8192)
    assert (e, st, h) == (0, nv.NV_OK, 0x5A5A0001)
    assert pmem != 0
    assert heap_free(ctl, t) == nvsim_env.capacity_kib  # system memory is not charged
    e, st, h2, _ = nv.rm_alloc_memory(g, t.client, t.device, 0, nv.NV01_MEMORY_LOCAL_USER, MIB)
    assert (e, st) == (0, nv.NV_OK)
    assert heap_free(ctl, t) == nvsim_env.capacity_kib - 1024
    assert nv.rm_alloc_memory(g, t.client, t.device, 0, 0x1234, 8192)[1] == nv.NV_ERR_INVALID_CLASS
    assert nv.rm_free(ctl, t.client, t.device, h2) == (0, nv.NV_OK)
    assert nv.rm_free(ctl, t.client, t.device, h) == (0, nv.NV_OK)


# ---- RM_MAP_MEMORY + mmap ----

def test_map_shares_real_pages(nvsim_env, ctl, fds):
    t = nv.build_tree(ctl)
    size = 64 * 1024
    hm = nv.alloc_memory(ctl, t.client, t.device, size).handle
    ga, gb = fds.gpu(0), fds.gpu(0)
    assert nv.register_fd(ga, ctl) == 0
    assert nv.register_fd(gb, ctl) == 0
    ra, ma = nv.map_and_mmap(ctl, ga, t.client, t.device, hm, size)
    rb, mb = nv.map_and_mmap(ctl, gb, t.client, t.subdevice, hm, size)
    assert ra.address == rb.address != 0
    assert ma[:16] == bytes(16)  # fresh memory is zeroed
    pattern = bytes(random.Random(1).randrange(256) for _ in range(size))
    ma[:] = pattern
    assert mb[:] == pattern
    mb[100:104] = b"nvsm"
    assert ma[100:104] == b"nvsm"

    # One mapping context per file: a second map through ga is refused.
    r = nv.rm_map_memory(ctl, t.client, t.device, hm, 0, size, ga)
    assert (r.errno, r.status) == (0, nv.NV_ERR_STATE_IN_USE)
    # The pages outlive the object while mapped.
    assert nv.rm_free(ctl, t.client, t.device, hm) == (0, nv.NV_OK)
    ma[0:4] = b"live"
    assert mb[0:4] == b"live"
    ma.close()
    assert mb[0:4] == b"live"
    mb.close()


def test_map_offsets_and_errors(nvsim_env, ctl, fds):
    t = nv.build_tree(ctl)
    size = 16 * PAGE
    hm = nv.alloc_memory(ctl, t.client, t.device, size).handle
    ga = fds.gpu(0)
    _, whole = nv.map_and_mmap(ctl, ga, t.client, t.device, hm, size)
    whole[5 * PAGE:5 * PAGE + 5] = b"fifth"
    # A sub-range at an offset maps the same pages, mmap offset still 0.
    gb = fds.gpu(0)
    r, part = nv.map_and_mmap(ctl, gb, t.client, t.device, hm, 2 * PAGE, offset=5 * PAGE)
    assert part[0:5] == b"fifth"
    part[PAGE:PAGE + 3] = b"six"
    assert whole[6 * PAGE:6 * PAGE + 3] == b"six"
    assert nv.rm_unmap_memory(ctl, t.client, t.device, hm, r.address) == (0, nv.NV_OK)
    assert nv.rm_unmap_memory(ctl, t.client, t.device, hm, r.address) == (
        0, nv.NV_ERR_INVALID_ARGUMENT)
    part.close()
    whole.close()

    gc = fds.gpu(0)
    # mmap needs a context, offset 0, the mapped length, MAP_SHARED.
    with pytest.raises(OSError) as ex:
        mmap.mmap(gc, PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    assert ex.value.errno == errno.EINVAL
    assert nv.rm_map_memory(ctl, t.client, t.device, hm, 0, 4 * PAGE, gc).status == nv.NV_OK
    for length, off, flags, want in ((PAGE, 0, mmap.MAP_SHARED, errno.ENXIO),
                                     (8 * PAGE, 0, mmap.MAP_SHARED, errno.ENXIO),
                                     (4 * PAGE, PAGE, mmap.MAP_SHARED, errno.EINVAL),
                                     (4 * PAGE, 0, mmap.MAP_PRIVATE, errno.EINVAL)):
        with pytest.raises(OSError) as ex:
            mmap.mmap(gc, length, flags, mmap.PROT_READ | mmap.PROT_WRITE, offset=off)
        assert ex.value.errno == want, (length, off, flags)
    mmap.mmap(gc, 4 * PAGE, mmap.MAP_SHARED, mmap.PROT_READ).close()
    # Control node and uvm cannot be mapped.
    with pytest.raises(OSError):
        mmap.mmap(ctl, PAGE, mmap.MAP_SHARED, mmap.PROT_READ)

    gd = fds.gpu(0)
    other = fds.gpu(nvsim_env.gpus - 1)
    with open("/dev/null", "rb") as null:
        cases = [
            (nv.rm_map_memory(ctl, t.client, t.device, hm, 0, PAGE, null.fileno()),
             nv.NV_ERR_INVALID_ARGUMENT),
            (nv.rm_map_memory(ctl, t.client, t.device, hm, 0, PAGE, ctl),
             nv.NV_ERR_INVALID_ARGUMENT),
            (nv.rm_map_memory(ctl, t.client, t.device, hm, 0, PAGE, 9999),
             nv.NV_ERR_INVALID_ARGUMENT),
            (nv.rm_map_memory(ctl, t.client, t.device, hm, 0, 0, gd), nv.NV_ERR_INVALID_LIMIT),
            (nv.rm_map_memory(ctl, t.client, t.device, hm, size, PAGE, gd),
             nv.NV_ERR_INVALID_LIMIT),
            (nv.rm_map_memory(ctl, t.client, t.device, hm, PAGE, size, gd),
             nv.NV_ERR_INVALID_LIMIT),
            (nv.rm_map_memory(ctl, t.client, t.device, 0x0BAD0BAD, 0, PAGE, gd),
             nv.NV_ERR_INVALID_OBJECT_HANDLE),
            (nv.rm_map_memory(ctl, t.client, t.device, t.subdevice, 0, PAGE, gd),
             nv.NV_ERR_INVALID_OBJECT_HANDLE),
            (nv.rm_map_memory(ctl, 0x0BAD0BAD, t.device, hm, 0, PAGE, gd),
             nv.NV_ERR_INVALID_CLIENT),
        ]
        if nvsim_env.gpus > 1:
            cases.append((nv.rm_map_memory(ctl, t.client, t.device, hm, 0, PAGE, other),
                          nv.NV_ERR_INVALID_ARGUMENT))
    for i, (r, want) in enumerate(cases):
        assert (i, r.errno, r.status) == (i, 0, want)
    assert nv.rm_map_memory(ctl, t.client, t.device, hm, 0, PAGE, gd).status == nv.NV_OK


def test_map_from_another_process_is_refused(ctl, fds):
    """RM clients are tied to the process that made them (rm_create_mmap_context)."""
    t = nv.build_tree(ctl)
    hm = nv.alloc_memory(ctl, t.client, t.device, PAGE).handle
    g = fds.gpu(0)
    pid = os.fork()
    if pid == 0:
        r = nv.rm_map_memory(ctl, t.client, t.device, hm, 0, PAGE, g)
        os._exit(0 if (r.errno, r.status) == (0, nv.NV_ERR_INVALID_CLIENT) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# ---- nvidia-uvm ----

def test_uvm(nvsim_env):
    u = nvsim_env.nodes.open_uvm()
    try:
        assert nv.uvm_initialize(u, 0) == (0, nv.NV_OK)
        assert nv.uvm_initialize(u, 0) == (0, nv.NV_OK)
        assert nv.uvm_initialize(u, 1) == (0, nv.NV_ERR_INVALID_ARGUMENT)
        assert nv.raw_ioctl(u, 0x30000002, nv.cbuf(16)) == errno.EINVAL
        assert nv.raw_ioctl(u, nv.ioc(nv.ESC_RM_ALLOC, 32), nv.cbuf(32)) == errno.EINVAL
        assert nv.raw_ioctl(u, nv.UVM_INITIALIZE, BAD_PTR) == errno.EFAULT
    finally:
        os.close(u)


def test_uvm_mmap(nvsim_env):
    """nvidia-uvm maps zeroed pages of its own per mapping, MAP_SHARED only."""
    u = nvsim_env.nodes.open_uvm()
    try:
        rw = mmap.PROT_READ | mmap.PROT_WRITE
        a = mmap.mmap(u, 4 * PAGE, mmap.MAP_SHARED, rw)
        b = mmap.mmap(u, PAGE, mmap.MAP_SHARED, rw, offset=PAGE)
        assert a[:] == bytes(4 * PAGE) and b[:] == bytes(PAGE)
        a[PAGE:PAGE + 3] = b"uvm"
        assert b[:3] == bytes(3)  # not shared between mappings
        pid = os.fork()
        if pid == 0:  # the child's copy shares the pages
            a[0:5] = b"child"
            os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert a[0:5] == b"child" and a[PAGE:PAGE + 3] == b"uvm"
        a.close()
        b.close()
        with pytest.raises(OSError) as ex:
            mmap.mmap(u, PAGE, mmap.MAP_PRIVATE, rw)
        assert ex.value.errno == errno.EINVAL
        backing = int((PARAMS / "backing_mib").read_text()) * MIB
        with pytest.raises(OSError) as ex:
            mmap.mmap(u, backing + PAGE, mmap.MAP_SHARED, rw)
        assert ex.value.errno == errno.ENOMEM
        ctl = nvsim_env.nodes.open_ctl()
        try:
            with pytest.raises(OSError) as ex:
                mmap.mmap(ctl, PAGE, mmap.MAP_SHARED, rw)
            assert ex.value.errno == errno.ENODEV
        finally:
            os.close(ctl)
    finally:
        os.close(u)


def test_rm_calls_counter(nvsim_env, ctl):
    first = nv.rm_calls()
    nv.check_version(ctl)
    assert nv.rm_calls() == first + 1
    assert nv.raw_ioctl(ctl, nv.ioc(0x99, 8), nv.cbuf(8)) == errno.EINVAL  # refused, counted
    assert nv.rm_calls() == first + 2
    with pytest.raises(OSError):
        (PARAMS / "rm_calls").write_text("0")


# ---- RM_DUP_OBJECT ----

def test_dup_object_shares_memory(nvsim_env, ctl, fds):
    t = nv.build_tree(ctl)
    part = 64 * MIB
    free0 = heap_free(ctl, t)
    hm = nv.alloc_memory(ctl, t.client, t.device, part).handle
    assert heap_free(ctl, t) == free0 - part // 1024
    e, st, h2 = nv.rm_dup_object(ctl, t.client, t.device, 0, t.client, hm)
    assert (e, st) == (0, nv.NV_OK) and h2 not in (0, hm)
    assert heap_free(ctl, t) == free0 - part // 1024  # charged once
    # A chosen handle, from another client of the same file, under the subdevice.
    c2 = nv.alloc_client(ctl)
    d2 = nv.alloc_device(ctl, c2, 0)
    assert nv.rm_dup_object(ctl, c2, d2, 0x1234, t.client, h2) == (0, nv.NV_OK, 0x1234)
    assert nv.rm_dup_object(ctl, t.client, t.subdevice, 0x77, t.client, hm)[:2] == (0, 0)
    assert heap_free(ctl, t) == free0 - part // 1024
    # Errors.
    bad = [
        ((t.client, t.device, 0x1234, t.client, hm, 0), nv.NV_OK),  # ok: other client's name
        ((c2, d2, 0x1234, t.client, hm, 0), nv.NV_ERR_INSERT_DUPLICATE_NAME),
        ((t.client, t.device, 0, t.client, 0xBAD, 0), nv.NV_ERR_INVALID_OBJECT_HANDLE),
        ((t.client, t.device, 0, 0xC1D0BAD0, hm, 0), nv.NV_ERR_INVALID_CLIENT),
        ((0xC1D0BAD0, t.device, 0, t.client, hm, 0), nv.NV_ERR_INVALID_CLIENT),
        ((t.client, t.client, 0, t.client, hm, 0), nv.NV_ERR_INVALID_OBJECT_PARENT),
        ((t.client, 0xBAD, 0, t.client, hm, 0), nv.NV_ERR_INVALID_OBJECT_PARENT),
        ((t.client, t.device, 0, t.client, t.subdevice, 0), nv.NV_ERR_NOT_SUPPORTED),
        ((t.client, t.device, 0, t.client, hm, 2), nv.NV_ERR_INVALID_FLAGS),
    ]
    for args, want in bad:
        assert nv.rm_dup_object(ctl, *args)[:2] == (0, want), args
    if nvsim_env.gpus > 1:
        t1 = nv.build_tree(ctl, device_id=1)
        r = nv.rm_dup_object(ctl, t1.client, t1.device, 0, t.client, hm)
        assert r[:2] == (0, nv.NV_ERR_INVALID_ARGUMENT)
    # Another file's clients are not reachable.
    other = fds.ctl()
    t3 = nv.build_tree(other)
    assert nv.rm_dup_object(other, t3.client, t3.device, 0, t.client, hm)[:2] == \
        (0, nv.NV_ERR_INVALID_CLIENT)
    # Wrong size, and XFER.
    assert nv.raw_ioctl(ctl, nv.ioc(nv.ESC_RM_DUP_OBJECT, 32), nv.cbuf(32)) == errno.EINVAL
    e, st, h5 = nv.rm_dup_object(ctl, t.client, t.device, 0, t.client, hm, xfer=True)
    assert (e, st) == (0, nv.NV_OK)
    # Handles go one by one: the memory stays until the last, whichever it is.
    handles = [(t.client, t.device, hm), (c2, d2, 0x1234), (t.client, t.device, h2),
               (t.client, t.subdevice, 0x77), (t.client, t.device, 0x1234)]
    for hc, hp, h in handles:
        assert nv.rm_free(ctl, hc, hp, h) == (0, nv.NV_OK)
        assert heap_free(ctl, t) == free0 - part // 1024
    assert nv.rm_free(ctl, t.client, t.device, h5) == (0, nv.NV_OK)
    assert heap_free(ctl, t) == free0
    assert nv.rm_free(ctl, t.client, t.device, hm) == (0, nv.NV_ERR_INVALID_OBJECT_HANDLE)


def test_dup_object_maps_same_pages(nvsim_env, ctl, fds):
    t = nv.build_tree(ctl)
    size = 16 * 1024
    hm = nv.alloc_memory(ctl, t.client, t.device, size).handle
    e, st, hd = nv.rm_dup_object(ctl, t.client, t.device, 0, t.client, hm)
    assert (e, st) == (0, nv.NV_OK)
    ga, gb = fds.gpu(0), fds.gpu(0)
    assert nv.register_fd(ga, ctl) == 0 and nv.register_fd(gb, ctl) == 0
    ra, ma = nv.map_and_mmap(ctl, ga, t.client, t.device, hm, size)
    rb, mb = nv.map_and_mmap(ctl, gb, t.client, t.device, hd, size)
    assert ra.address == rb.address
    ma[:4] = b"dup!"
    assert mb[:4] == b"dup!"
    # Freeing the original keeps the memory for the duplicate; a client free
    # (both handles at once) releases it once.
    free = heap_free(ctl, t)
    assert nv.rm_free(ctl, t.client, t.device, hm) == (0, nv.NV_OK)
    assert heap_free(ctl, t) == free
    assert mb[:4] == b"dup!"
    ma.close()
    mb.close()
    hm2 = nv.alloc_memory(ctl, t.client, t.device, size).handle
    assert nv.rm_dup_object(ctl, t.client, t.device, 0, t.client, hm2)[:2] == (0, 0)
    assert nv.rm_free(ctl, t.client, 0, t.client) == (0, nv.NV_OK)
    t2 = nv.build_tree(ctl)
    assert heap_free(ctl, t2) == nvsim_env.capacity_kib


# ---- robustness ----

ESCAPES = [0x27, 0x29, 0x2A, 0x2B, 0x34, 0x4A, 0x4E, 0x4F, 200, 201, 210, 211, 212, 218]
SIZES = {0x27: 56, 0x29: 16, 0x2A: 32, 0x2B: 32, 0x34: 28, 0x4A: 184, 0x4E: 56, 0x4F: 32,
         200: 72, 201: 4, 210: 72, 211: 16, 212: 4, 218: 8}
CLASSES = [0x0, 0x1, 0x41, 0x3E, 0x3F, 0x40, 0x80, 0x2080, 0x50A0, 0x90F1, 0xA06C, 0x1234]
CONTROLS = [0x20801301, 0x20801303, 0xA06C0101, 0xA06C0103, 0xA06C0104, 0x20800101]


class Fuzzer:
    """Random ioctls, mostly near the valid ones so that they reach deep states.

    Pointers are NULL, unmapped, kernel, or into a scratch buffer this
    process does not use otherwise (the driver writes through them)."""

    def __init__(self, nodes: nv.NvNodes, gpus: int, seed: int):
        self.rng = random.Random(seed)
        self.nodes = nodes
        self.gpus = gpus
        self.scratch = ctypes.create_string_buffer(64 * 1024)
        self.arg = ctypes.create_string_buffer(nv.XFER_MAX + 64)
        self.xfer = ctypes.create_string_buffer(16)
        self.handles = [0, 0x0BAD0BAD]
        self.mems: list[tuple[int, int, int]] = []
        self.fds: list[int] = []
        self.maps: list[mmap.mmap] = []
        self.calls = 0
        self.allocs_ok = 0
        self.maps_ok = 0

    def reopen(self):
        for fd in self.fds:
            os.close(fd)
        self.fds = [self.nodes.open_ctl(), self.nodes.open_ctl(), self.nodes.open_uvm()]
        self.fds += [self.nodes.open_gpu(i) for i in range(self.gpus)]
        self.fds += [self.nodes.open_gpu(self.rng.randrange(self.gpus)) for _ in range(6)]

    def ptr(self) -> int:
        r = self.rng.random()
        if r < 0.5:
            return nv.addr(self.scratch) + self.rng.randrange(0, 60 * 1024, 8)
        return self.rng.choice([0, BAD_PTR, KERNEL_PTR, 0x1000, 0xFFFFFFFFFFFFF000,
                                self.rng.getrandbits(64)])

    def handle(self) -> int:
        if self.rng.random() < 0.9:
            return self.rng.choice(self.handles)
        return self.rng.getrandbits(32)

    def fd(self) -> int:
        return self.rng.choice(self.fds) if self.rng.random() < 0.8 else self.rng.randrange(-2, 64)

    def params(self, nr: int) -> bytes:
        """Plausible params for nr, with random fields."""
        rng = self.rng
        h = self.handle
        if nr == 0x2B:
            hclass = rng.choice(CLASSES)
            psize = rng.choice([0, 4, 20, 56, 128, rng.randrange(0, 70000)])
            return nv.NVOS21.pack(h(), h(), rng.choice([0, h(), rng.getrandbits(32)]),
                                  hclass, self.ptr(), psize, 0)
        if nr == 0x34:
            if self.mems and rng.random() < 0.6:
                c, d, m = rng.choice(self.mems)
                return nv.NVOS55.pack(c, d, rng.choice([0, h()]), c, m, rng.choice([0, 1, 2]), 0)
            return nv.NVOS55.pack(h(), h(), h(), h(), h(), rng.choice([0, rng.getrandbits(32)]), 0)
        if nr == 0x29:
            return nv.NVOS00.pack(h(), h(), h(), 0)
        if nr == 0x2A:
            psize = rng.choice([0, 3, 8, 16, 1028, rng.randrange(0, 70000)])
            return nv.NVOS54.pack(h(), h(), rng.choice(CONTROLS), 0, self.ptr(), psize, 0)
        if nr == 0x4E and self.mems and rng.random() < 0.5:
            c, d, m = rng.choice(self.mems)
            return nv.NVOS33_FD.pack(c, d, m, rng.choice([0, PAGE]), rng.choice([PAGE, 2 * PAGE]),
                                     0, 0, 0, self.fd())
        if nr == 0x4E:
            return nv.NVOS33_FD.pack(h(), h(), h(), rng.choice([0, PAGE, rng.getrandbits(64)]),
                                     rng.choice([PAGE, 2 * PAGE, 0, rng.getrandbits(64)]),
                                     0, 0, 0, self.fd())
        if nr == 0x4F:
            return nv.NVOS34.pack(h(), h(), h(), rng.getrandbits(64), 0, 0)
        if nr == 0x27:
            return nv.NVOS02_FD.pack(h(), h(), rng.choice([0, h()]),
                                     rng.choice([0x3E, 0x40, 0x3F, 0x1234]), 0, 0,
                                     rng.choice([PAGE - 1, rng.getrandbits(64)]), 0, self.fd())
        if nr == 0x4A:
            head = nv.NVOS32_HEAD.pack(h(), h(), rng.choice([2, 3, 5, 6, 99]), 0, 0, 0, 0, 0)
            data = nv.NVOS32_ALLOC.pack(0, h(), 0, rng.choice([0, 0x4000, 0x80000]),
                                        0, 0, 0, 0, 0, 0, 0,
                                        rng.choice([PAGE, MIB, rng.getrandbits(64)]),
                                        0, 0, 0, 0, 0, 0, 0, 0, 0)
            return (head + data).ljust(184, b"\0")
        if nr == 201:
            return struct.pack("<i", self.fd())
        if nr == 210:
            return nv.RM_API_VERSION.pack(rng.choice([0, 0x31, 0x32, 7]), 0, b"595.45.04")
        return rng.randbytes(SIZES.get(nr, 16))

    def fill_scratch(self):
        """Valid-looking alloc/control params at the start of scratch."""
        rng = self.rng
        kind = rng.randrange(4)
        if kind == 0:
            blob = nv.device_params(rng.randrange(self.gpus + 1))
        elif kind == 1:
            blob = nv.memory_params(rng.choice([PAGE, MIB, 64 * MIB, rng.getrandbits(40)]))
        elif kind == 2:
            blob = nv.fb_info_v2_params([rng.randrange(0x40) for _ in range(rng.randrange(1, 9))])
        else:
            blob = rng.randbytes(rng.randrange(1, 1100))
        ctypes.memmove(self.scratch, blob, len(blob))

    def one(self):
        rng = self.rng
        fd = rng.choice(self.fds)
        r = rng.random()
        if r < 0.6:
            nr = rng.choice(ESCAPES)
            blob = self.params(nr)
            size = len(blob) if rng.random() < 0.85 else rng.randrange(0, 300)
        elif r < 0.85:
            nr = rng.randrange(256)
            size = rng.randrange(0, 1 << 14)
            blob = rng.randbytes(min(size, 512))
        else:
            nr = rng.choice(ESCAPES)
            size = rng.randrange(0, 1 << 14)
            blob = rng.randbytes(min(size, 512))
        if nr < 200 and rng.random() < 0.6:
            fd = self.fds[0]  # the control file that owns the live trees
        if rng.random() < 0.3:
            self.fill_scratch()
        ctypes.memmove(self.arg, blob, len(blob))
        if rng.random() < 0.25:
            # Wrapped in XFER: sometimes a bad size or pointer.
            isize = size if rng.random() < 0.8 else rng.choice([0, 16385, rng.getrandbits(32)])
            iptr = nv.addr(self.arg) if rng.random() < 0.9 else self.ptr()
            ctypes.memmove(self.xfer, nv.XFER.pack(nr, isize, iptr), 16)
            cmd, arg = nv.ioc(211, 16), self.xfer
        elif rng.random() < 0.05:
            cmd, arg = rng.getrandbits(32), rng.choice([self.arg, 0, BAD_PTR])
        else:
            cmd = nv.ioc(nr, size) | (rng.randrange(4) << 30)
            arg = self.arg if rng.random() < 0.95 else rng.choice([0, BAD_PTR, KERNEL_PTR])
        nv.raw_ioctl(fd, cmd, arg)
        self.calls += 1
        self.learn(nr, blob)

    def learn(self, nr: int, blob: bytes):
        """Remember handles the driver returned, to reach deeper states."""
        if nr == 0x2B and len(blob) == 32:
            st = struct.unpack_from("<I", self.arg, 28)[0]
            h = struct.unpack_from("<I", self.arg, 8)[0]
            if st == 0 and h:
                self.allocs_ok += 1
                if len(self.handles) < 200:
                    self.handles.append(h)
        if nr == 0x4E and len(blob) == 56:
            st = struct.unpack_from("<I", self.arg, 40)[0]
            if st == 0:
                fdn = struct.unpack_from("<i", self.arg, 48)[0]
                length = struct.unpack_from("<Q", self.arg, 24)[0]
                off = struct.unpack_from("<Q", self.arg, 16)[0]
                pages = (off % PAGE + length + PAGE - 1) // PAGE
                if fdn in self.fds and pages * PAGE <= 16 * MIB:
                    try:
                        m = mmap.mmap(fdn, pages * PAGE, mmap.MAP_SHARED,
                                      mmap.PROT_READ | mmap.PROT_WRITE)
                    except OSError:
                        return
                    m[0:1] = b"x"
                    self.maps.append(m)
                    self.maps_ok += 1

    def structured(self):
        """A valid tree on each GPU, so that random calls hit live objects."""
        ctl = self.fds[0]
        for g in range(self.gpus):
            try:
                t = nv.build_tree(ctl, device_id=g)
            except nv.NvError:
                return
            self.handles += [t.client, t.device, t.subdevice]
            r = nv.alloc_memory(ctl, t.client, t.device, 2 * PAGE)
            if r.status == 0:
                self.handles.append(r.handle)
                self.mems.append((t.client, t.device, r.handle))

    def run(self, n: int):
        self.reopen()
        self.structured()
        for i in range(n):
            if i % 1500 == 1499:
                for m in self.maps:
                    m.close()
                self.maps.clear()
                self.handles = [0, 0x0BAD0BAD]
                self.mems.clear()
                self.reopen()
                self.structured()
            elif i % 200 == 199:
                # Random frees kill trees fast: grow new ones.
                del self.handles[2:-100]
                del self.mems[:-8]
                self.structured()
            self.one()
        for m in self.maps:
            m.close()
        self.maps.clear()
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def test_fuzz(nvsim_env, ctl):
    seed = int(os.environ.get("NVSIM_FUZZ_SEED", "20261129"))
    n = int(os.environ.get("NVSIM_FUZZ_CALLS", "12000"))
    f = Fuzzer(nvsim_env.nodes, nvsim_env.gpus, seed)
    f.run(n)
    assert f.calls == n
    print(f"fuzz: {n} calls, {f.allocs_ok} allocations, {f.maps_ok} mmaps")
    assert f.allocs_ok > 100
    assert f.maps_ok > 0
    # Everything the fuzzer made went away with its files.
    for g in range(nvsim_env.gpus):
        t = nv.build_tree(ctl, device_id=g)
        assert heap_free(ctl, t) == nvsim_env.capacity_kib


def test_concurrent_races(nvsim_env):
    """Threads racing allocs, frees, maps, mmaps and closes on shared files."""
    nodes = nvsim_env.nodes
    ctl = nodes.open_ctl()
    trees = [nv.build_tree(ctl, device_id=g % nvsim_env.gpus) for g in range(4)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        gfds = [nodes.open_gpu(0)]
        try:
            for _ in range(800):
                t = rng.choice(trees)
                op = rng.randrange(6)
                if op == 0:
                    nv.alloc_memory(ctl, t.client, t.device, rng.choice([PAGE, MIB]))
                elif op == 1:
                    r = nv.alloc_memory(ctl, t.client, t.device, 4 * PAGE)
                    if r.status == 0 and rng.random() < 0.7:
                        nv.rm_free(ctl, t.client, t.device, r.handle)
                elif op == 2:
                    r = nv.alloc_memory(ctl, t.client, t.device, 2 * PAGE)
                    if r.status:
                        continue
                    g = rng.choice(gfds)
                    m = nv.rm_map_memory(ctl, t.client, t.device, r.handle, 0, 2 * PAGE, g)
                    if m.status == 0:
                        try:
                            mm = mmap.mmap(g, 2 * PAGE, mmap.MAP_SHARED,
                                           mmap.PROT_READ | mmap.PROT_WRITE)
                        except OSError:
                            continue
                        nv.rm_free(ctl, t.client, t.device, r.handle)
                        mm[PAGE:PAGE + 2] = b"ok"
                        mm.close()
                elif op == 3:
                    os.close(gfds.pop(rng.randrange(len(gfds))))
                    gfds.append(nodes.open_gpu(0))
                    nv.register_fd(gfds[-1], ctl)
                elif op == 4:
                    nv.fb_get_info_v2(ctl, t.client, t.subdevice, FB_ALL)
                else:
                    other = nodes.open_ctl()
                    tt = nv.build_tree(other)
                    nv.alloc_memory(other, tt.client, tt.device, MIB)
                    os.close(other)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
        finally:
            for fd in gfds:
                os.close(fd)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    for t in trees:
        assert nv.rm_free(ctl, t.client, 0, t.client) == (0, nv.NV_OK)
    t = nv.build_tree(ctl)
    assert heap_free(ctl, t) == nvsim_env.capacity_kib
    os.close(ctl)


def test_zz_kernel_log_clean():
    """No WARN, BUG or oops from any test above (panic_on_warn would also stop the VM)."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"dmesg unavailable: {e}")
    bad = [line for line in log.splitlines()
           if any(k in line for k in ("WARNING:", "BUG:", "Oops", "general protection",
                                      "leaked"))]
    assert bad == []
