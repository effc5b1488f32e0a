"""NVIDIA param layouts: sizes and offsets pinned from the ABI facts, and checked
with gcc against C mirrors written from nvos.h (NvU64/NvP64 8-byte aligned).
The modules' own definitions (kmod/include/nvidia/) are checked against the same
layouts and against the numbers of vgpud/nvidia/escapes.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.layouts import ROOT, c_layouts, needs_gcc, py_layouts, run_c
from vgpud.nvidia import escapes as E
from vgpud.nvidia import layouts as L
from vgpud.policy import sched

KMOD_INCLUDE = ROOT / "kmod/include"
KMOD_HEADERS = ("nvidia/nv_ioctl.h", "nvidia/nv_rm.h", "nvidia/nv_status.h")

SIZES = {
    "NVOS00_PARAMETERS": 16,
    "NVOS21_PARAMETERS": 32,
    "NVOS64_PARAMETERS": 48,
    "NVOS54_PARAMETERS": 32,
    "nv_ioctl_nvos33_parameters_with_fd": 56,
    "nv_ioctl_nvos02_parameters_with_fd": 56,
    "NVOS32_PARAMETERS": 184,
    "NVOS32_TILED_PARAMETERS": 184,
    "NVOS32_RANGE_PARAMETERS": 184,
    "NVOS32_INFO_PARAMETERS": 184,
    "NVOS55_PARAMETERS": 28,
    "NV_MEMORY_ALLOCATION_PARAMS": 128,
    "NV0080_ALLOC_PARAMETERS": 56,
    "NV2080_CTRL_FB_INFO": 8,
    "NV2080_CTRL_FB_GET_INFO_PARAMS": 16,
    "NV2080_CTRL_FB_GET_INFO_V2_PARAMS": 1028,
}

OFFSETS = {
    "NVOS00_PARAMETERS": dict(hRoot=0, hObjectParent=4, hObjectOld=8, status=12),
    "NVOS21_PARAMETERS": dict(hRoot=0, hObjectParent=4, hObjectNew=8, hClass=12,
                              pAllocParms=16, paramsSize=24, status=28),
    "NVOS64_PARAMETERS": dict(hClass=12, pAllocParms=16, pRightsRequested=24, paramsSize=32,
                              flags=36, status=40),
    "NVOS54_PARAMETERS": dict(hClient=0, hObject=4, cmd=8, flags=12, params=16, paramsSize=24,
                              status=28),
    "nv_ioctl_nvos33_parameters_with_fd": dict(hClient=0, hDevice=4, hMemory=8, offset=16,
                                               length=24, pLinearAddress=32, status=40,
                                               flags=44, fd=48),
    "nv_ioctl_nvos02_parameters_with_fd": dict(hClass=12, flags=16, pMemory=24, limit=32,
                                               status=40, fd=48),
    "NVOS32_PARAMETERS": dict(function=8, hVASpace=12, ivcHeapNumber=16, status=20, total=24,
                              free=32, owner=40, hMemory=44, type=48, flags=52, attr=56,
                              size=88, alignment=96, offset=104, attr2=144, ctagOffset=148),
    "NVOS32_TILED_PARAMETERS": dict(function=8, status=20, owner=40, hMemory=44, flags=52,
                                    height=56, pitch=60, attr=64, width=68, size=88,
                                    alignment=96, offset=104, limit=112, address=120,
                                    rangeBegin=128, rangeEnd=136, attr2=144, ctagOffset=148,
                                    numaNode=152),
    "NVOS32_RANGE_PARAMETERS": dict(function=8, status=20, owner=40, hMemory=44, flags=52,
                                    attr=56, partitionStride=72, size=80, alignment=88,
                                    offset=96, limit=104, rangeBegin=112, rangeEnd=120,
                                    address=128, attr2=136, ctagOffset=140, numaNode=144),
    "NVOS32_INFO_PARAMETERS": dict(function=8, status=20, total=24, free=32, attr=40,
                                   offset=48, size=56, base=64),
    "NVOS55_PARAMETERS": dict(hClient=0, hParent=4, hObject=8, hClientSrc=12, hObjectSrc=16,
                              flags=20, status=24),
    "NV_MEMORY_ALLOCATION_PARAMS": dict(owner=0, type=4, flags=8, attr=24, attr2=28,
                                        rangeLo=48, rangeHi=56, size=64, alignment=72,
                                        offset=80, limit=88, address=96, ctagOffset=104,
                                        hVASpace=108, internalflags=112, tag=116,
                                        numaNode=120),
    "NV0080_ALLOC_PARAMETERS": dict(deviceId=0, hClientShare=4, hTargetClient=8,
                                    hTargetDevice=12, flags=16, vaSpaceSize=24,
                                    vaStartInternal=32, vaLimitInternal=40, vaMode=48),
    "NV2080_CTRL_FB_INFO": dict(index=0, data=4),
    "NV2080_CTRL_FB_GET_INFO_PARAMS": dict(fbInfoListSize=0, fbInfoList=8),
    "NV2080_CTRL_FB_GET_INFO_V2_PARAMS": dict(fbInfoListSize=0, fbInfoList=4),
}

# C mirrors, written from nvos.h (open-gpu-kernel-modules). NVOS32's union is
# flattened to its AllocSize member (NVOS32_PARAMETERS), its AllocTiledPitchHeight
# (NVOS32_TILED_PARAMETERS), AllocSizeRange (NVOS32_RANGE_PARAMETERS) or Info
# member (NVOS32_INFO_PARAMETERS) plus the padding that its largest member (HwAlloc,
# 144 B) implies; the union itself is sized below in C.
C_MIRRORS = r"""
#include <stdint.h>
typedef uint32_t NvU32; typedef int32_t NvS32; typedef int16_t NvS16;
typedef uint64_t NvU64 __attribute__((aligned(8)));
typedef NvU32 NvHandle; typedef NvU32 NvV32; typedef NvU64 NvP64;
typedef struct { NvHandle hRoot, hObjectParent, hObjectOld; NvV32 status; } NVOS00_PARAMETERS;
typedef struct { NvHandle hRoot, hObjectParent, hObjectNew; NvV32 hClass; NvP64 pAllocParms;
  NvU32 paramsSize; NvV32 status; } NVOS21_PARAMETERS;
typedef struct { NvHandle hRoot, hObjectParent, hObjectNew; NvV32 hClass; NvP64 pAllocParms;
  NvP64 pRightsRequested; NvU32 paramsSize, flags; NvV32 status; } NVOS64_PARAMETERS;
typedef struct { NvHandle hClient, hObject; NvV32 cmd; NvU32 flags; NvP64 params;
  NvU32 paramsSize; NvV32 status; } NVOS54_PARAMETERS;
typedef struct { NvHandle hClient, hDevice, hMemory; NvU64 offset, length; NvP64 pLinearAddress;
  NvU32 status, flags; } NVOS33_PARAMETERS;
typedef struct { NVOS33_PARAMETERS params; int fd; } nv_ioctl_nvos33_parameters_with_fd_c;
typedef struct { NvHandle hClient, hDevice, hMemory; NvU32 pad0; NvU64 offset, length;
  NvP64 pLinearAddress; NvU32 status, flags; int fd; } nv_ioctl_nvos33_parameters_with_fd;
typedef struct { NvHandle hRoot, hObjectParent, hObjectNew; NvV32 hClass, flags; NvP64 pMemory;
  NvU64 limit; NvV32 status; } NVOS02_PARAMETERS;
typedef struct { NVOS02_PARAMETERS params; int fd; } nv_ioctl_nvos02_parameters_with_fd_c;
typedef struct { NvHandle hRoot, hObjectParent, hObjectNew; NvV32 hClass, flags; NvP64 pMemory;
  NvU64 limit; NvV32 status; NvU32 pad1; int fd; } nv_ioctl_nvos02_parameters_with_fd;
struct hw_alloc { NvU32 allocOwner; NvHandle allochMemory; NvU32 flags, allocType, allocAttr,
  allocInputFlags; NvU64 allocSize; NvU32 allocHeight, allocWidth, allocPitch, allocMask,
  allocComprCovg, allocZcullCovg; NvP64 bindResultFunc, pHandle; NvHandle hResourceHandle;
  NvU32 retAttr, kind; NvU64 osDeviceHandle; NvU32 allocAttr2, retAttr2; NvU64 allocAddr;
  struct { NvU32 a, b, c, d, e, f; } comprInfo; NvU32 uncompressedKind; };
struct alloc_size { NvU32 owner; NvHandle hMemory; NvU32 type, flags, attr, format, comprCovg,
  zcullCovg, partitionStride, width, height; NvU64 size, alignment, offset, limit;
  NvP64 address; NvU64 rangeBegin, rangeEnd; NvU32 attr2, ctagOffset; };
struct alloc_tiled { NvU32 owner; NvHandle hMemory; NvU32 type, flags, height; NvS32 pitch;
  NvU32 attr, width, format, comprCovg, zcullCovg, partitionStride; NvU64 size, alignment,
  offset, limit; NvP64 address; NvU64 rangeBegin, rangeEnd; NvU32 attr2, ctagOffset;
  NvS32 numaNode; };
struct alloc_range { NvU32 owner; NvHandle hMemory; NvU32 type, flags, attr, format, comprCovg,
  zcullCovg, partitionStride; NvU64 size, alignment, offset, limit, rangeBegin, rangeEnd;
  NvP64 address; NvU32 attr2, ctagOffset; NvS32 numaNode; };
struct info { NvU32 attr; NvU64 offset, size, base; };
typedef struct { NvHandle hRoot, hObjectParent; NvU32 function; NvHandle hVASpace;
  NvS16 ivcHeapNumber; NvV32 status; NvU64 total, free;
  union { struct alloc_size AllocSize; struct alloc_tiled AllocTiledPitchHeight;
    struct alloc_range AllocSizeRange; struct info Info; struct hw_alloc HwAlloc; } data;
} NVOS32_REAL;
typedef struct { NvHandle hRoot, hObjectParent; NvU32 function; NvHandle hVASpace;
  NvS16 ivcHeapNumber; NvV32 status; NvU64 total, free;
  NvU32 owner; NvHandle hMemory; NvU32 type, flags, height; NvS32 pitch;
  NvU32 attr, width, format, comprCovg, zcullCovg, partitionStride; NvU64 size, alignment,
  offset, limit; NvP64 address; NvU64 rangeBegin, rangeEnd; NvU32 attr2, ctagOffset;
  NvS32 numaNode;
  char tail[sizeof(struct hw_alloc) - sizeof(struct alloc_tiled)]; } NVOS32_TILED_PARAMETERS;
typedef struct { NvHandle hRoot, hObjectParent; NvU32 function; NvHandle hVASpace;
  NvS16 ivcHeapNumber; NvV32 status; NvU64 total, free;
  NvU32 owner; NvHandle hMemory; NvU32 type, flags, attr, format, comprCovg,
  zcullCovg, partitionStride; NvU64 size, alignment, offset, limit, rangeBegin, rangeEnd;
  NvP64 address; NvU32 attr2, ctagOffset; NvS32 numaNode;
  char tail[sizeof(struct hw_alloc) - sizeof(struct alloc_range)]; } NVOS32_RANGE_PARAMETERS;
typedef struct { NvHandle hRoot, hObjectParent; NvU32 function; NvHandle hVASpace;
  NvS16 ivcHeapNumber; NvV32 status; NvU64 total, free;
  NvU32 attr; NvU64 offset, size, base;
  char tail[sizeof(struct hw_alloc) - sizeof(struct info)]; } NVOS32_INFO_PARAMETERS;
typedef struct { NvHandle hRoot, hObjectParent; NvU32 function; NvHandle hVASpace;
  NvS16 ivcHeapNumber; NvV32 status; NvU64 total, free;
  NvU32 owner; NvHandle hMemory; NvU32 type, flags, attr, format, comprCovg,
  zcullCovg, partitionStride, width, height; NvU64 size, alignment, offset, limit;
  NvP64 address; NvU64 rangeBegin, rangeEnd; NvU32 attr2, ctagOffset;
  char tail[sizeof(struct hw_alloc) - sizeof(struct alloc_size)]; } NVOS32_PARAMETERS;
typedef struct { NvHandle hClient, hParent, hObject, hClientSrc, hObjectSrc; NvU32 flags, status;
} NVOS55_PARAMETERS;
typedef struct { NvU32 owner, type, flags, width, height; NvS32 pitch; NvU32 attr, attr2, format,
  comprCovg, zcullCovg; NvU64 rangeLo, rangeHi, size, alignment, offset, limit; NvP64 address;
  NvU32 ctagOffset; NvHandle hVASpace; NvU32 internalflags, tag; NvS32 numaNode;
} NV_MEMORY_ALLOCATION_PARAMS;
typedef struct { NvU32 deviceId; NvHandle hClientShare, hTargetClient, hTargetDevice;
  NvV32 flags; NvU64 vaSpaceSize, vaStartInternal, vaLimitInternal; NvV32 vaMode;
} NV0080_ALLOC_PARAMETERS;
typedef struct { NvU32 index, data; } NV2080_CTRL_FB_INFO;
typedef struct { NvU32 fbInfoListSize; NvP64 fbInfoList; } NV2080_CTRL_FB_GET_INFO_PARAMS;
typedef struct { NvU32 fbInfoListSize; NV2080_CTRL_FB_INFO fbInfoList[128];
} NV2080_CTRL_FB_GET_INFO_V2_PARAMS;
_Static_assert(sizeof(NVOS32_REAL) == sizeof(NVOS32_PARAMETERS), "NVOS32 flattening");
_Static_assert(offsetof(NVOS32_REAL, data) == 40, "NVOS32 union offset");
_Static_assert(sizeof(NVOS32_REAL) == sizeof(NVOS32_INFO_PARAMETERS), "NVOS32 Info flattening");
_Static_assert(sizeof(NVOS32_REAL) == sizeof(NVOS32_TILED_PARAMETERS), "NVOS32 tiled flattening");
_Static_assert(sizeof(NVOS32_REAL) == sizeof(NVOS32_RANGE_PARAMETERS), "NVOS32 range flattening");
_Static_assert(offsetof(NVOS32_REAL, data.AllocTiledPitchHeight.numaNode)
               == offsetof(NVOS32_TILED_PARAMETERS, numaNode), "NVOS32 tiled numaNode");
_Static_assert(offsetof(NVOS32_REAL, data.AllocSizeRange.size)
               == offsetof(NVOS32_RANGE_PARAMETERS, size), "NVOS32 range size");
_Static_assert(offsetof(NVOS32_REAL, data.AllocSizeRange.numaNode)
               == offsetof(NVOS32_RANGE_PARAMETERS, numaNode), "NVOS32 range numaNode");
_Static_assert(offsetof(NVOS32_REAL, data.Info.size) == offsetof(NVOS32_INFO_PARAMETERS, size),
               "NVOS32 Info.size");
_Static_assert(sizeof(nv_ioctl_nvos33_parameters_with_fd_c)
               == sizeof(nv_ioctl_nvos33_parameters_with_fd), "with_fd 33");
_Static_assert(sizeof(nv_ioctl_nvos02_parameters_with_fd_c)
               == sizeof(nv_ioctl_nvos02_parameters_with_fd), "with_fd 02");
_Static_assert(offsetof(nv_ioctl_nvos33_parameters_with_fd_c, fd)
               == offsetof(nv_ioctl_nvos33_parameters_with_fd, fd), "fd 33");
_Static_assert(offsetof(nv_ioctl_nvos02_parameters_with_fd_c, fd)
               == offsetof(nv_ioctl_nvos02_parameters_with_fd, fd), "fd 02");
"""

# KEPLER_CHANNEL_GROUP_A control params (ctrla06c.h) that SchedPolicy answers.
CONTROL_SIZES = {
    "NVA06C_CTRL_TIMESLICE_PARAMS": 8,
    "NVA06C_CTRL_PREEMPT_PARAMS": 8,
    "NVA06C_CTRL_INTERLEAVE_LEVEL_PARAMS": 4,
}
CONTROL_OFFSETS = {
    "NVA06C_CTRL_TIMESLICE_PARAMS": dict(timesliceUs=0),
    "NVA06C_CTRL_PREEMPT_PARAMS": dict(bWait=0, bManualTimeout=1, timeoutUs=4),
    "NVA06C_CTRL_INTERLEAVE_LEVEL_PARAMS": dict(tsgInterleaveLevel=0),
}
CONTROL_MIRRORS = r"""
#include <stdint.h>
typedef uint8_t NvBool; typedef uint32_t NvU32;
typedef uint64_t NvU64 __attribute__((aligned(8)));
typedef struct { NvU64 timesliceUs; } NVA06C_CTRL_TIMESLICE_PARAMS;
typedef struct { NvBool bWait; NvBool bManualTimeout; NvU32 timeoutUs; }
  NVA06C_CTRL_PREEMPT_PARAMS;
typedef struct { NvU32 tsgInterleaveLevel; } NVA06C_CTRL_INTERLEAVE_LEVEL_PARAMS;
"""
# The modules' structs of those (nv_rm.h); the interleave level's has none.
KMOD_CONTROL_STRUCTS = {"NVA06C_CTRL_TIMESLICE_PARAMS": "nva06c_timeslice_params",
                        "NVA06C_CTRL_PREEMPT_PARAMS": "nva06c_preempt_params"}


@needs_gcc
def test_layouts_match_gcc(tmp_path: Path) -> None:
    assert py_layouts(L.LAYOUTS) == c_layouts(tmp_path, "", L.LAYOUTS, C_MIRRORS)


def test_sizes_pinned() -> None:
    assert {lay.name: lay.size for lay in L.LAYOUTS} == SIZES


def test_control_layouts_pinned() -> None:
    assert {lay.name: lay.size for lay in L.TSG_CONTROL_LAYOUTS} == CONTROL_SIZES
    assert {lay.name: lay.offsets for lay in L.TSG_CONTROL_LAYOUTS} == CONTROL_OFFSETS


@needs_gcc
def test_control_layouts_match_gcc(tmp_path: Path) -> None:
    assert py_layouts(L.TSG_CONTROL_LAYOUTS) == c_layouts(
        tmp_path, "", L.TSG_CONTROL_LAYOUTS, CONTROL_MIRRORS)


def test_control_decoders() -> None:
    assert L.decode_timeslice(L.encode_timeslice(2**64 - 1)) == 2**64 - 1
    assert L.decode_preempt(b"\x01\x00\xff\xff\x40\x42\x0f\x00") == \
        L.PreemptParams(wait=True, manual_timeout=False, timeout_us=1_000_000)
    assert L.decode_preempt(b"\x00\x07" + bytes(6)).manual_timeout is True
    for short_or_long in (bytes(7), bytes(9), b""):
        with pytest.raises(L.DecodeError):
            L.decode_timeslice(short_or_long)
        with pytest.raises(L.DecodeError):
            L.decode_preempt(short_or_long)


@pytest.mark.parametrize("name", sorted(OFFSETS))
def test_offsets_pinned(name: str) -> None:
    layout = next(lay for lay in L.LAYOUTS if lay.name == name)
    assert {f: layout.offsets[f] for f in OFFSETS[name]} == OFFSETS[name]


# The modules' structs for NVIDIA's: field names in lower case with underscores
# (hObjectNew: h_object_new), NVOS32's union members named.
KMOD_STRUCTS = {
    "NVOS00_PARAMETERS": "nvos00", "NVOS21_PARAMETERS": "nvos21",
    "NVOS64_PARAMETERS": "nvos64", "NVOS54_PARAMETERS": "nvos54",
    "nv_ioctl_nvos33_parameters_with_fd": "nvos33_with_fd",
    "nv_ioctl_nvos02_parameters_with_fd": "nvos02_with_fd",
    "NVOS32_PARAMETERS": "nvos32", "NVOS32_INFO_PARAMETERS": "nvos32",
    "NVOS32_TILED_PARAMETERS": "nvos32", "NVOS32_RANGE_PARAMETERS": "nvos32",
    "NVOS55_PARAMETERS": "nvos55",
    "NV_MEMORY_ALLOCATION_PARAMS": "nv_memory_allocation_params",
    "NV0080_ALLOC_PARAMETERS": "nv0080_alloc_params", "NV2080_CTRL_FB_INFO": "nv2080_fb_info",
    "NV2080_CTRL_FB_GET_INFO_PARAMS": "nv2080_fb_get_info_params",
    "NV2080_CTRL_FB_GET_INFO_V2_PARAMS": "nv2080_fb_get_info_v2_params",
}
KMOD_FIELDS = {"internalflags": "internal_flags", "fbInfoListSize": "list_size",
               "fbInfoList": "list"}
NVOS32_UNION = {"NVOS32_PARAMETERS": "data.alloc_size.", "NVOS32_INFO_PARAMETERS": "data.info.",
                "NVOS32_TILED_PARAMETERS": "data.alloc_tiled.",
                "NVOS32_RANGE_PARAMETERS": "data.alloc_range."}
NVOS32_HEAD = frozenset({"hRoot", "hObjectParent", "function", "hVASpace", "ivcHeapNumber",
                         "status", "total", "free"})

# Layouts that only the modules use (the daemon has no CStruct for them), from
# the ABI facts: the XFER wrapper, REGISTER_FD's params, GPFIFO_SCHEDULE's.
KMOD_ONLY = {
    "nv_ioctl_xfer": (16, dict(cmd=0, size=4, ptr=8)),
    "nv_register_fd": (4, dict(ctl_fd=0)),
    "nva06c_gpfifo_schedule_params": (3, dict(b_enable=0, b_skip_submit=1, b_skip_enable=2)),
    # NV00F8_ALLOCATION_PARAMETERS (cl00f8.h), nvsim's NV_MEMORY_FABRIC.
    "nv00f8_allocation_params": (48, dict(alignment=0, alloc_size=8, page_size=16,
                                          alloc_flags=24, map_offset=32, map_h_vid_mem=40,
                                          map_flags=44)),
    # The driver's truth (VGPU_CMD_OBJECT), from ctrl0000client.h and ctrl0041.h:
    # NV0000_CTRL_CLIENT_GET_HANDLE_INFO_PARAMS {hObject; index; union data (u64)},
    # NV0041_CTRL_GET_SURFACE_INFO_PARAMS {surfaceInfoListSize; NvP64 surfaceInfoList},
    # NV0041_CTRL_SURFACE_INFO {index; data}.
    "nv0000_client_get_handle_info_params": (16, dict(h_object=0, index=4, data=8)),
    "nv0041_get_surface_info_params": (16, dict(surface_info_list_size=0,
                                                surface_info_list=8)),
    "nv0041_surface_info": (8, dict(index=0, data=4)),
}

# Numbers of the driver's truth and of page sizes (ctrl0000client.h, ctrl0041.h,
# nvos.h), as the modules define them.
KMOD_TRUTH_NUMBERS = {
    "NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO": 0xD02,
    "NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO_INDEX_PARENT": 1,
    "NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO_INDEX_CLASSID": 2,
    "NV0041_CTRL_CMD_GET_SURFACE_INFO": 0x410110,
    "NV0041_CTRL_SURFACE_INFO_INDEX_PHYS_SIZE": 7,
    "NV0041_CTRL_SURFACE_INFO_PHYS_SIZE_SCALE_FACTOR": 0x1000,
    "NVOS32_ATTR_PAGE_SIZE_SHIFT": 23,
    "NVOS32_ATTR_PAGE_SIZE_BIG": 2,
    "NVOS32_ATTR_PAGE_SIZE_HUGE": 3,
    "NVOS32_ATTR2_PAGE_SIZE_HUGE_SHIFT": 20,
    "NVOS32_ATTR2_PAGE_SIZE_HUGE_2MB": 1,
    "NVOS32_ATTR2_PAGE_SIZE_HUGE_512MB": 2,
}

KMOD_PRELUDE = """
#include <stdint.h>
typedef uint8_t u8; typedef uint16_t u16; typedef uint32_t u32; typedef uint64_t u64;
typedef int16_t s16; typedef int32_t s32;
""" + "".join(f"#include <{h}>\n" for h in KMOD_HEADERS) + """
#include <stdio.h>
#include <stddef.h>
"""


def kmod_field(layout: str, field: str) -> str:
    if layout in NVOS32_UNION and field not in NVOS32_HEAD:
        return NVOS32_UNION[layout] + kmod_field("", field)
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", field).lower()
    return KMOD_FIELDS.get(field, snake)


def kmod_program(items: list[tuple[str, str]]) -> str:
    body = "".join(f'printf("%s %lld\\n", "{key}", (long long)({expr}));\n'
                   for key, expr in items)
    return KMOD_PRELUDE + "int main(void) {\n" + body + "return 0; }\n"


@needs_gcc
def test_kmod_structs_match_nvidia(tmp_path: Path) -> None:
    items, want = [], py_layouts(L.LAYOUTS)
    for lay in L.LAYOUTS:
        tag = f"struct {KMOD_STRUCTS[lay.name]}"
        items.append((lay.name, f"sizeof({tag})"))
        items += [(f"{lay.name}.{f}", f"offsetof({tag}, {kmod_field(lay.name, f)})")
                  for f in lay.offsets]
    for lay in L.TSG_CONTROL_LAYOUTS:
        if (kmod := KMOD_CONTROL_STRUCTS.get(lay.name)) is not None:
            want |= py_layouts([lay])
            items.append((lay.name, f"sizeof(struct {kmod})"))
            items += [(f"{lay.name}.{f}", f"offsetof(struct {kmod}, {kmod_field('', f)})")
                      for f in lay.offsets]
    for name, (size, offsets) in KMOD_ONLY.items():
        items.append((name, f"sizeof(struct {name})"))
        want[name] = size
        for f, off in offsets.items():
            items.append((f"{name}.{f}", f"offsetof(struct {name}, {f})"))
            want[f"{name}.{f}"] = off
    assert run_c(tmp_path, kmod_program(items), KMOD_INCLUDE) == want


def _py_numbers() -> dict[str, int]:
    """The daemon's value of every number both sides name, by the header's name."""
    out = {"NV_IOCTL_MAGIC": E.IOCTL_MAGIC, "NV_ABSOLUTE_MAX_IOCTL_SIZE": E.XFER_SIZE_MAX,
           "UVM_INITIALIZE": E.UvmCmd.INITIALIZE,
           "NV2080_CTRL_FB_INFO_MAX_LIST_SIZE": E.FB_INFO_MAX_LIST_SIZE,
           "NVOS32_ALLOC_FLAGS_VIRTUAL": E.NVOS32_ALLOC_FLAGS_VIRTUAL,
           "NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED":
               E.NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED,
           "NVOS32_ALLOC_FLAGS_USE_BEGIN_END": E.NVOS32_ALLOC_FLAGS_USE_BEGIN_END,
           "NV_OK": E.NvStatus.OK, "NV01_ROOT_CLIENT": E.NvClass.ROOT_CLIENT,
           "NV01_DEVICE_0": E.NvClass.DEVICE_0, "NV20_SUBDEVICE_0": E.NvClass.SUBDEVICE_0,
           "NV01_MEMORY_SYSTEM": E.NvClass.MEMORY_SYSTEM,
           "NV01_MEMORY_LOCAL_PRIVILEGED": E.NvClass.MEMORY_LOCAL_PRIVILEGED,
           "NV01_MEMORY_LOCAL_USER": E.NvClass.MEMORY_LOCAL_USER,
           "NV_MEMORY_FABRIC": E.MemClass.FABRIC}
    out |= {f"NV_ESC_{e.name}": e for e in E.Escape}
    out |= {f"NV_ERR_{s.name}": s for s in E.NvStatus if s}
    out |= {c.name: c for c in (E.NvClass.NV50_MEMORY_VIRTUAL, E.NvClass.FERMI_VASPACE_A,
                                 E.NvClass.KEPLER_CHANNEL_GROUP_A)}
    out |= {f"NV2080_CTRL_CMD_{c.name}": c for c in (E.Ctrl.FB_GET_INFO, E.Ctrl.FB_GET_INFO_V2)}
    out |= {f"NVA06C_CTRL_CMD_{c.name}": c for c in (
        E.Ctrl.GPFIFO_SCHEDULE, E.Ctrl.SET_TIMESLICE, E.Ctrl.GET_TIMESLICE, E.Ctrl.PREEMPT,
        E.Ctrl.SET_INTERLEAVE_LEVEL, E.Ctrl.GET_INTERLEAVE_LEVEL)}
    out |= {"NVA06C_DEFAULT_TIMESLICE_US": sched.DEFAULT_TIMESLICE_US,
            "NVA06C_CTRL_CMD_PREEMPT_MAX_MANUAL_TIMEOUT_US": sched.MAX_PREEMPT_TIMEOUT_US}
    out |= {f"NV2080_CTRL_FB_INFO_INDEX_{i.name}": i for i in E.FbInfoIndex}
    out |= {f"NVOS32_FUNCTION_{f.name}": f for f in E.VidHeapFunction}
    return {k: int(v) for k, v in out.items()}


@needs_gcc
def test_kmod_numbers_match_daemon(tmp_path: Path) -> None:
    text = "".join((KMOD_INCLUDE / h).read_text() for h in KMOD_HEADERS)
    defined = set(re.findall(r"^#define\s+(NV\w+|UVM_\w+|[A-Z]+_CHANNEL_GROUP_A|FERMI_\w+)\s",
                             text, flags=re.M))
    py = _py_numbers()
    both = sorted(defined & py.keys())
    # Every escape the modules name, and the numbers vgpu acts on, are compared.
    assert {n for n in defined if n.startswith("NV_ESC_")} <= set(both)
    assert {"NV_IOCTL_MAGIC", "KEPLER_CHANNEL_GROUP_A", "NVA06C_CTRL_CMD_GPFIFO_SCHEDULE",
            "NV_ERR_NO_MEMORY", "NVA06C_DEFAULT_TIMESLICE_US"} <= set(both)
    got = run_c(tmp_path, kmod_program([(n, n) for n in both]), KMOD_INCLUDE)
    assert got == {n: py[n] for n in both}


@needs_gcc
def test_kmod_truth_numbers(tmp_path: Path) -> None:
    items = [(n, n) for n in KMOD_TRUTH_NUMBERS]
    assert run_c(tmp_path, kmod_program(items), KMOD_INCLUDE) == KMOD_TRUTH_NUMBERS


def test_vgpu_includes_nothing_of_nvsim() -> None:
    """The production module and the shared headers never reach into the simulator."""
    sources = [*(ROOT / "kmod/vgpu").glob("*.[ch]"), *(ROOT / "kmod/include").rglob("*.h")]
    assert len(sources) > 10
    for src in sources:
        includes = re.findall(r'^#\s*include\s+[<"]([^>"]+)[>"]', src.read_text(), flags=re.M)
        assert not [i for i in includes if "nvsim" in i], src
    assert "nvsim" not in (ROOT / "kmod/vgpu/Kbuild").read_text()
