"""The virtualized FB view (pure): a tenant with a memory limit sees its limit
as the GPU's memory and its free bytes as the GPU's free, in the answers of
FB_GET_INFO(_V2) and VID_HEAP_CONTROL INFO, rewritten in their POST upcall."""

from __future__ import annotations

import struct

from vgpud.core.ledger import Usage
from vgpud.kernel.codec import Upcall
from vgpud.kernel.cstruct import DecodeError
from vgpud.kernel.uapi import ALLOW, Verdict
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import FbInfoIndex, NvStatus
from vgpud.nvidia.layouts import rewrite_fb_info, rewrite_fb_info_v2, rewrite_vid_heap_info

__all__ = ["answered", "fb_view", "heap_info"]

FB_LIMIT_INDEXES = (FbInfoIndex.RAM_SIZE, FbInfoIndex.TOTAL_RAM_SIZE, FbInfoIndex.HEAP_SIZE,
                    FbInfoIndex.USABLE_RAM_SIZE)
_U32 = struct.Struct("=I")


def answered(upcall: Upcall) -> bool:
    """The driver answered the query of this POST upcall with success."""
    status_off = L.status_offset(upcall.nr, len(upcall.params))
    return (upcall.ret == 0 and status_off is not None
            and _U32.unpack_from(upcall.params, status_off)[0] == NvStatus.OK)


def fb_view(upcall: Upcall, usage: Usage) -> Verdict:
    """FB_GET_INFO(_V2): the sizes the driver reported, as the tenant's."""
    data = upcall.data
    if data is None:
        return ALLOW
    values: dict[int, int] = dict.fromkeys(FB_LIMIT_INDEXES, usage.limit // 1024)
    values[FbInfoIndex.HEAP_FREE] = usage.free // 1024
    if len(data) == L.NV2080_CTRL_FB_GET_INFO_PARAMS.size:
        return _fb_list(upcall, values)
    new = rewrite_fb_info_v2(data, values)
    return ALLOW if new is None else Verdict.reply(data=new)


def _fb_list(upcall: Upcall, values: dict[int, int]) -> Verdict:
    """FB_GET_INFO: the list lies behind a pointer in the control params. The
    module copied it in the caller's context (VGPU_A_DATA2, the entries the
    driver answered); a REPLY's DATA2 is written back there by the module."""
    entries = upcall.data2
    if entries is None or not entries or len(entries) % L.FB_INFO_ENTRY.size:
        return ALLOW
    try:
        new = rewrite_fb_info(entries, values)
    except DecodeError:
        return ALLOW
    return ALLOW if new is None else Verdict.reply(data2=new)


def heap_info(upcall: Upcall, usage: Usage) -> Verdict:
    """VID_HEAP_CONTROL INFO: total and free in bytes (the driver's are KiB
    multiples), the largest free block no larger than the tenant's free."""
    new = rewrite_vid_heap_info(upcall.params, usage.limit >> 10 << 10, usage.free >> 10 << 10)
    return ALLOW if new is None else Verdict.reply(params=new)
