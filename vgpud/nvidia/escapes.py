"""NVIDIA escape numbers, object classes, statuses and control ids.

Numbers from docs nvidia-abi-facts.md (open-gpu-kernel-modules 595.45.04).
"""

from __future__ import annotations

from enum import IntEnum

IOCTL_MAGIC = ord("F")
XFER_SIZE_MAX = 16384

_IOC_NRBITS, _IOC_TYPEBITS, _IOC_SIZEBITS = 8, 8, 14
_IOC_TYPESHIFT = _IOC_NRBITS
_IOC_SIZESHIFT = _IOC_TYPESHIFT + _IOC_TYPEBITS
_IOC_DIRSHIFT = _IOC_SIZESHIFT + _IOC_SIZEBITS
_IOC_READ_WRITE = 3


def iowr(nr: int, size: int) -> int:
    """The command word ``_IOWR('F', nr, size)`` that callers issue."""
    if not 0 <= size < 1 << _IOC_SIZEBITS:
        raise ValueError(f"size {size} does not fit _IOC_SIZE; use IOCTL_XFER_CMD")
    return (_IOC_READ_WRITE << _IOC_DIRSHIFT | size << _IOC_SIZESHIFT
            | IOCTL_MAGIC << _IOC_TYPESHIFT | nr)


def ioc_nr(cmd: int) -> int:
    return cmd & ((1 << _IOC_NRBITS) - 1)


def ioc_size(cmd: int) -> int:
    return (cmd >> _IOC_SIZESHIFT) & ((1 << _IOC_SIZEBITS) - 1)


class Escape(IntEnum):
    """``_IOC_NR`` of the escapes on /dev/nvidiactl and /dev/nvidiaN."""

    RM_ALLOC_MEMORY = 0x27
    RM_FREE = 0x29
    RM_CONTROL = 0x2A
    RM_ALLOC = 0x2B
    RM_DUP_OBJECT = 0x34
    RM_SHARE = 0x35
    RM_VID_HEAP_CONTROL = 0x4A
    RM_MAP_MEMORY = 0x4E
    RM_UNMAP_MEMORY = 0x4F
    RM_MAP_MEMORY_DMA = 0x57
    RM_UNMAP_MEMORY_DMA = 0x58
    CARD_INFO = 200
    REGISTER_FD = 201
    ALLOC_OS_EVENT = 206
    FREE_OS_EVENT = 207
    CHECK_VERSION_STR = 210
    IOCTL_XFER_CMD = 211
    ATTACH_GPUS_TO_FD = 212
    SYS_PARAMS = 214
    EXPORT_TO_DMABUF_FD = 217
    WAIT_OPEN_COMPLETE = 218


class UvmCmd(IntEnum):
    """nvidia-uvm command numbers (plain integers, not _IOC encoded)."""

    INITIALIZE = 0x30000001
    REGISTER_GPU_VASPACE = 25
    REGISTER_CHANNEL = 27
    MAP_EXTERNAL_ALLOCATION = 33
    FREE = 34
    REGISTER_GPU = 37
    SET_PREFERRED_LOCATION = 42
    ENABLE_READ_DUPLICATION = 44
    SET_ACCESSED_BY = 46
    MIGRATE = 51
    MIGRATE_RANGE_GROUP = 53
    ALLOC_SEMAPHORE_POOL = 68
    CREATE_EXTERNAL_RANGE = 73


class NvClass(IntEnum):
    ROOT_CLIENT = 0x41
    DEVICE_0 = 0x80
    SUBDEVICE_0 = 0x2080
    FERMI_VASPACE_A = 0x90F1
    NV01_ROOT = 0x0
    NV01_ROOT_NON_PRIV = 0x1
    MEMORY_LOCAL_PRIVILEGED = 0x3F
    MEMORY_LOCAL_USER = 0x40
    MEMORY_SYSTEM = 0x3E
    MEMORY_VIRTUAL = 0x70
    MEMORY_SYSTEM_OS_DESCRIPTOR = 0x71
    NV50_MEMORY_VIRTUAL = 0x50A0
    MEMORY_FABRIC = 0xF8
    MEMORY_MULTICAST_FABRIC = 0xFD
    KEPLER_CHANNEL_GROUP_A = 0xA06C
    FERMI_CONTEXT_SHARE_A = 0x9067
    AMPERE_CHANNEL_GPFIFO_A = 0xC56F
    HOPPER_CHANNEL_GPFIFO_A = 0xC86F
    BLACKWELL_CHANNEL_GPFIFO_A = 0xC96F


# Classes whose allocation takes device memory (charged against a quota).
DEVICE_MEMORY_CLASSES = frozenset({NvClass.MEMORY_LOCAL_USER, NvClass.MEMORY_LOCAL_PRIVILEGED})


class MemClass(IntEnum):
    """Every memory class of RM's resource table (resource_list.h, g_allclasses.h,
    595.45.04) that vgpud does not charge; what each does with it is in
    docs/architecture.md (Memory the quota sees, path by path)."""

    SYSTEM = 0x3E  # host pages (sysmemConstruct)
    EXTENDED_USER = 0x42  # video memory (ExtendedGpuMemory), the LOCAL_USER constructor
    VIRTUAL = 0x70  # a VA range (VirtualMemoryRange)
    SYSTEM_OS_DESCRIPTOR = 0x71  # the caller's own pages
    FRAMEBUFFER_CONSOLE = 0x76  # kernel-privileged
    LIST_SYSTEM = 0x81  # privileged
    LIST_FBMEM = 0x82  # privileged
    LIST_OBJECT = 0x83  # privileged
    HW_RESOURCES = 0xB1  # compression / HW resources over video memory
    LOCAL_PHYSICAL = 0xC2  # privileged: raw video memory
    SYNCPOINT = 0xC3  # Tegra syncpoints
    EXPORT = 0xE0  # a fabric export of memory already held
    IMEX_SESSION = 0xF1  # fabric import/export daemon session
    FLA = 0xF3  # memory of another GPU over the fabric address
    FABRIC = 0xF8  # video memory for the fabric (MemoryFabric)
    FABRIC_IMPORT_V2 = 0xF9  # fabric memory of another process or node
    FABRIC_IMPORTED_REF = 0xFB
    MULTICAST_FABRIC = 0xFD  # multicast video memory across GPUs
    MAPPER = 0xFE  # maps memory already held
    NV50_VIRTUAL = 0x50A0  # a VA range in a VA space (VirtualMemory)
    DEVICELESS = 0x90CE  # host pages without a device (NoDeviceMemory)


# Memory classes that pass uncharged, each for its reason: host memory over
# pages the kernel charges to the caller, or an address range and no memory.
UNCHARGED_MEMORY_CLASSES = frozenset({MemClass.SYSTEM, MemClass.VIRTUAL,
                                      MemClass.SYSTEM_OS_DESCRIPTOR, MemClass.NV50_VIRTUAL,
                                      MemClass.DEVICELESS})
# Every other memory class is refused, as the driver refuses a class it has
# no constructor for (NV_ERR_INVALID_CLASS): the fabric family (video memory
# the ledger does not size, or memory of another process, GPU or node), the
# privileged ones a tenant cannot use anyway, and EXTENDED_USER / HW_RESOURCES
# (video memory through parameters the ledger does not decode).
REFUSED_MEMORY_CLASSES = frozenset(MemClass) - UNCHARGED_MEMORY_CLASSES
# RM's memory classes are numbered below 0x100 (cl00XX), but for the two VA
# classes and DEVICELESS: a class there that vgpud does not know is refused.
SYSTEM_CLASS_RANGE = range(0x100)


class ChannelClass(IntEnum):
    """Channel (GPFIFO) classes: each channel has an instance block, USERD and,
    with its engine objects, context buffers in video memory."""

    GF100 = 0x906F
    KEPLER_A = 0xA06F
    KEPLER_B = 0xA16F
    MAXWELL_A = 0xB06F
    PASCAL_A = 0xC06F
    VOLTA_A = 0xC36F
    TURING_A = 0xC46F
    AMPERE_A = 0xC56F
    HOPPER_A = 0xC86F
    BLACKWELL_A = 0xC96F
    BLACKWELL_B = 0xCA6F


# Classes below 0x100 that are objects, not memory: they pass.
SYSTEM_OBJECT_CLASSES = frozenset({
    NvClass.NV01_ROOT, NvClass.NV01_ROOT_NON_PRIV, NvClass.ROOT_CLIENT,
    0x02,  # NV01_CONTEXT_DMA: a view of memory already held
    0x04,  # NV01_TIMER
    0x05,  # NV01_EVENT
    0x20,  # NV0020_GPU_MANAGEMENT
    0x30,  # NV01_NULL
    0x50,  # NV_CE_UTILS (kernel-internal)
    0x60,  # NV0060_SYNC_GPU_BOOST
    0x73,  # NV04_DISPLAY_COMMON
    0x78, 0x79, 0x7E,  # NV01_EVENT_KERNEL_CALLBACK(_EX), NV01_EVENT_OS_EVENT
    0x7D,  # NV04_SOFTWARE_TEST
    NvClass.DEVICE_0,
    0x90,  # KERNEL_GRAPHICS_CONTEXT (internal only)
    0x92,  # NV0092_RG_LINE_CALLBACK (kernel-privileged)
    0xDA,  # NV_SEMAPHORE_SURFACE: counted (OBJECT_LIMIT_CLASSES)
    0xDB,  # NV40_DEBUG_BUFFER: counted
    0xDE,  # RM_USER_SHARED_DATA: counted
})
# Classes that make video memory implicitly (context buffers, instance blocks,
# page tables, buffers), by the tenant object limit that bounds them
# (vgpud.core.tenants.ObjectLimits field names).
OBJECT_LIMIT_CLASSES: dict[str, frozenset[int]] = {
    "channel_groups": frozenset({NvClass.KEPLER_CHANNEL_GROUP_A}),
    "channels": frozenset(ChannelClass),
    "context_shares": frozenset({NvClass.FERMI_CONTEXT_SHARE_A}),
    "va_spaces": frozenset({NvClass.FERMI_VASPACE_A}),
    "buffers": frozenset({
        0xDA,  # NV_SEMAPHORE_SURFACE
        0xDB,  # NV40_DEBUG_BUFFER
        0xDE,  # RM_USER_SHARED_DATA
        0x844C,  # G84_PERFBUFFER
        0x90CD,  # NV_EVENT_BUFFER
        0xC365,  # ACCESS_COUNTER_NOTIFY_BUFFER
        0xC369,  # MMU_FAULT_BUFFER
        0xC763,  # MMU_VIDMEM_ACCESS_BIT_BUFFER
    }),
}
LIMITED_CLASS_KIND = {c: kind for kind, cs in OBJECT_LIMIT_CLASSES.items() for c in cs}


class NvStatus(IntEnum):
    OK = 0x0
    INSUFFICIENT_PERMISSIONS = 0x1B
    INSUFFICIENT_RESOURCES = 0x1A
    INVALID_ADDRESS = 0x1E
    INVALID_ARGUMENT = 0x1F
    INVALID_CLASS = 0x22
    INVALID_OBJECT_PARENT = 0x36
    INVALID_PARAM_STRUCT = 0x3A
    NO_MEMORY = 0x51
    NOT_SUPPORTED = 0x56


class FbInfoIndex(IntEnum):
    """NV2080_CTRL_FB_INFO_INDEX_* of FB_GET_INFO(_V2) entries (values in KiB)."""

    RAM_SIZE = 0x07
    TOTAL_RAM_SIZE = 0x08
    HEAP_SIZE = 0x09
    FB_TAX_SIZE_KB = 0x10
    HEAP_FREE = 0x16
    USABLE_RAM_SIZE = 0x20


FB_INFO_MAX_LIST_SIZE = 128


class VidHeapFunction(IntEnum):
    """NVOS32.function: every function the driver has a handler for (nvos.h,
    rmapi_deprecated_vidheapctrl.c); any other it answers NV_ERR_INVALID_ARGUMENT."""

    ALLOC_SIZE = 2
    FREE = 3
    INFO = 5
    ALLOC_TILED_PITCH_HEIGHT = 6
    ALLOC_SIZE_RANGE = 14
    REACQUIRE_COMPR = 15
    RELEASE_COMPR = 16
    GET_MEM_ALIGNMENT = 18
    HW_ALLOC = 19
    HW_FREE = 20
    ALLOC_OS_DESCRIPTOR = 27


# NVOS32 AllocSize.flags: the allocation is a virtual range (not charged).
NVOS32_ALLOC_FLAGS_VIRTUAL = 0x00080000
# ... the handle is the caller's (hMemory), not generated.
NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED = 0x00004000
# ... ALLOC_SIZE and ALLOC_TILED_PITCH_HEIGHT honour rangeBegin..rangeEnd.
NVOS32_ALLOC_FLAGS_USE_BEGIN_END = 0x00020000


class Ctrl(IntEnum):
    """RM control command ids (NVOS54.cmd)."""

    OS_UNIX_GET_CONTROL_FILE_DESCRIPTOR = 0x3D04
    OS_UNIX_EXPORT_OBJECT_TO_FD = 0x3D05
    OS_UNIX_IMPORT_OBJECT_FROM_FD = 0x3D06
    OS_UNIX_GET_EXPORT_OBJECT_INFO = 0x3D08
    OS_UNIX_CREATE_EXPORT_OBJECT_FD = 0x3D0A
    OS_UNIX_EXPORT_OBJECTS_TO_FD = 0x3D0B
    OS_UNIX_IMPORT_OBJECTS_FROM_FD = 0x3D0C
    FIFO_DISABLE_CHANNELS = 0x2080110B
    FB_GET_INFO = 0x20801301
    FB_GET_INFO_V2 = 0x20801303
    GPFIFO_SCHEDULE = 0xA06C0101
    SET_TIMESLICE = 0xA06C0103
    GET_TIMESLICE = 0xA06C0104
    PREEMPT = 0xA06C0105
    SET_INTERLEAVE_LEVEL = 0xA06C0107
    GET_INTERLEAVE_LEVEL = 0xA06C0108
