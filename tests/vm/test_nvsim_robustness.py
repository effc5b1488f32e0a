"""nvsim under hostile input (VM tier): a seeded fuzzer of ioctls near the valid
ones, threads racing allocs, frees, maps and closes, and last (this file sorts
after the other test_nvsim_* files) a kernel log free of WARN, BUG and oops.
NVSIM_FUZZ_SEED and NVSIM_FUZZ_CALLS change the fuzz run.

Straight on /dev/nvsim, with no vgpu: the `nvsim_env`, `fds` and `ctl`
fixtures of tests/vm/conftest.py load nvsim for the module when it is not
loaded (tests/support/nvsim.py).

    scripts/test-vm -k test_nvsim_robustness
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import struct
import threading

import pytest

from tests.support import nvclient as nv
from tests.support.nvsim import BAD_PTR, FB_ALL, KERNEL_PTR, MIB, PAGE, heap_free

pytestmark = pytest.mark.vm

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


def race_step(rng: random.Random, nodes, ctl: int, trees: list, gfds: list[int]) -> None:
    """One random alloc, free, map + mmap, reopen, info query or foreign client."""
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
            return
        g = rng.choice(gfds)
        m = nv.rm_map_memory(ctl, t.client, t.device, r.handle, 0, 2 * PAGE, g)
        if m.status == 0:
            try:
                mm = mmap.mmap(g, 2 * PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError:
                return
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
                race_step(rng, nodes, ctl, trees, gfds)
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

