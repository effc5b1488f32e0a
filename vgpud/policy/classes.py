"""Which classes, heap functions and UVM calls the quota policy charges,
tracks, passes or refuses, and the status a refused alloc gets (pure)."""

from __future__ import annotations

from vgpud.kernel.codec import Upcall
from vgpud.kernel.uapi import UPCALL_F_DATA_FAULT
from vgpud.nvidia.escapes import (
    DEVICE_MEMORY_CLASSES,
    REFUSED_MEMORY_CLASSES,
    SYSTEM_CLASS_RANGE,
    SYSTEM_OBJECT_CLASSES,
    UNCHARGED_MEMORY_CLASSES,
    NvClass,
    NvStatus,
    UvmCmd,
    VidHeapFunction,
)

__all__ = ["ALLOC_MEMORY_PASS", "TREE_CLASSES", "UVM_ALLOCATING", "VID_HEAP_HARMLESS",
           "params_status", "refused_class"]

# The objects the ledger's tree is made of: a client, its devices and subdevices.
TREE_CLASSES = frozenset({NvClass.ROOT_CLIENT, NvClass.DEVICE_0, NvClass.SUBDEVICE_0})

# VID_HEAP functions that make no video memory and free nothing behind the
# ledger's back (rmapi_deprecated_vidheapctrl.c, 595.45.04):
# - RELEASE_COMPR / REACQUIRE_COMPR: NV0041_CTRL_CMD_UPDATE_SURFACE_COMPRESSION
#   on memory the caller already has;
# - GET_MEM_ALIGNMENT: a query (NV2080_CTRL_CMD_FB_GET_MEM_ALIGNMENT);
# - ALLOC_OS_DESCRIPTOR: NV01_MEMORY_SYSTEM_OS_DESCRIPTOR over the caller's own
#   pages, host memory, passed uncharged through RM_ALLOC too.
# Refused, with the driver's answer to a function it has no handler for
# (NV_ERR_INVALID_ARGUMENT, RmDeprecatedVidHeapControl), so that to the tenant
# it looks like a driver without it: any function not listed here, FREE,
# INFO or an allocating one (layouts.ALLOCATING_FUNCTIONS); among the driver's,
# HW_ALLOC (NV01_MEMORY_HW_RESOURCES, which the ledger does not size) and
# HW_FREE (an RmFree of any handle, unseen by the ledger: a charged handle
# freed that way could be reused by an allocation whose commit then fails).
VID_HEAP_HARMLESS = frozenset({VidHeapFunction.RELEASE_COMPR, VidHeapFunction.REACQUIRE_COMPR,
                               VidHeapFunction.GET_MEM_ALIGNMENT,
                               VidHeapFunction.ALLOC_OS_DESCRIPTOR})

# nvidia-uvm calls after which UVM allocates video memory itself (from its
# own allocator, outside RM's objects): migration to a GPU, the policies that
# place or duplicate pages on one, and GPU semaphore pools.
UVM_ALLOCATING = frozenset({UvmCmd.MIGRATE, UvmCmd.MIGRATE_RANGE_GROUP,
                            UvmCmd.SET_PREFERRED_LOCATION, UvmCmd.SET_ACCESSED_BY,
                            UvmCmd.ENABLE_READ_DUPLICATION, UvmCmd.ALLOC_SEMAPHORE_POOL})

# RM_ALLOC_MEMORY classes other than the charged that pass: host memory and
# the caller's own pages, and a VA range (RmDeprecatedAllocMemory's table).
ALLOC_MEMORY_PASS = frozenset({NvClass.MEMORY_SYSTEM, NvClass.MEMORY_SYSTEM_OS_DESCRIPTOR,
                               NvClass.MEMORY_VIRTUAL})


def params_status(upcall: Upcall, pointer: int) -> int:
    """The status the driver gives alloc params it cannot take
    (serverAllocApiCopyIn: their size is the class's, paramsSize unread)."""
    if upcall.flags & UPCALL_F_DATA_FAULT:
        return NvStatus.INVALID_ADDRESS
    if not pointer:
        return NvStatus.INVALID_ARGUMENT  # required params, NULL pointer
    return NvStatus.INVALID_PARAM_STRUCT  # copied, but not of the class's layout


def refused_class(h_class: int) -> bool:
    """A memory class refused by name, or an unknown class of the range where
    RM numbers its memory classes (vgpud.nvidia.escapes)."""
    return h_class in REFUSED_MEMORY_CLASSES or (
        h_class in SYSTEM_CLASS_RANGE and h_class not in SYSTEM_OBJECT_CLASSES
        and h_class not in UNCHARGED_MEMORY_CLASSES and h_class not in DEVICE_MEMORY_CLASSES
        and h_class not in TREE_CLASSES)
