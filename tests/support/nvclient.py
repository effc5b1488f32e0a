"""A small NVIDIA ioctl client for tests.

Talks to any directory of NVIDIA-style nodes: /dev/nvsim (the simulator,
directly) or /dev/vgpu (through the interposer).  Its struct layouts are
written here from NVIDIA's headers, independently of vgpud.nvidia, so the
two cross-check each other.

Calls return the ioctl's errno (0 on success) and leave the parameter
buffer as the driver wrote it, even when the ioctl failed (NVIDIA copies
params back on every outcome but -EFAULT).  RM calls put their outcome in
the struct's status field; helpers return it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from dataclasses import dataclass

# Escapes
ESC_RM_ALLOC_MEMORY = 0x27
ESC_RM_FREE = 0x29
ESC_RM_CONTROL = 0x2A
ESC_RM_ALLOC = 0x2B
ESC_RM_DUP_OBJECT = 0x34
ESC_RM_VID_HEAP_CONTROL = 0x4A
ESC_RM_MAP_MEMORY = 0x4E
ESC_RM_UNMAP_MEMORY = 0x4F
ESC_CARD_INFO = 200
ESC_REGISTER_FD = 201
ESC_CHECK_VERSION_STR = 210
ESC_IOCTL_XFER_CMD = 211
ESC_ATTACH_GPUS_TO_FD = 212
ESC_WAIT_OPEN_COMPLETE = 218
ESC_NVSIM_SUBMIT_WORK = 0xF0  # nvsim-private: simulated work on a channel group
XFER_MAX = 16384

UVM_INITIALIZE = 0x30000001

# Status codes
NV_OK = 0x00
NV_ERR_INSERT_DUPLICATE_NAME = 0x19
NV_ERR_INSUFFICIENT_RESOURCES = 0x1A
NV_ERR_INSUFFICIENT_PERMISSIONS = 0x1B
NV_ERR_INVALID_ADDRESS = 0x1E
NV_ERR_INVALID_ARGUMENT = 0x1F
NV_ERR_INVALID_CLASS = 0x22
NV_ERR_INVALID_CLIENT = 0x23
NV_ERR_INVALID_FLAGS = 0x29
NV_ERR_INVALID_LIMIT = 0x2E
NV_ERR_INVALID_OBJECT_HANDLE = 0x33
NV_ERR_INVALID_OBJECT_PARENT = 0x36
NV_ERR_INVALID_PARAM_STRUCT = 0x3A
NV_ERR_INVALID_STATE = 0x40
NV_ERR_NO_MEMORY = 0x51
NV_ERR_NOT_SUPPORTED = 0x56
NV_ERR_STATE_IN_USE = 0x63

# Classes
NV01_ROOT_CLIENT = 0x41
NV01_MEMORY_SYSTEM = 0x3E
NV01_MEMORY_LOCAL_PRIVILEGED = 0x3F
NV01_MEMORY_LOCAL_USER = 0x40
NV01_DEVICE_0 = 0x80
NV20_SUBDEVICE_0 = 0x2080
NV50_MEMORY_VIRTUAL = 0x50A0
FERMI_VASPACE_A = 0x90F1
KEPLER_CHANNEL_GROUP_A = 0xA06C
NV_MEMORY_FABRIC = 0xF8

# Controls
NV2080_CTRL_CMD_FB_GET_INFO = 0x20801301
NV2080_CTRL_CMD_FB_GET_INFO_V2 = 0x20801303
FB_INFO_MAX = 128
FB_RAM_SIZE = 0x07
FB_TOTAL_RAM_SIZE = 0x08
FB_HEAP_SIZE = 0x09
FB_HEAP_FREE = 0x16
FB_USABLE_RAM_SIZE = 0x20
NVA06C_CTRL_CMD_GPFIFO_SCHEDULE = 0xA06C0101
NVA06C_CTRL_CMD_SET_TIMESLICE = 0xA06C0103
NVA06C_CTRL_CMD_GET_TIMESLICE = 0xA06C0104
NVA06C_CTRL_CMD_PREEMPT = 0xA06C0105
NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL = 0xA06C0107
LEVEL_LOW, LEVEL_MEDIUM, LEVEL_HIGH = 0, 1, 2  # NVA06C_CTRL_INTERLEAVE_LEVEL_*
PREEMPT_MAX_MANUAL_TIMEOUT_US = 1_000_000
NVSIM_CTRL_CMD_GET_WORK_STATS = 0xA06C01F0  # nvsim-private

# NVOS32 functions and flags
NVOS32_FUNCTION_ALLOC_SIZE = 2
NVOS32_FUNCTION_FREE = 3
NVOS32_FUNCTION_INFO = 5
NVOS32_FUNCTION_ALLOC_TILED_PITCH_HEIGHT = 6
NVOS32_FUNCTION_ALLOC_SIZE_RANGE = 14
NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED = 0x4000
NVOS32_ALLOC_FLAGS_USE_BEGIN_END = 0x20000
NVOS32_ALLOC_FLAGS_VIRTUAL = 0x80000
NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED = 0x1

# Layouts (x86-64, little endian, explicit padding)
NVOS00 = struct.Struct("<IIII")  # hRoot hObjectParent hObjectOld status
NVOS21 = struct.Struct("<IIIIQII")  # ... pAllocParms paramsSize status
NVOS64 = struct.Struct("<IIIIQQIII4x")  # ... pRightsRequested paramsSize flags status
NVOS54 = struct.Struct("<IIIIQII")  # hClient hObject cmd flags params paramsSize status
# hClient hParent hObject hClientSrc hObjectSrc flags status (nvos.h NVOS55)
NVOS55 = struct.Struct("<IIIIIII")
# hClient hDevice hMemory offset length pLinearAddress status flags fd
NVOS33_FD = struct.Struct("<III4xQQQIIi4x")
NVOS34 = struct.Struct("<III4xQII")  # hClient hDevice hMemory pLinearAddress status flags
# hRoot hObjectParent hObjectNew hClass flags pMemory limit status fd
NVOS02_FD = struct.Struct("<IIIII4xQQI4xi4x")
NVOS32_HEAD = struct.Struct("<IIIIh2xIQQ")  # hRoot hParent function hVASpace ivc status total free
NVOS32_SIZE = 184
NVOS32_ALLOC = struct.Struct("<IIIIIIIIIII4xQQQQQQQIIi4x")  # data.AllocSize, at 40
# data.AllocTiledPitchHeight: owner hMemory type flags height pitch attr width format
# comprCovg zcullCovg partitionStride size alignment offset limit address rangeBegin
# rangeEnd attr2 ctagOffset numaNode
NVOS32_TILED = struct.Struct("<IIIIIiIIIIIIQQQQQQQIIi4x")
# data.AllocSizeRange: owner hMemory type flags attr format comprCovg zcullCovg
# partitionStride size alignment offset limit rangeBegin rangeEnd address attr2
# ctagOffset numaNode
NVOS32_RANGE = struct.Struct("<IIIIIIIII4xQQQQQQQIIi4x")
NVOS32_FREE = struct.Struct("<III")
NVOS32_INFO = struct.Struct("<I4xQQQ")
RM_API_VERSION = struct.Struct("<II64s")
XFER = struct.Struct("<IIQ")
CARD_INFO = struct.Struct("<B3xIBBBxHHIH2xQQQQI10s2x")
WAIT_OPEN = struct.Struct("<iI")
NV0080_ALLOC = struct.Struct("<IIIII4xQQQI4x")
NV2080_ALLOC = struct.Struct("<I")
MEM_ALLOC = struct.Struct("<IIIIIiIIIII4xQQQQQQQIIIIi4x")  # NV_MEMORY_ALLOCATION_PARAMS
MEM_ALLOC_SIZE_OFF = 64
MEM_ALLOC_OFFSET_OFF = 80
MEM_ALLOC_LIMIT_OFF = 88
VASPACE_ALLOC = struct.Struct("<IIQQQI4xQI4x")
TSG_ALLOC = struct.Struct("<IIIIB3x")
# NV00F8_ALLOCATION_PARAMETERS: alignment allocSize pageSize allocFlags map.{offset hVidMem flags}
FABRIC_ALLOC = struct.Struct("<QQQI4xQII")
FABRIC_PAGE_2M = 2 << 20
FB_INFO_V2_SIZE = 4 + 8 * FB_INFO_MAX
FB_INFO = struct.Struct("<I4xQ")
UVM_INIT = struct.Struct("<QI4x")
SUBMIT_WORK = struct.Struct("<IIQII")  # hClient hChannelGroup workNs status reserved
WORK_STATS = struct.Struct("<QQII")  # busyNs pendingNs bEnabled timesliceUs
GPFIFO_SCHEDULE = struct.Struct("<BBB")  # bEnable bSkipSubmit bSkipEnable
TIMESLICE = struct.Struct("<Q")
PREEMPT = struct.Struct("<BBxxI")  # bWait bManualTimeout timeoutUs

for _s, _n in (
    (NVOS00, 16), (NVOS21, 32), (NVOS64, 48), (NVOS54, 32), (NVOS33_FD, 56),
    (NVOS34, 32), (NVOS02_FD, 56), (NVOS32_HEAD, 40), (RM_API_VERSION, 72),
    (XFER, 16), (CARD_INFO, 72), (NV0080_ALLOC, 56), (MEM_ALLOC, 128),
    (VASPACE_ALLOC, 56), (TSG_ALLOC, 20), (FABRIC_ALLOC, 48), (FB_INFO, 16), (UVM_INIT, 16),
    (SUBMIT_WORK, 24), (WORK_STATS, 24), (GPFIFO_SCHEDULE, 3), (TIMESLICE, 8), (PREEMPT, 8),
):
    assert _s.size == _n, (_s.format, _s.size, _n)
assert NVOS32_HEAD.size + max(NVOS32_ALLOC.size, NVOS32_TILED.size,
                              NVOS32_RANGE.size) <= NVOS32_SIZE
assert (NVOS32_TILED.size, NVOS32_RANGE.size) == (120, 112)
assert NVOS55.size == 28

# The global namespace, as a C program (and libcuda) binds ioctl: an LD_PRELOAD
# interposer such as tools/nvtrace sees these calls too.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc.ioctl.restype = ctypes.c_int


def ioc(nr: int, size: int) -> int:
    """_IOWR('F', nr, size), as libnvidia builds it."""
    return (3 << 30) | ((size & 0x3FFF) << 16) | (ord("F") << 8) | (nr & 0xFF)


def addr(buf) -> int:
    """Address of a ctypes buffer (0 for None)."""
    return 0 if buf is None else ctypes.addressof(buf)


def raw_ioctl(fd: int, cmd: int, arg) -> int:
    """ioctl(fd, cmd, arg): arg is a ctypes buffer, an int address or None.

    Returns 0 or the errno; the buffer keeps what the driver wrote."""
    if arg is None:
        ptr = None
    elif isinstance(arg, int):
        ptr = arg
    else:
        ptr = ctypes.addressof(arg)
    ctypes.set_errno(0)
    rc = _libc.ioctl(fd, cmd, ptr)
    return ctypes.get_errno() if rc < 0 else 0


def nv_ioctl(fd: int, nr: int, buf, size: int | None = None, xfer: bool = False) -> int:
    """An NVIDIA escape with buf as params, directly or through XFER_CMD."""
    if size is None:
        size = ctypes.sizeof(buf)
    if not xfer:
        return raw_ioctl(fd, ioc(nr, size), buf)
    x = ctypes.create_string_buffer(XFER.pack(nr, size, addr(buf)), XFER.size)
    return raw_ioctl(fd, ioc(ESC_IOCTL_XFER_CMD, XFER.size), x)


def cbuf(data: bytes | int) -> ctypes.Array:
    """A writable ctypes buffer of exactly len(data) (or data) bytes."""
    if isinstance(data, int):
        return ctypes.create_string_buffer(data)
    return ctypes.create_string_buffer(bytes(data), len(data))


class NvError(Exception):
    def __init__(self, what: str, errno_: int = 0, status: int = 0):
        super().__init__(f"{what}: errno {errno_} status {status:#x}")
        self.errno = errno_
        self.status = status


@dataclass
class AllocResult:
    errno: int
    status: int
    handle: int
    params: bytes | None = None


@dataclass
class MapResult:
    errno: int
    status: int
    address: int


@dataclass
class Tree:
    client: int
    device: int
    subdevice: int


class NvNodes:
    """The NVIDIA nodes of one directory (/dev/nvsim, /dev/vgpu, ...)."""

    def __init__(self, nodedir: str = "/dev/nvsim"):
        self.dir = nodedir

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def exists(self) -> bool:
        return os.path.exists(self.path("nvidiactl"))

    def open_ctl(self) -> int:
        return os.open(self.path("nvidiactl"), os.O_RDWR | os.O_CLOEXEC)

    def open_gpu(self, index: int) -> int:
        return os.open(self.path(f"nvidia{index}"), os.O_RDWR | os.O_CLOEXEC)

    def open_uvm(self) -> int:
        return os.open(self.path("nvidia-uvm"), os.O_RDWR | os.O_CLOEXEC)

    def gpu_count(self) -> int:
        n = 0
        while os.path.exists(self.path(f"nvidia{n}")):
            n += 1
        return n


# ---- escapes handled by the OS layer ----

def check_version(ctl: int, version: bytes = b"", cmd: int = ord("2"),
                  xfer: bool = False) -> tuple[int, int, str]:
    """CHECK_VERSION_STR; cmd '2' queries.  Returns (errno, reply, string)."""
    b = cbuf(RM_API_VERSION.pack(cmd, 0, version))
    e = nv_ioctl(ctl, ESC_CHECK_VERSION_STR, b, xfer=xfer)
    _, reply, s = RM_API_VERSION.unpack(b.raw)
    return e, reply, s.split(b"\0", 1)[0].decode(errors="replace")


def card_info(ctl: int, entries: int = 8) -> tuple[int, list[dict]]:
    b = cbuf(CARD_INFO.size * entries)
    e = nv_ioctl(ctl, ESC_CARD_INFO, b)
    out = []
    for i in range(entries):
        f = CARD_INFO.unpack_from(b.raw, i * CARD_INFO.size)
        if f[0]:
            out.append({"valid": f[0], "domain": f[1], "bus": f[2], "vendor": f[5],
                        "device": f[6], "gpu_id": f[7], "fb_address": f[11],
                        "fb_size": f[12], "minor": f[13]})
    return e, out


def register_fd(gpu: int, ctl_fd: int, xfer: bool = False) -> int:
    b = cbuf(struct.pack("<i", ctl_fd))
    return nv_ioctl(gpu, ESC_REGISTER_FD, b, xfer=xfer)


# ---- RM escapes ----

def rm_alloc(ctl: int, hroot: int, hparent: int, hnew: int, hclass: int,
             params: bytes | None = None, *, size64: bool = False, xfer: bool = False,
             params_ptr: int | None = None, params_size: int | None = None) -> AllocResult:
    """RM_ALLOC with NVOS21 (32 B) or NVOS64 (48 B).

    paramsSize is 0, as libcuda sends it: the driver reads the alloc params
    by the size of their class (tests/data/traces/h200-*). params_ptr and
    params_size override the pointer and that field (for bad-input tests)."""
    pb = cbuf(params) if params else None
    ptr = addr(pb) if params_ptr is None else params_ptr
    psize = 0 if params_size is None else params_size
    if size64:
        b = cbuf(NVOS64.pack(hroot, hparent, hnew, hclass, ptr, 0, psize, 0, 0))
    else:
        b = cbuf(NVOS21.pack(hroot, hparent, hnew, hclass, ptr, psize, 0))
    e = nv_ioctl(ctl, ESC_RM_ALLOC, b, xfer=xfer)
    if size64:
        f = NVOS64.unpack(b.raw)
        status = f[8]
    else:
        f = NVOS21.unpack(b.raw)
        status = f[6]
    return AllocResult(e, status, f[2], pb.raw if pb is not None else None)


def rm_free(ctl: int, hroot: int, hparent: int, hobj: int, xfer: bool = False) -> tuple[int, int]:
    b = cbuf(NVOS00.pack(hroot, hparent, hobj, 0))
    e = nv_ioctl(ctl, ESC_RM_FREE, b, xfer=xfer)
    return e, NVOS00.unpack(b.raw)[3]


def rm_control(ctl: int, hclient: int, hobj: int, cmd: int, params: bytes | None,
               *, xfer: bool = False, params_ptr: int | None = None,
               params_size: int | None = None) -> tuple[int, int, bytes | None]:
    """RM_CONTROL; returns (errno, status, params as written back)."""
    pb = cbuf(params) if params else None
    ptr = addr(pb) if params_ptr is None else params_ptr
    psize = (len(params) if params else 0) if params_size is None else params_size
    b = cbuf(NVOS54.pack(hclient, hobj, cmd, 0, ptr, psize, 0))
    e = nv_ioctl(ctl, ESC_RM_CONTROL, b, xfer=xfer)
    return e, NVOS54.unpack(b.raw)[6], (pb.raw if pb is not None else None)


def rm_map_memory(ctl: int, hclient: int, hdevice: int, hmemory: int, offset: int,
                  length: int, fd: int, flags: int = 0, xfer: bool = False) -> MapResult:
    b = cbuf(NVOS33_FD.pack(hclient, hdevice, hmemory, offset, length, 0, 0, flags, fd))
    e = nv_ioctl(ctl, ESC_RM_MAP_MEMORY, b, xfer=xfer)
    f = NVOS33_FD.unpack(b.raw)
    return MapResult(e, f[6], f[5])


def rm_unmap_memory(ctl: int, hclient: int, hdevice: int, hmemory: int,
                    address: int) -> tuple[int, int]:
    b = cbuf(NVOS34.pack(hclient, hdevice, hmemory, address, 0, 0))
    e = nv_ioctl(ctl, ESC_RM_UNMAP_MEMORY, b)
    return e, NVOS34.unpack(b.raw)[4]


def rm_dup_object(ctl: int, hclient: int, hparent: int, hobject: int, hclient_src: int,
                  hobject_src: int, flags: int = 0, xfer: bool = False) -> tuple[int, int, int]:
    """RM_DUP_OBJECT (NVOS55); returns (errno, status, the new handle)."""
    b = cbuf(NVOS55.pack(hclient, hparent, hobject, hclient_src, hobject_src, flags, 0))
    e = nv_ioctl(ctl, ESC_RM_DUP_OBJECT, b, xfer=xfer)
    f = NVOS55.unpack(b.raw)
    return e, f[6], f[2]


def rm_calls() -> int:
    """nvsim's count of ioctl calls it received (module parameter rm_calls)."""
    with open("/sys/module/nvsim/parameters/rm_calls") as f:
        return int(f.read())


def rm_alloc_memory(gpu: int, hroot: int, hparent: int, hnew: int, hclass: int,
                    size: int, fd: int = -1) -> tuple[int, int, int, int]:
    """RM_ALLOC_MEMORY on nvidiaN; returns (errno, status, handle, pMemory)."""
    b = cbuf(NVOS02_FD.pack(hroot, hparent, hnew, hclass, 0, 0, size - 1, 0, fd))
    e = nv_ioctl(gpu, ESC_RM_ALLOC_MEMORY, b)
    f = NVOS02_FD.unpack(b.raw)
    return e, f[7], f[2], f[5]


def vid_heap(ctl: int, hroot: int, hparent: int, function: int,
             data: bytes = b"") -> tuple[int, int, dict, bytes]:
    """RM_VID_HEAP_CONTROL; returns (errno, status, header fields, data union)."""
    raw = NVOS32_HEAD.pack(hroot, hparent, function, 0, 0, 0, 0, 0) + data
    b = cbuf(raw.ljust(NVOS32_SIZE, b"\0"))
    e = nv_ioctl(ctl, ESC_RM_VID_HEAP_CONTROL, b)
    h = NVOS32_HEAD.unpack_from(b.raw)
    return e, h[5], {"total": h[6], "free": h[7]}, b.raw[NVOS32_HEAD.size:]


def vid_heap_alloc(ctl: int, hroot: int, hparent: int, size: int, handle: int = 0,
                   flags: int = 0) -> tuple[int, int, int, int]:
    """ALLOC_SIZE; returns (errno, status, hMemory, size)."""
    if handle:
        flags |= NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED
    data = NVOS32_ALLOC.pack(0, handle, 0, flags, 0, 0, 0, 0, 0, 0, 0,
                             size, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    e, st, _, out = vid_heap(ctl, hroot, hparent, NVOS32_FUNCTION_ALLOC_SIZE, data)
    f = NVOS32_ALLOC.unpack_from(out)
    return e, st, f[1], f[11]


@dataclass(frozen=True)
class HeapAlloc:
    """What an allocating VID_HEAP function reports back."""

    errno: int
    status: int
    handle: int
    size: int
    offset: int
    limit: int


def vid_heap_alloc_tiled(ctl: int, hroot: int, hparent: int, height: int, pitch: int,
                         handle: int = 0, flags: int = 0, size: int = 0) -> HeapAlloc:
    """ALLOC_TILED_PITCH_HEIGHT: the driver allocates height x pitch (``size`` is
    what the caller puts in the size field, which the driver ignores)."""
    if handle:
        flags |= NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED
    data = NVOS32_TILED.pack(0, handle, 0, flags, height, pitch, 0, 0, 0, 0, 0, 0,
                             size, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    e, st, _, out = vid_heap(ctl, hroot, hparent, NVOS32_FUNCTION_ALLOC_TILED_PITCH_HEIGHT,
                             data)
    f = NVOS32_TILED.unpack_from(out)
    return HeapAlloc(e, st, f[1], f[12], f[14], f[15])


def vid_heap_alloc_range(ctl: int, hroot: int, hparent: int, size: int, begin: int = 0,
                         end: int = 0, handle: int = 0, flags: int = 0) -> HeapAlloc:
    """ALLOC_SIZE_RANGE: ``size`` bytes inside begin..end (inclusive; 0..0: anywhere)."""
    if handle:
        flags |= NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED
    data = NVOS32_RANGE.pack(0, handle, 0, flags, 0, 0, 0, 0, 0, size, 0, 0, 0, begin, end,
                             0, 0, 0, 0)
    e, st, _, out = vid_heap(ctl, hroot, hparent, NVOS32_FUNCTION_ALLOC_SIZE_RANGE, data)
    f = NVOS32_RANGE.unpack_from(out)
    return HeapAlloc(e, st, f[1], f[9], f[11], f[12])


def vid_heap_free(ctl: int, hroot: int, hparent: int, hmemory: int) -> tuple[int, int]:
    data = NVOS32_FREE.pack(0, hmemory, NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED)
    e, st, _, _ = vid_heap(ctl, hroot, hparent, NVOS32_FUNCTION_FREE, data)
    return e, st


def uvm_initialize(uvm: int, flags: int = 0) -> tuple[int, int]:
    b = cbuf(UVM_INIT.pack(flags, 0xFFFF))
    e = raw_ioctl(uvm, UVM_INITIALIZE, b)
    return e, UVM_INIT.unpack(b.raw)[1]


# ---- parameter builders ----

def device_params(device_id: int) -> bytes:
    return NV0080_ALLOC.pack(device_id, 0, 0, 0, 0, 0, 0, 0, 0)


def subdevice_params(sub_id: int = 0) -> bytes:
    return NV2080_ALLOC.pack(sub_id)


def memory_params(size: int, flags: int = 0) -> bytes:
    b = bytearray(MEM_ALLOC.size)
    struct.pack_into("<I", b, 8, flags)
    struct.pack_into("<Q", b, MEM_ALLOC_SIZE_OFF, size)
    return bytes(b)


def memory_result(params: bytes) -> dict:
    return {
        "size": struct.unpack_from("<Q", params, MEM_ALLOC_SIZE_OFF)[0],
        "offset": struct.unpack_from("<Q", params, MEM_ALLOC_OFFSET_OFF)[0],
        "limit": struct.unpack_from("<Q", params, MEM_ALLOC_LIMIT_OFF)[0],
    }


def fb_info_v2_params(indices: list[int]) -> bytes:
    b = bytearray(FB_INFO_V2_SIZE)
    struct.pack_into("<I", b, 0, len(indices))
    for i, idx in enumerate(indices):
        struct.pack_into("<II", b, 4 + 8 * i, idx, 0)
    return bytes(b)


# ---- composite helpers ----

def must(res, what: str):
    """Raise NvError unless errno and status are both 0."""
    if isinstance(res, AllocResult | MapResult):
        e, st = res.errno, res.status
    else:
        e, st = res[0], res[1]
    if e or st:
        raise NvError(what, e, st)
    return res


def alloc_client(ctl: int, handle: int = 0, **kw) -> int:
    return must(rm_alloc(ctl, 0, 0, handle, NV01_ROOT_CLIENT, **kw), "alloc client").handle


def alloc_device(ctl: int, hclient: int, device_id: int = 0, handle: int = 0, **kw) -> int:
    r = rm_alloc(ctl, hclient, hclient, handle, NV01_DEVICE_0, device_params(device_id), **kw)
    return must(r, "alloc device").handle


def alloc_subdevice(ctl: int, hclient: int, hdevice: int, handle: int = 0, **kw) -> int:
    r = rm_alloc(ctl, hclient, hdevice, handle, NV20_SUBDEVICE_0, subdevice_params(0), **kw)
    return must(r, "alloc subdevice").handle


def alloc_memory(ctl: int, hclient: int, hparent: int, size: int, handle: int = 0,
                 hclass: int = NV01_MEMORY_LOCAL_USER, **kw) -> AllocResult:
    """Allocates memory; returns the AllocResult (status not checked)."""
    return rm_alloc(ctl, hclient, hparent, handle, hclass, memory_params(size), **kw)


def build_tree(ctl: int, device_id: int = 0, **kw) -> Tree:
    """Root client, device (deviceId) and subdevice 0, with generated handles."""
    c = alloc_client(ctl, **kw)
    d = alloc_device(ctl, c, device_id, **kw)
    s = alloc_subdevice(ctl, c, d, **kw)
    return Tree(c, d, s)


def fb_get_info_v2(ctl: int, hclient: int, hsubdevice: int, indices: list[int],
                   xfer: bool = False) -> tuple[int, int, dict[int, int]]:
    """FB_GET_INFO_V2; returns (errno, status, {index: data KiB})."""
    e, st, out = rm_control(ctl, hclient, hsubdevice, NV2080_CTRL_CMD_FB_GET_INFO_V2,
                            fb_info_v2_params(indices), xfer=xfer)
    vals = {}
    if out is not None:
        for i in range(len(indices)):
            idx, data = struct.unpack_from("<II", out, 4 + 8 * i)
            vals[idx] = data
    return e, st, vals


def fb_get_info(ctl: int, hclient: int, hsubdevice: int,
                indices: list[int]) -> tuple[int, int, dict[int, int]]:
    """Legacy FB_GET_INFO with a pointer to the {index, data} list."""
    lst = cbuf(b"".join(struct.pack("<II", i, 0) for i in indices) or b"\0" * 8)
    e, st, _ = rm_control(ctl, hclient, hsubdevice, NV2080_CTRL_CMD_FB_GET_INFO,
                          FB_INFO.pack(len(indices), addr(lst)))
    vals = {}
    for i in range(len(indices)):
        idx, data = struct.unpack_from("<II", lst.raw, 8 * i)
        vals[idx] = data
    return e, st, vals


def heap_free_kib(ctl: int, tree: Tree) -> int:
    must(r := fb_get_info_v2(ctl, tree.client, tree.subdevice, [FB_HEAP_FREE]), "fb info")
    return r[2][FB_HEAP_FREE]


def map_and_mmap(ctl: int, gpu_fd: int, tree_client: int, hdevice: int, hmemory: int,
                 length: int, offset: int = 0) -> tuple[MapResult, mmap.mmap]:
    """RM_MAP_MEMORY through ctl naming gpu_fd, then mmap of gpu_fd."""
    r = must(rm_map_memory(ctl, tree_client, hdevice, hmemory, offset, length, gpu_fd), "map")
    pages = (offset % mmap.PAGESIZE + length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    m = mmap.mmap(gpu_fd, pages * mmap.PAGESIZE, mmap.MAP_SHARED,
                  mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
    return r, m


# ---- channel groups and nvsim's work engine ----

PROC_GROUPS = "/proc/driver/nvsim/groups"
PROC_ENGINES = "/proc/driver/nvsim/engines"
PROC_GROUPS_HEADER = ("gpu client group tgid enabled timeslice_us pending_ns busy_ns wait_ns"
                      " preempts ready_ns wake_sum_ns wake_n wake_max_ns level")
PROC_ENGINES_HEADER = ("gpu busy_ns idle_ns switches switch_ns preempts timer_wakes late_sum_ns"
                       " late_max_ns late_1ms")


@dataclass(frozen=True)
class WorkStats:
    busy_ns: int
    pending_ns: int
    enabled: bool
    timeslice_us: int


@dataclass(frozen=True)
class ProcGroup:
    gpu: int
    client: int
    group: int
    tgid: int
    enabled: bool
    timeslice_us: int
    pending_ns: int
    busy_ns: int
    wait_ns: int  # off (GPFIFO_SCHEDULE) with pending work
    preempts: int = 0  # taken off the engine by PREEMPT
    ready_ns: int = 0  # on, with pending work, not running
    wake_sum_ns: int = 0  # submit-to-run latencies (work given to a group with none)
    wake_n: int = 0
    wake_max_ns: int = 0
    level: int = LEVEL_MEDIUM  # SET_INTERLEAVE_LEVEL


@dataclass(frozen=True)
class ProcEngine:
    gpu: int
    busy_ns: int
    idle_ns: int
    switches: int
    switch_ns: int = 0  # PREEMPT context switches (nothing runs)
    preempts: int = 0
    timer_wakes: int = 0  # the engine thread woken by its slice timer
    late_sum_ns: int = 0  # how late it ran after those deadlines
    late_max_ns: int = 0
    late_1ms: int = 0  # wake-ups more than 1 ms late


def alloc_channel_group(ctl: int, hclient: int, hdevice: int, handle: int = 0, **kw) -> int:
    """A KEPLER_CHANNEL_GROUP_A under a device (its GPU is the device's)."""
    r = rm_alloc(ctl, hclient, hdevice, handle, KEPLER_CHANNEL_GROUP_A,
                 TSG_ALLOC.pack(0, 0, 0, 0, 0), **kw)
    return must(r, "alloc channel group").handle


def alloc_fabric(ctl: int, hclient: int, hsubdevice: int, size: int, handle: int = 0,
                 page: int = FABRIC_PAGE_2M, **kw):
    """NV_MEMORY_FABRIC under a subdevice, flexible (no hVidMem): ``size`` bytes
    in pages of ``page``. Returns rm_alloc's result."""
    return rm_alloc(ctl, hclient, hsubdevice, handle, NV_MEMORY_FABRIC,
                    FABRIC_ALLOC.pack(page, size, page, 0, 0, 0, 0), **kw)


def submit_work(ctl: int, hclient: int, hgroup: int, work_ns: int, *, reserved: int = 0,
                xfer: bool = False) -> tuple[int, int]:
    """NVSIM_ESC_SUBMIT_WORK; returns (errno, status)."""
    b = cbuf(SUBMIT_WORK.pack(hclient, hgroup, work_ns, 0, reserved))
    e = nv_ioctl(ctl, ESC_NVSIM_SUBMIT_WORK, b, xfer=xfer)
    return e, SUBMIT_WORK.unpack(b.raw)[3]


def work_stats(ctl: int, hclient: int, hgroup: int,
               xfer: bool = False) -> tuple[int, int, WorkStats | None]:
    """NVSIM_CTRL_CMD_GET_WORK_STATS; returns (errno, status, stats or None)."""
    e, st, out = rm_control(ctl, hclient, hgroup, NVSIM_CTRL_CMD_GET_WORK_STATS,
                            bytes(WORK_STATS.size), xfer=xfer)
    if e or st or out is None:
        return e, st, None
    busy, pending, enabled, ts = WORK_STATS.unpack(out)
    return e, st, WorkStats(busy, pending, bool(enabled), ts)


def set_timeslice(ctl: int, hclient: int, hgroup: int, us: int) -> tuple[int, int]:
    e, st, _ = rm_control(ctl, hclient, hgroup, NVA06C_CTRL_CMD_SET_TIMESLICE,
                          TIMESLICE.pack(us))
    return e, st


def preempt(ctl: int, hclient: int, hgroup: int, wait: int = 0, manual: int = 0,
            timeout_us: int = 0) -> tuple[int, int]:
    """NVA06C_CTRL_CMD_PREEMPT; returns (errno, status)."""
    e, st, _ = rm_control(ctl, hclient, hgroup, NVA06C_CTRL_CMD_PREEMPT,
                          PREEMPT.pack(wait, manual, timeout_us))
    return e, st


def set_interleave_level(ctl: int, hclient: int, hgroup: int, level: int) -> tuple[int, int]:
    """NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL; returns (errno, status)."""
    e, st, _ = rm_control(ctl, hclient, hgroup, NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL,
                          struct.pack("<I", level))
    return e, st


def gpfifo_schedule(ctl: int, hclient: int, hgroup: int, enable: bool) -> tuple[int, int]:
    e, st, _ = rm_control(ctl, hclient, hgroup, NVA06C_CTRL_CMD_GPFIFO_SCHEDULE,
                          GPFIFO_SCHEDULE.pack(int(enable), 0, 0))
    return e, st


def _proc_rows(path: str, header: str) -> list[list[int]]:
    """Rows of integers (handles in 0x hex) after the exact header line."""
    with open(path) as f:
        lines = f.read().splitlines()
    if not lines or lines[0] != header:
        raise ValueError(f"{path}: header {lines[:1]!r}, want {header!r}")
    width = len(header.split(" "))
    rows = []
    for line in lines[1:]:
        fields = line.split(" ")
        if len(fields) != width:
            raise ValueError(f"{path}: bad line {line!r}")
        rows.append([int(x, 0) for x in fields])
    return rows


def proc_groups() -> list[ProcGroup]:
    """/proc/driver/nvsim/groups, one entry per channel group."""
    return [ProcGroup(r[0], r[1], r[2], r[3], bool(r[4]), *r[5:])
            for r in _proc_rows(PROC_GROUPS, PROC_GROUPS_HEADER)]


def proc_engines() -> list[ProcEngine]:
    """/proc/driver/nvsim/engines, one entry per GPU."""
    return [ProcEngine(*r) for r in _proc_rows(PROC_ENGINES, PROC_ENGINES_HEADER)]
