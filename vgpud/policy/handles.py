"""Handles of new objects: where an allocation's params hold it, and the
handles the daemon names objects with where the driver would generate them.

A handle the driver generates (hObjectNew 0; NVOS32 without
MEMORY_HANDLE_PROVIDED) exists only in the call's results, which lie in the
tenant's memory: a sibling thread can rewrite it before the module reads it
back, and so name another object as the one made. So the policies that must
know the new object name it before the call (an ALLOW carrying the params
the driver reads, protocol v5), from a range of their own.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from vgpud.kernel.codec import Upcall
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED, Escape

__all__ = ["GENERATED_HANDLES", "name_handle", "new_handle", "with_handle"]

# (first, count): the 2^19 handles above the range RM's own generator takes
# them from (RS_UNIQUE_HANDLE_BASE 0xcaf00000, RS_UNIQUE_HANDLE_RANGE
# 0x80000), so that the two never compete.
GENERATED_HANDLES = (0xCAF80000, 0x80000)

_U32 = struct.Struct("=I")
# Where the new handle lies in an allocation's params, by (escape, size).
_NEW_HANDLE: dict[tuple[int, int], int] = {
    (Escape.RM_ALLOC, L.NVOS21.size): L.NVOS21.offsets["hObjectNew"],
    (Escape.RM_ALLOC, L.NVOS64.size): L.NVOS64.offsets["hObjectNew"],
    (Escape.RM_ALLOC_MEMORY, L.NVOS02_WITH_FD.size): L.NVOS02_WITH_FD.offsets["hObjectNew"],
    (Escape.RM_VID_HEAP_CONTROL, L.NVOS32.size): L.NVOS32.offsets["hMemory"],
    (Escape.RM_DUP_OBJECT, L.NVOS55.size): L.NVOS55.offsets["hObject"],
}


def new_handle(nr: int, params: bytes) -> int:
    """The new object's handle in these params (0: none, or not a layout known)."""
    off = _NEW_HANDLE.get((nr, len(params)))
    return 0 if off is None else _U32.unpack_from(params, off)[0]


def name_handle(upcall_id: int, taken: Callable[[int], bool]) -> int:
    """A handle of GENERATED_HANDLES that ``taken`` says is free, chosen from
    the upcall id (ids only grow: a fresh one each time until they wrap). A
    tenant's own object under it makes its call fail, as the driver fails a
    taken handle (NV_ERR_INSERT_DUPLICATE_NAME)."""
    first, count = GENERATED_HANDLES
    for i in range(count):
        handle = first + (upcall_id + i) % count
        if not taken(handle):
            return handle
    return first + upcall_id % count  # every one taken: the driver refuses it


def with_handle(upcall: Upcall, handle: int) -> bytes:
    """The upcall's params naming ``handle`` as the new object's; a VID_HEAP
    allocation also gets MEMORY_HANDLE_PROVIDED, without which the driver
    ignores hMemory."""
    params = bytearray(upcall.params)
    _U32.pack_into(params, _NEW_HANDLE[upcall.nr, len(params)], handle)
    if upcall.nr == Escape.RM_VID_HEAP_CONTROL:
        at = L.NVOS32.offsets["flags"]
        flags = _U32.unpack_from(params, at)[0]
        _U32.pack_into(params, at, flags | NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED)
    return bytes(params)
