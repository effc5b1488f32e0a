"""NVIDIA param layouts (x86-64) and typed decoders for the intercepted escapes.

Each layout is pinned by tests (sizes and offsets from nvidia-abi-facts.md and
nvos.h, and checked with gcc). Decoders take the params block exactly as the
caller passed it (and the buffer a rule copied, when there is one) and raise
DecodeError on anything that does not fit.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import NamedTuple

from vgpud.kernel.cstruct import CStruct, DecodeError
from vgpud.nvidia.escapes import (
    DEVICE_MEMORY_CLASSES,
    FB_INFO_MAX_LIST_SIZE,
    Escape,
    NvClass,
    VidHeapFunction,
)

__all__ = [
    "ALLOCATING_FUNCTIONS",
    "ALLOC_PARAMS",
    "Call",
    "DecodeError",
    "DeviceAllocParams",
    "MemoryAllocParams",
    "PreemptParams",
    "RmAlloc",
    "RmAllocMemory",
    "RmControl",
    "RmDupObject",
    "RmFree",
    "RmMapMemory",
    "VidHeapAllocSize",
    "VidHeapControl",
    "VidHeapInfo",
    "decode_call",
    "decode_preempt",
    "decode_timeslice",
    "decode_vid_heap_info",
    "encode_timeslice",
    "rewrite_fb_info",
    "rewrite_fb_info_v2",
    "rewrite_vid_heap_info",
    "status_offset",
]

NVOS00 = CStruct(
    "NVOS00_PARAMETERS",
    ("hRoot", "I"), ("hObjectParent", "I"), ("hObjectOld", "I"), ("status", "I"),
)
NVOS21 = CStruct(
    "NVOS21_PARAMETERS",
    ("hRoot", "I"), ("hObjectParent", "I"), ("hObjectNew", "I"), ("hClass", "I"),
    ("pAllocParms", "Q"), ("paramsSize", "I"), ("status", "I"),
)
NVOS64 = CStruct(
    "NVOS64_PARAMETERS",
    ("hRoot", "I"), ("hObjectParent", "I"), ("hObjectNew", "I"), ("hClass", "I"),
    ("pAllocParms", "Q"), ("pRightsRequested", "Q"), ("paramsSize", "I"), ("flags", "I"),
    ("status", "I"), (None, "4x"),
)
NVOS54 = CStruct(
    "NVOS54_PARAMETERS",
    ("hClient", "I"), ("hObject", "I"), ("cmd", "I"), ("flags", "I"),
    ("params", "Q"), ("paramsSize", "I"), ("status", "I"),
)
NVOS33_WITH_FD = CStruct(
    "nv_ioctl_nvos33_parameters_with_fd",
    ("hClient", "I"), ("hDevice", "I"), ("hMemory", "I"), (None, "4x"),
    ("offset", "Q"), ("length", "Q"), ("pLinearAddress", "Q"), ("status", "I"),
    ("flags", "I"), ("fd", "i"), (None, "4x"),
)
NVOS02_WITH_FD = CStruct(
    "nv_ioctl_nvos02_parameters_with_fd",
    ("hRoot", "I"), ("hObjectParent", "I"), ("hObjectNew", "I"), ("hClass", "I"),
    ("flags", "I"), (None, "4x"), ("pMemory", "Q"), ("limit", "Q"), ("status", "I"),
    (None, "4x"), ("fd", "i"), (None, "4x"),
)
# NVOS32 with its data union seen as AllocSize (the union is 144 B, set by HwAlloc).
NVOS32 = CStruct(
    "NVOS32_PARAMETERS",
    ("hRoot", "I"), ("hObjectParent", "I"), ("function", "I"), ("hVASpace", "I"),
    ("ivcHeapNumber", "h"), (None, "2x"), ("status", "I"), ("total", "Q"), ("free", "Q"),
    ("owner", "I"), ("hMemory", "I"), ("type", "I"), ("flags", "I"), ("attr", "I"),
    ("format", "I"), ("comprCovg", "I"), ("zcullCovg", "I"), ("partitionStride", "I"),
    ("width", "I"), ("height", "I"), (None, "4x"), ("size", "Q"), ("alignment", "Q"),
    ("offset", "Q"), ("limit", "Q"), ("address", "Q"), ("rangeBegin", "Q"),
    ("rangeEnd", "Q"), ("attr2", "I"), ("ctagOffset", "I"), (None, "32x"),
)
# NVOS32 with its data union seen as AllocTiledPitchHeight (function 6): RM
# ignores the size passed in and allocates height x pitch.
NVOS32_TILED = CStruct(
    "NVOS32_TILED_PARAMETERS",
    ("hRoot", "I"), ("hObjectParent", "I"), ("function", "I"), ("hVASpace", "I"),
    ("ivcHeapNumber", "h"), (None, "2x"), ("status", "I"), ("total", "Q"), ("free", "Q"),
    ("owner", "I"), ("hMemory", "I"), ("type", "I"), ("flags", "I"), ("height", "I"),
    ("pitch", "i"), ("attr", "I"), ("width", "I"), ("format", "I"), ("comprCovg", "I"),
    ("zcullCovg", "I"), ("partitionStride", "I"), ("size", "Q"), ("alignment", "Q"),
    ("offset", "Q"), ("limit", "Q"), ("address", "Q"), ("rangeBegin", "Q"),
    ("rangeEnd", "Q"), ("attr2", "I"), ("ctagOffset", "I"), ("numaNode", "i"), (None, "28x"),
)
# NVOS32 with its data union seen as AllocSizeRange (function 14): its size lies
# 8 bytes before AllocSize's, and its range before its address.
NVOS32_RANGE = CStruct(
    "NVOS32_RANGE_PARAMETERS",
    ("hRoot", "I"), ("hObjectParent", "I"), ("function", "I"), ("hVASpace", "I"),
    ("ivcHeapNumber", "h"), (None, "2x"), ("status", "I"), ("total", "Q"), ("free", "Q"),
    ("owner", "I"), ("hMemory", "I"), ("type", "I"), ("flags", "I"), ("attr", "I"),
    ("format", "I"), ("comprCovg", "I"), ("zcullCovg", "I"), ("partitionStride", "I"),
    (None, "4x"), ("size", "Q"), ("alignment", "Q"), ("offset", "Q"), ("limit", "Q"),
    ("rangeBegin", "Q"), ("rangeEnd", "Q"), ("address", "Q"), ("attr2", "I"),
    ("ctagOffset", "I"), ("numaNode", "i"), (None, "36x"),
)
# NVOS32 with its data union seen as Info (function INFO): the heap's total and
# free, and the largest free block (offset, size), all in bytes.
NVOS32_INFO = CStruct(
    "NVOS32_INFO_PARAMETERS",
    ("hRoot", "I"), ("hObjectParent", "I"), ("function", "I"), ("hVASpace", "I"),
    ("ivcHeapNumber", "h"), (None, "2x"), ("status", "I"), ("total", "Q"), ("free", "Q"),
    ("attr", "I"), (None, "4x"), ("offset", "Q"), ("size", "Q"), ("base", "Q"),
    (None, "112x"),
)
NVOS55 = CStruct(
    "NVOS55_PARAMETERS",
    ("hClient", "I"), ("hParent", "I"), ("hObject", "I"), ("hClientSrc", "I"),
    ("hObjectSrc", "I"), ("flags", "I"), ("status", "I"),
)
NV_MEMORY_ALLOCATION_PARAMS = CStruct(
    "NV_MEMORY_ALLOCATION_PARAMS",
    ("owner", "I"), ("type", "I"), ("flags", "I"), ("width", "I"), ("height", "I"),
    ("pitch", "i"), ("attr", "I"), ("attr2", "I"), ("format", "I"), ("comprCovg", "I"),
    ("zcullCovg", "I"), (None, "4x"), ("rangeLo", "Q"), ("rangeHi", "Q"), ("size", "Q"),
    ("alignment", "Q"), ("offset", "Q"), ("limit", "Q"), ("address", "Q"),
    ("ctagOffset", "I"), ("hVASpace", "I"), ("internalflags", "I"), ("tag", "I"),
    ("numaNode", "i"), (None, "4x"),
)
NV0080_ALLOC_PARAMETERS = CStruct(
    "NV0080_ALLOC_PARAMETERS",
    ("deviceId", "I"), ("hClientShare", "I"), ("hTargetClient", "I"),
    ("hTargetDevice", "I"), ("flags", "I"), (None, "4x"), ("vaSpaceSize", "Q"),
    ("vaStartInternal", "Q"), ("vaLimitInternal", "Q"), ("vaMode", "I"), (None, "4x"),
)

# The alloc params RM_ALLOC reads for a class, of the classes vgpud decides on
# their params. The driver takes their size from the class (its resource
# list, rmapiGetClassAllocParamSize) and never reads NVOS21/NVOS64
# paramsSize, which libcuda leaves 0 (docs/hardware.md).
ALLOC_PARAMS: Mapping[int, CStruct] = {
    NvClass.DEVICE_0: NV0080_ALLOC_PARAMETERS,
    **dict.fromkeys(DEVICE_MEMORY_CLASSES, NV_MEMORY_ALLOCATION_PARAMS),
}

# NV2080_CTRL_FB_INFO: one {index, data} entry of an FB_GET_INFO(_V2) list.
FB_INFO_ENTRY = CStruct("NV2080_CTRL_FB_INFO", ("index", "I"), ("data", "I"))
# NV2080_CTRL_FB_GET_INFO_PARAMS: a count and a pointer to {index, data} entries.
NV2080_CTRL_FB_GET_INFO_PARAMS = CStruct(
    "NV2080_CTRL_FB_GET_INFO_PARAMS",
    ("fbInfoListSize", "I"), (None, "4x"), ("fbInfoList", "Q"),
)
# NV2080_CTRL_FB_GET_INFO_V2_PARAMS: the entries inline (128 of {u32 index; u32 data}).
NV2080_CTRL_FB_GET_INFO_V2_PARAMS = CStruct(
    "NV2080_CTRL_FB_GET_INFO_V2_PARAMS",
    ("fbInfoListSize", "I"), ("fbInfoList", f"{2 * FB_INFO_MAX_LIST_SIZE}I"),
)

# KEPLER_CHANNEL_GROUP_A (0xA06C) control params, from ctrla06c.h of NVIDIA's
# open-gpu-kernel-modules (src/common/sdk/nvidia/inc/ctrl/ctrla06c.h):
# SET/GET_TIMESLICE's, PREEMPT's (two NvBools, then a 4-aligned NvU32) and
# SET/GET_INTERLEAVE_LEVEL's.
NVA06C_CTRL_TIMESLICE_PARAMS = CStruct("NVA06C_CTRL_TIMESLICE_PARAMS", ("timesliceUs", "Q"))
NVA06C_CTRL_PREEMPT_PARAMS = CStruct(
    "NVA06C_CTRL_PREEMPT_PARAMS",
    ("bWait", "B"), ("bManualTimeout", "B"), (None, "2x"), ("timeoutUs", "I"),
)
NVA06C_CTRL_INTERLEAVE_LEVEL_PARAMS = CStruct(
    "NVA06C_CTRL_INTERLEAVE_LEVEL_PARAMS", ("tsgInterleaveLevel", "I"),
)
# The channel-group control params the daemon answers for the driver (SchedPolicy).
TSG_CONTROL_LAYOUTS = (NVA06C_CTRL_TIMESLICE_PARAMS, NVA06C_CTRL_PREEMPT_PARAMS,
                       NVA06C_CTRL_INTERLEAVE_LEVEL_PARAMS)

LAYOUTS = (NVOS00, NVOS21, NVOS64, NVOS54, NVOS33_WITH_FD, NVOS02_WITH_FD, NVOS32, NVOS32_TILED,
           NVOS32_RANGE, NVOS32_INFO, NVOS55, NV_MEMORY_ALLOCATION_PARAMS, NV0080_ALLOC_PARAMETERS,
           FB_INFO_ENTRY, NV2080_CTRL_FB_GET_INFO_PARAMS, NV2080_CTRL_FB_GET_INFO_V2_PARAMS)

# Where `status` lies in each params block, by (escape, params size).
_STATUS_OFFSETS: dict[tuple[int, int], int] = {
    (Escape.RM_FREE, NVOS00.size): NVOS00.offsets["status"],
    (Escape.RM_ALLOC, NVOS21.size): NVOS21.offsets["status"],
    (Escape.RM_ALLOC, NVOS64.size): NVOS64.offsets["status"],
    (Escape.RM_CONTROL, NVOS54.size): NVOS54.offsets["status"],
    (Escape.RM_MAP_MEMORY, NVOS33_WITH_FD.size): NVOS33_WITH_FD.offsets["status"],
    (Escape.RM_ALLOC_MEMORY, NVOS02_WITH_FD.size): NVOS02_WITH_FD.offsets["status"],
    (Escape.RM_VID_HEAP_CONTROL, NVOS32.size): NVOS32.offsets["status"],
    (Escape.RM_DUP_OBJECT, NVOS55.size): NVOS55.offsets["status"],
}


def status_offset(nr: int, size: int) -> int | None:
    """Offset of the NVIDIA status in a params block of this escape and size."""
    return _STATUS_OFFSETS.get((nr, size))


class MemoryAllocParams(NamedTuple):
    """NV_MEMORY_ALLOCATION_PARAMS (alloc params of classes 0x40 / 0x3F)."""

    owner: int
    type: int
    flags: int
    width: int
    height: int
    pitch: int
    attr: int
    attr2: int
    format: int
    compr_covg: int
    zcull_covg: int
    range_lo: int
    range_hi: int
    size: int
    alignment: int
    offset: int
    limit: int
    address: int
    ctag_offset: int
    h_va_space: int
    internal_flags: int
    tag: int
    numa_node: int


class DeviceAllocParams(NamedTuple):
    """NV0080_ALLOC_PARAMETERS (alloc params of NV01_DEVICE_0)."""

    device_id: int
    h_client_share: int
    h_target_client: int
    h_target_device: int
    flags: int
    va_space_size: int
    va_start_internal: int
    va_limit_internal: int
    va_mode: int


class RmFree(NamedTuple):
    h_root: int
    h_parent: int
    h_object: int
    status: int


class RmAlloc(NamedTuple):
    """RM_ALLOC as NVOS21 (32 B) or NVOS64 (48 B; rights and flags)."""

    h_root: int
    h_parent: int
    h_new: int
    h_class: int
    p_alloc_params: int
    params_size: int
    flags: int
    status: int
    status_off: int
    alloc: MemoryAllocParams | DeviceAllocParams | None  # decoded when copied


class RmControl(NamedTuple):
    h_client: int
    h_object: int
    cmd: int
    flags: int
    p_params: int
    params_size: int
    status: int
    data: bytes | None  # the control's params, when copied


class RmMapMemory(NamedTuple):
    h_client: int
    h_device: int
    h_memory: int
    offset: int
    length: int
    p_linear_address: int
    status: int
    flags: int
    fd: int


class RmAllocMemory(NamedTuple):
    h_root: int
    h_parent: int
    h_new: int
    h_class: int
    flags: int
    p_memory: int
    limit: int
    status: int
    fd: int


class VidHeapAllocSize(NamedTuple):
    """An allocating NVOS32 function's data (AllocSize, AllocTiledPitchHeight or
    AllocSizeRange): ``size`` is what the driver allocates (height x pitch for
    ALLOC_TILED_PITCH_HEIGHT, whatever size was passed)."""

    owner: int
    h_memory: int
    type: int
    flags: int
    attr: int
    attr2: int
    size: int
    alignment: int
    offset: int


class VidHeapControl(NamedTuple):
    h_root: int
    h_parent: int
    function: int
    h_va_space: int
    status: int
    h_memory: int  # hMemory of the allocating functions and FREE (same offset in all)
    alloc: VidHeapAllocSize | None  # the allocating functions (ALLOCATING_FUNCTIONS) only


class RmDupObject(NamedTuple):
    h_client: int
    h_parent: int
    h_object: int
    h_client_src: int
    h_object_src: int
    flags: int
    status: int


Call = (RmFree | RmAlloc | RmControl | RmMapMemory | RmAllocMemory | VidHeapControl
        | RmDupObject)


_U32 = struct.Struct("=I")
_new = tuple.__new__  # builds a NamedTuple from a tuple without its Python-level __new__
_MEM_UNPACK, _MEM_SIZE = NV_MEMORY_ALLOCATION_PARAMS.struct.unpack, NV_MEMORY_ALLOCATION_PARAMS.size
_NVOS21_UNPACK, _NVOS21_STATUS = NVOS21.struct.unpack, NVOS21.offsets["status"]
_NVOS64_STATUS = NVOS64.offsets["status"]
_DEVICE_0 = int(NvClass.DEVICE_0)


def _alloc_params(h_class: int, data: bytes | None) -> MemoryAllocParams | DeviceAllocParams | None:
    if data is None:
        return None
    if h_class in DEVICE_MEMORY_CLASSES:
        if len(data) != _MEM_SIZE:
            raise DecodeError(f"NV_MEMORY_ALLOCATION_PARAMS: {len(data)} bytes, need {_MEM_SIZE}")
        return _new(MemoryAllocParams, _MEM_UNPACK(data))
    if h_class == _DEVICE_0:
        return _new(DeviceAllocParams, NV0080_ALLOC_PARAMETERS.unpack_exact(data))
    return None


def _rm_alloc(params: bytes, data: bytes | None) -> RmAlloc:
    if len(params) == 32:
        h_root, h_parent, h_new, h_class, ptr, size, status = _NVOS21_UNPACK(params)
        flags, status_off = 0, _NVOS21_STATUS
    elif len(params) == 48:
        (h_root, h_parent, h_new, h_class, ptr, _rights, size, flags,
         status) = NVOS64.unpack_exact(params)
        status_off = _NVOS64_STATUS
    else:
        raise DecodeError(f"RM_ALLOC params of {len(params)} bytes: neither NVOS21 nor NVOS64")
    return _new(RmAlloc, (h_root, h_parent, h_new, h_class, ptr, size, flags, status,
                          status_off, _alloc_params(h_class, data)))


def _rm_control(params: bytes, data: bytes | None) -> RmControl:
    return _new(RmControl, (*NVOS54.unpack_exact(params), data))


def _vid_heap(params: bytes, _data: bytes | None) -> VidHeapControl:
    (h_root, h_parent, function, h_va_space, _ivc, status, _total, _free, _owner, h_memory,
     *_rest) = NVOS32.unpack_exact(params)
    decode = _VID_HEAP_ALLOCS.get(function)
    alloc = None if decode is None else decode(params)
    return VidHeapControl(h_root, h_parent, function, h_va_space, status, h_memory, alloc)


def _alloc_size(params: bytes) -> VidHeapAllocSize:
    (*_head, owner, h_memory, type_, flags, attr, _format, _compr, _zcull, _stride, _width,
     _height, size, alignment, offset, _limit, _address, _begin, _end, attr2,
     _ctag) = NVOS32.unpack_exact(params)
    return VidHeapAllocSize(owner, h_memory, type_, flags, attr, attr2, size, alignment, offset)


def _alloc_tiled(params: bytes) -> VidHeapAllocSize:
    (*_head, owner, h_memory, type_, flags, height, pitch, attr, _width, _format, _compr,
     _zcull, _stride, _size, alignment, offset, _limit, _address, _begin, _end, attr2, _ctag,
     _numa) = NVOS32_TILED.unpack_exact(params)
    # As the driver computes it: a u64 product, the signed pitch taken mod 2**64.
    size = height * pitch % 2**64
    return VidHeapAllocSize(owner, h_memory, type_, flags, attr, attr2, size, alignment, offset)


def _alloc_range(params: bytes) -> VidHeapAllocSize:
    (*_head, owner, h_memory, type_, flags, attr, _format, _compr, _zcull, _stride, size,
     alignment, offset, _limit, _begin, _end, _address, attr2, _ctag,
     _numa) = NVOS32_RANGE.unpack_exact(params)
    return VidHeapAllocSize(owner, h_memory, type_, flags, attr, attr2, size, alignment, offset)


# The functions that allocate (through the same construct as RM_ALLOC of
# NV01_MEMORY_LOCAL_USER), each with the decoder of its data union member.
_VID_HEAP_ALLOCS: dict[int, Callable[[bytes], VidHeapAllocSize]] = {
    VidHeapFunction.ALLOC_SIZE: _alloc_size,
    VidHeapFunction.ALLOC_TILED_PITCH_HEIGHT: _alloc_tiled,
    VidHeapFunction.ALLOC_SIZE_RANGE: _alloc_range,
}
ALLOCATING_FUNCTIONS = frozenset(_VID_HEAP_ALLOCS)


_DECODERS: dict[int, Callable[[bytes, bytes | None], Call]] = {
    Escape.RM_FREE: lambda p, _d: RmFree(*NVOS00.unpack_exact(p)),
    Escape.RM_ALLOC: _rm_alloc,
    Escape.RM_CONTROL: _rm_control,
    Escape.RM_MAP_MEMORY: lambda p, _d: RmMapMemory(*NVOS33_WITH_FD.unpack_exact(p)),
    Escape.RM_ALLOC_MEMORY: lambda p, _d: RmAllocMemory(*NVOS02_WITH_FD.unpack_exact(p)),
    Escape.RM_VID_HEAP_CONTROL: _vid_heap,
    Escape.RM_DUP_OBJECT: lambda p, _d: RmDupObject(*NVOS55.unpack_exact(p)),
}


def decode_call(nr: int, params: bytes, data: bytes | None = None) -> Call | None:
    """Decode an RM escape's params (and copied buffer); None for escapes not decoded.

    ``nr`` is the escape after IOCTL_XFER_CMD unwrapping (the upcall's ``nr``);
    only meaningful on the ctl and GPU nodes.
    """
    decoder = _DECODERS.get(nr)
    return None if decoder is None else decoder(params, data)


class PreemptParams(NamedTuple):
    """NVA06C_CTRL_PREEMPT_PARAMS."""

    wait: bool
    manual_timeout: bool
    timeout_us: int


def decode_timeslice(data: bytes) -> int:
    """NVA06C_CTRL_TIMESLICE_PARAMS: the timeslice in microseconds."""
    (us,) = NVA06C_CTRL_TIMESLICE_PARAMS.unpack_exact(data)
    return int(us)


def encode_timeslice(us: int) -> bytes:
    return NVA06C_CTRL_TIMESLICE_PARAMS.struct.pack(us)


def decode_preempt(data: bytes) -> PreemptParams:
    wait, manual, timeout = NVA06C_CTRL_PREEMPT_PARAMS.unpack_exact(data)
    return PreemptParams(bool(wait), bool(manual), timeout)


_FB_ENTRY = FB_INFO_ENTRY.struct
_FB_V2_SIZE = NV2080_CTRL_FB_GET_INFO_V2_PARAMS.size
_FB_V2_LIST = NV2080_CTRL_FB_GET_INFO_V2_PARAMS.offsets["fbInfoList"]


def rewrite_fb_info(entries: bytes, values: Mapping[int, int]) -> bytes | None:
    """A list of {index, data} entries (NV2080_CTRL_FB_INFO) with those named in
    ``values`` set (index -> data, clamped to u32); None when nothing changes.

    The same for FB_GET_INFO_V2's inline list and FB_GET_INFO's list (the
    module's copy of the caller's, VGPU_A_DATA2).
    """
    if len(entries) % _FB_ENTRY.size:
        raise DecodeError(f"FB info list of {len(entries)} bytes")
    out: bytearray | None = None
    for i, (index, data) in enumerate(_FB_ENTRY.iter_unpack(entries)):
        new = values.get(index)
        if new is not None:
            new = min(max(new, 0), 0xFFFFFFFF)
            if new != data:
                if out is None:
                    out = bytearray(entries)
                _FB_ENTRY.pack_into(out, i * _FB_ENTRY.size, index, new)
    return None if out is None else bytes(out)


def rewrite_fb_info_v2(buf: bytes, values: Mapping[int, int]) -> bytes | None:
    """FB_GET_INFO_V2 params with the entries named in ``values`` set (index -> data).

    Entries past ``fbInfoListSize`` and indexes not in ``values`` are left as
    they are. None when the block does not fit the layout or nothing changes
    (then the driver's answer stands).
    """
    if len(buf) != _FB_V2_SIZE:
        return None
    (count,) = _U32.unpack_from(buf)
    if count > FB_INFO_MAX_LIST_SIZE:
        return None
    end = _FB_V2_LIST + count * _FB_ENTRY.size
    entries = rewrite_fb_info(buf[_FB_V2_LIST:end], values)
    return None if entries is None else buf[:_FB_V2_LIST] + entries + buf[end:]


class VidHeapInfo(NamedTuple):
    """NVOS32 after function INFO: the heap's total and free, and its largest free
    block (bytes)."""

    status: int
    total: int
    free: int
    attr: int
    offset: int
    size: int
    base: int


def decode_vid_heap_info(params: bytes) -> VidHeapInfo:
    (_root, _parent, _function, _va, _ivc, status, total, free, attr, offset, size,
     base) = NVOS32_INFO.unpack_exact(params)
    return VidHeapInfo(status, total, free, attr, offset, size, base)


def rewrite_vid_heap_info(params: bytes, total: int, free: int) -> bytes | None:
    """INFO results as a tenant sees them: ``total`` and ``free`` (bytes), and a
    largest free block no larger than ``free``. None when nothing changes or
    the block is not an NVOS32."""
    if len(params) != NVOS32_INFO.size:
        return None
    info = decode_vid_heap_info(params)
    block = min(info.size, free)
    if (info.total, info.free, info.size) == (total, free, block):
        return None
    out = bytearray(params)
    _U64.pack_into(out, _INFO_TOTAL, total)
    _U64.pack_into(out, _INFO_FREE, free)
    _U64.pack_into(out, _INFO_SIZE, block)
    return bytes(out)


_U64 = struct.Struct("=Q")
_INFO_TOTAL, _INFO_FREE, _INFO_SIZE = (NVOS32_INFO.offsets[f] for f in ("total", "free", "size"))
