"""nvsim's nodes and the escapes that are not RM calls (VM tier): the device nodes,
CHECK_VERSION_STR, CARD_INFO, WAIT_OPEN_COMPLETE and ATTACH_GPUS_TO_FD, exact
ioctl sizes, IOCTL_XFER_CMD, nvidia-uvm and its mmap, and the rm_calls counter.

Straight on /dev/nvsim, with no vgpu: the `nvsim_env`, `fds` and `ctl`
fixtures of tests/vm/conftest.py load nvsim for the module when it is not
loaded (tests/support/nvsim.py).

    scripts/test-vm -k test_nvsim_nodes
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct

import pytest

from tests.support import nvclient as nv
from tests.support.nvsim import BAD_PTR, MIB, PAGE, PARAMS

pytestmark = pytest.mark.vm


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
