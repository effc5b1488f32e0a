"""Synthetic nvtrace traces: a program's calls and a small driver's answers.

``Synth`` writes the records libnvtrace.so would write for a program making
these calls against a driver that answers like the real one (handles it
chooses, statuses, sizes written back). ``cuda_like()`` is a plausible CUDA
start-up and allocation sequence; tests change one answer at a time to see
the replay check fail.
"""

from __future__ import annotations

import io
import itertools
import struct

from tools.nvtrace.fmt import Block, Header, Kind, Meta, OpenHow, Tag, TraceWriter, parse
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import Ctrl, Escape, NvClass, UvmCmd, VidHeapFunction, iowr

MIB, GIB = 1 << 20, 1 << 30
XFER = struct.Struct("=IIQ")


class Synth:
    def __init__(self, pid: int = 4242, comm: str = "synth") -> None:
        self.out = io.BytesIO()
        meta = ((Meta.DRIVER, "NVRM version: synthetic"), (Meta.GPU, "Synthetic GPU"),
                (Meta.COMM, comm), (Meta.CMDLINE, f"{comm}\0--test"))
        self.w = TraceWriter(self.out, Header(pid, meta=meta))
        self._addr = itertools.count(0x7F0000000000, 0x10000)
        self._fd = itertools.count(3)
        self._client = itertools.count(0xC1D00001)
        self._handle = itertools.count(0x5C000001)

    def trace_bytes(self) -> bytes:
        return self.out.getvalue()

    def trace(self, name: str = "synth-4242.nvtrace"):
        return parse(self.trace_bytes(), name)

    # --- records ---

    def open(self, path: str, how: OpenHow = OpenHow.CALL, old: int = -1) -> int:
        fd = next(self._fd)
        raw = path.encode()
        self.w.write(Kind.OPEN, fd, ret=fd, args=(2, 0, how, old & (2**64 - 1)),
                     blocks=[Block(Tag.PATH, False, 0, len(raw), raw)])
        return fd

    def close(self, fd: int) -> None:
        self.w.write(Kind.CLOSE, fd)

    def mmap(self, fd: int, length: int, offset: int = 0, ok: bool = True) -> None:
        self.w.write(Kind.MMAP, fd, ret=0x7E0000000000 if ok else -1, err=0 if ok else 22,
                     args=(0, length, 3 | 1 << 32, offset))

    def ioctl(self, fd: int, nr: int, p_in: bytes, p_out: bytes, *, xfer: bool = False,
              d_in: bytes | None = None, d_out: bytes | None = None, ptr_off: int = 16,
              fault: bool = False, ret: int = 0, err: int = 0, request: int | None = None,
              ) -> None:
        """An escape; d_in/d_out: the buffer the params point to (at ptr_off)."""
        blocks = []
        if d_in is not None:
            addr = next(self._addr)
            p_in, p_out = _with_ptr(p_in, ptr_off, addr), _with_ptr(p_out, ptr_off, addr)
            data_out = d_in if d_out is None else d_out
            blocks += [Block(Tag.PTR, False, addr, len(d_in), b"" if fault else d_in, fault),
                       Block(Tag.PTR, True, addr, len(d_in), b"" if fault else data_out, fault)]
        arg = next(self._addr)
        if xfer:
            payload = next(self._addr)
            wrap = XFER.pack(nr, len(p_in), payload)
            blocks = [Block(Tag.ARG, False, arg, 16, wrap), Block(Tag.ARG, True, arg, 16, wrap),
                      Block(Tag.XFER, False, payload, len(p_in), p_in),
                      Block(Tag.XFER, True, payload, len(p_out), p_out), *blocks]
            request = iowr(Escape.IOCTL_XFER_CMD, 16)
        else:
            blocks = [Block(Tag.ARG, False, arg, len(p_in), p_in),
                      Block(Tag.ARG, True, arg, len(p_out), p_out), *blocks]
            request = iowr(nr, len(p_in)) if request is None else request
        self.w.write(Kind.IOCTL, fd, ret=ret, err=err, args=(request, arg), blocks=blocks)

    # --- RM calls, answered ---

    def alloc(self, fd: int, root: int, parent: int, h_class: int, params: bytes = b"", *,
              handle: int = 0, size64: bool = False, xfer: bool = False, status: int = 0,
              params_out: bytes | None = None, fault: bool = False) -> int:
        """RM_ALLOC; returns the new handle (the driver's when ``handle`` is 0)."""
        if not handle and status == 0:
            handle = next(self._client) if h_class == NvClass.ROOT_CLIENT else next(self._handle)
        layout = L.NVOS64 if size64 else L.NVOS21
        fields = [root, parent, 0, h_class, 0, *([0] if size64 else []), len(params),
                  *([0] if size64 else []), 0]
        p_in = layout.struct.pack(*fields)
        fields[2], fields[-1] = handle, status
        p_out = layout.struct.pack(*fields)
        self.ioctl(fd, Escape.RM_ALLOC, p_in, p_out, xfer=xfer, d_in=params or None,
                   d_out=params_out, fault=fault)
        return handle

    def free(self, fd: int, root: int, parent: int, obj: int, status: int = 0) -> None:
        self.ioctl(fd, Escape.RM_FREE, L.NVOS00.struct.pack(root, parent, obj, 0),
                   L.NVOS00.struct.pack(root, parent, obj, status))

    def control(self, fd: int, client: int, obj: int, cmd: int, params: bytes,
                out: bytes | None = None, status: int = 0, xfer: bool = False) -> None:
        p_in = L.NVOS54.struct.pack(client, obj, cmd, 0, 0, len(params), 0)
        p_out = L.NVOS54.struct.pack(client, obj, cmd, 0, 0, len(params), status)
        self.ioctl(fd, Escape.RM_CONTROL, p_in, p_out, d_in=params, d_out=out, xfer=xfer)

    def dup(self, fd: int, client: int, parent: int, src_client: int, src: int) -> int:
        h = next(self._handle)
        self.ioctl(fd, Escape.RM_DUP_OBJECT,
                   L.NVOS55.struct.pack(client, parent, 0, src_client, src, 0, 0),
                   L.NVOS55.struct.pack(client, parent, h, src_client, src, 0, 0))
        return h

    def vid_heap(self, fd: int, root: int, parent: int, function: int, handle: int = 0,
                 size: int = 0, returned: int | None = None, flags: int = 0) -> int:
        """RM_VID_HEAP_CONTROL ALLOC_SIZE (returns hMemory) or FREE of ``handle``."""
        p = bytearray(L.NVOS32.size)
        struct.pack_into("=III", p, 0, root, parent, function)
        off = L.NVOS32.offsets
        struct.pack_into("=I", p, off["hMemory"], handle)
        struct.pack_into("=I", p, off["flags"], flags)
        struct.pack_into("=Q", p, off["size"], size)
        out = bytearray(p)
        if function == VidHeapFunction.ALLOC_SIZE:
            handle = next(self._handle)
            struct.pack_into("=I", out, off["hMemory"], handle)
            struct.pack_into("=Q", out, off["size"], size if returned is None else returned)
        self.ioctl(fd, Escape.RM_VID_HEAP_CONTROL, bytes(p), bytes(out))
        return handle

    def alloc_memory(self, gpu_fd: int, root: int, parent: int, h_class: int,
                     size: int) -> int:
        """RM_ALLOC_MEMORY (NVOS02 + fd) on an nvidiaN node."""
        h = next(self._handle)
        s = L.NVOS02_WITH_FD.struct
        self.ioctl(gpu_fd, Escape.RM_ALLOC_MEMORY,
                   s.pack(root, parent, 0, h_class, 0, 0, size - 1, 0, gpu_fd),
                   s.pack(root, parent, h, h_class, 0, 0x10000, size - 1, 0, gpu_fd))
        return h

    def uvm_initialize(self, fd: int) -> None:
        p = struct.pack("=QI4x", 0, 0)
        window = p.ljust(64, b"\0")
        self.w.write(Kind.IOCTL, fd, args=(UvmCmd.INITIALIZE, next(self._addr)),
                     blocks=[Block(Tag.ARG, False, 0, 64, window),
                             Block(Tag.ARG, True, 0, 64, window)])


def _with_ptr(params: bytes, off: int, addr: int) -> bytes:
    p = bytearray(params)
    struct.pack_into("=Q", p, off, addr)
    return bytes(p)


def memory_params(size: int) -> bytes:
    p = bytearray(L.NV_MEMORY_ALLOCATION_PARAMS.size)
    struct.pack_into("=Q", p, L.NV_MEMORY_ALLOCATION_PARAMS.offsets["size"], size)
    return bytes(p)


def device_params(device_id: int = 0) -> bytes:
    return L.NV0080_ALLOC_PARAMETERS.struct.pack(device_id, 0, 0, 0, 0, 0, 0, 0, 0)


def fb_info_v2(free_kib: int) -> tuple[bytes, bytes]:
    """FB_GET_INFO_V2 params asking HEAP_FREE, before and after the driver."""
    before = bytearray(L.NV2080_CTRL_FB_GET_INFO_V2_PARAMS.size)
    struct.pack_into("=III", before, 0, 1, 0x16, 0)
    after = bytearray(before)
    struct.pack_into("=I", after, 8, free_kib)
    return bytes(before), bytes(after)


def cuda_like(s: Synth, *, mem_returned: int | None = None) -> dict[str, int]:
    """Start-up, allocations, a view query, frees; 1 GiB + 6 MiB left held at the end.

    ``mem_returned``: the size the driver writes back for the 1 GiB allocation."""
    ctl = s.open("/dev/nvidiactl")
    s.ioctl(ctl, Escape.CHECK_VERSION_STR, bytes(72), bytes(72))
    client = s.alloc(ctl, 0, 0, NvClass.ROOT_CLIENT)
    dev = s.alloc(ctl, client, client, NvClass.DEVICE_0, device_params(0))
    sub = s.alloc(ctl, client, dev, NvClass.SUBDEVICE_0, struct.pack("=I", 0))
    gpu = s.open("/dev/nvidia0")
    s.ioctl(gpu, Escape.REGISTER_FD, struct.pack("=i", ctl), struct.pack("=i", ctl))
    s.alloc(ctl, client, dev, 0xC8B5, bytes(64))  # a class vgpud does not name
    before, after = fb_info_v2(80 << 20)
    s.control(ctl, client, sub, Ctrl.FB_GET_INFO_V2, before, after)
    s.control(ctl, client, sub, 0x20800110, bytes(8))  # a control vgpud does not name
    big = s.alloc(ctl, client, dev, NvClass.MEMORY_LOCAL_USER, memory_params(GIB),
                  params_out=None if mem_returned is None else memory_params(mem_returned))
    small = s.alloc(ctl, client, dev, NvClass.MEMORY_LOCAL_USER, memory_params(4 * MIB),
                    size64=True, xfer=True)
    s.dup(ctl, client, dev, client, small)
    s.free(ctl, client, dev, small)  # the dup still holds the 4 MiB
    heap = s.vid_heap(ctl, client, dev, VidHeapFunction.ALLOC_SIZE, size=6 * MIB)
    s.vid_heap(ctl, client, dev, VidHeapFunction.FREE, handle=heap)
    s.alloc_memory(gpu, client, dev, NvClass.MEMORY_LOCAL_PRIVILEGED, 2 * MIB)
    uvm = s.open("/dev/nvidia-uvm")
    s.uvm_initialize(uvm)
    s.mmap(uvm, 2 * MIB)
    return {"ctl": ctl, "gpu": gpu, "client": client, "device": dev, "big": big,
            "held": GIB + 4 * MIB + 2 * MIB}
