"""nvsim's memory across files (VM tier): REGISTER_FD and RM_ALLOC_MEMORY on a GPU
file, RM_MAP_MEMORY + mmap sharing real pages (offsets, errors, another
process refused), and RM_DUP_OBJECT (charged once, freed with the last handle).

Straight on /dev/nvsim, with no vgpu: the `nvsim_env`, `fds` and `ctl`
fixtures of tests/vm/conftest.py load nvsim for the module when it is not
loaded (tests/support/nvsim.py).

    scripts/test-vm -k test_nvsim_memory
"""

from __future__ import annotations

import errno
import mmap
import os
import random

import pytest

from tests.support import nvclient as nv
from tests.support.nvsim import MIB, PAGE, heap_free

pytestmark = pytest.mark.vm


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


MAP_SIZE = 16 * PAGE


def tree_with_memory(ctl: int) -> tuple[nv.Tree, int]:
    t = nv.build_tree(ctl)
    return t, nv.alloc_memory(ctl, t.client, t.device, MAP_SIZE).handle


def test_map_at_offsets(ctl, fds):
    t, hm = tree_with_memory(ctl)
    size = MAP_SIZE
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


def test_mmap_needs_the_mapped_range(ctl, fds):
    t, hm = tree_with_memory(ctl)
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


def test_map_errors(nvsim_env, ctl, fds):
    t, hm = tree_with_memory(ctl)
    size = MAP_SIZE
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
