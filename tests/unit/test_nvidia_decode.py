"""NVIDIA-level decoding of RM escapes, status offsets and filter rules."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.policies import parse_filter_spec
from vgpud.kernel.uapi import (
    FILTER_OPEN,
    OFF_NONE,
    PARAMS_MAX,
    RULE,
    RULE_F_LEN_FIXED,
    Node,
    Rule,
)
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import Escape, NvClass, VidHeapFunction, ioc_nr, ioc_size, iowr
from vgpud.nvidia.layouts import DecodeError, decode_call, status_offset
from vgpud.policy.rules import rm_alloc_classes, rm_control_cmds


def mem_params(size: int) -> bytes:
    values = [0] * 23
    values[13] = size  # size@64
    return L.NV_MEMORY_ALLOCATION_PARAMS.struct.pack(*values)


def test_rm_alloc_nvos21_with_memory_params() -> None:
    params = L.NVOS21.struct.pack(1, 2, 3, NvClass.MEMORY_LOCAL_USER, 0x1000, 128, 0)
    call = decode_call(Escape.RM_ALLOC, params, mem_params(1 << 30))
    assert isinstance(call, L.RmAlloc)
    assert (call.h_root, call.h_parent, call.h_new, call.h_class) == (1, 2, 3, 0x40)
    assert (call.params_size, call.status_off) == (128, 28)
    assert call.alloc.size == 1 << 30


def test_rm_alloc_nvos64_device() -> None:
    params = L.NVOS64.struct.pack(1, 1, 5, NvClass.DEVICE_0, 0x1000, 0, 56, 7, 0)
    dev = L.NV0080_ALLOC_PARAMETERS.struct.pack(2, 0, 0, 0, 0, 1 << 40, 0, 0, 1)
    call = decode_call(Escape.RM_ALLOC, params, dev)
    assert (call.flags, call.status_off) == (7, 40)
    assert call.alloc == L.DeviceAllocParams(2, 0, 0, 0, 0, 1 << 40, 0, 0, 1)


def test_rm_alloc_without_data_and_other_class() -> None:
    params = L.NVOS21.struct.pack(0, 0, 0xC1D00001, NvClass.ROOT_CLIENT, 0, 0, 0)
    assert decode_call(Escape.RM_ALLOC, params).alloc is None
    assert decode_call(Escape.RM_ALLOC, params, b"\0" * 4).alloc is None


def test_other_escapes() -> None:
    assert decode_call(Escape.RM_FREE, struct.pack("=4I", 1, 2, 3, 0)) == L.RmFree(1, 2, 3, 0)
    ctl = L.NVOS54.struct.pack(1, 9, 0xA06C0101, 0, 0x1000, 3, 0)
    assert decode_call(Escape.RM_CONTROL, ctl, b"\1\0\0") == L.RmControl(
        1, 9, 0xA06C0101, 0, 0x1000, 3, 0, b"\1\0\0")
    dup = L.NVOS55.struct.pack(1, 2, 3, 4, 5, 0, 0)
    assert decode_call(Escape.RM_DUP_OBJECT, dup) == L.RmDupObject(1, 2, 3, 4, 5, 0, 0)
    mapped = L.NVOS33_WITH_FD.struct.pack(1, 2, 3, 0, 4096, 0, 0, 0, 7)
    assert decode_call(Escape.RM_MAP_MEMORY, mapped).fd == 7
    mem = L.NVOS02_WITH_FD.struct.pack(1, 2, 3, 0x3E, 0, 0, 4095, 0, -1)
    assert decode_call(Escape.RM_ALLOC_MEMORY, mem).fd == -1
    assert decode_call(Escape.CARD_INFO, b"") is None


def test_vid_heap_alloc_size_and_free() -> None:
    values = [0] * len(L.NVOS32.struct.unpack(b"\0" * 184))
    values[2] = VidHeapFunction.ALLOC_SIZE
    values[9] = 0xBEEF  # hMemory
    values[19] = 1 << 20  # size
    call = decode_call(Escape.RM_VID_HEAP_CONTROL, L.NVOS32.struct.pack(*values))
    assert call.h_memory == 0xBEEF and call.alloc.size == 1 << 20
    values[2] = VidHeapFunction.FREE
    call = decode_call(Escape.RM_VID_HEAP_CONTROL, L.NVOS32.struct.pack(*values))
    assert call.h_memory == 0xBEEF and call.alloc is None


@pytest.mark.parametrize(("nr", "size"), [(Escape.RM_ALLOC, 40), (Escape.RM_FREE, 15),
                                          (Escape.RM_CONTROL, 48), (Escape.RM_DUP_OBJECT, 32)])
def test_wrong_sizes(nr: int, size: int) -> None:
    with pytest.raises(DecodeError):
        decode_call(nr, b"\0" * size)


def test_wrong_alloc_params_size() -> None:
    params = L.NVOS21.struct.pack(1, 2, 3, NvClass.MEMORY_LOCAL_USER, 0x1000, 64, 0)
    with pytest.raises(DecodeError):
        decode_call(Escape.RM_ALLOC, params, b"\0" * 64)


@given(st.sampled_from(list(Escape)), st.binary(max_size=256), st.none() | st.binary(max_size=256))
def test_decode_call_raises_only_decode_error(nr, params, data) -> None:
    with contextlib.suppress(DecodeError):
        decode_call(nr, params, data)


def test_status_offsets() -> None:
    assert status_offset(Escape.RM_ALLOC, 32) == 28
    assert status_offset(Escape.RM_ALLOC, 48) == 40
    assert status_offset(Escape.RM_FREE, 16) == 12
    assert status_offset(Escape.RM_CONTROL, 32) == 28
    assert status_offset(Escape.RM_VID_HEAP_CONTROL, 184) == 20
    assert status_offset(Escape.RM_DUP_OBJECT, 28) == 24
    assert status_offset(Escape.RM_ALLOC, 40) is None


def test_ioctl_words() -> None:
    cmd = iowr(Escape.RM_ALLOC, 32)
    assert cmd == 0xC020462B
    assert (ioc_nr(cmd), ioc_size(cmd)) == (0x2B, 32)
    with pytest.raises(ValueError):
        iowr(Escape.RM_CONTROL, 1 << 14)


def test_alloc_rules() -> None:
    """The alloc params are copied by the size of their class, as the driver
    reads them, never by paramsSize (NVOS21 @24, NVOS64 @32)."""
    r21, r64 = rm_alloc_classes([0x40, 0x3F, 0x40])
    assert (r21.node_mask, r21.nr, r21.size) == (1 << Node.CTL, 0x2B, 32)
    assert (r21.match_off, r21.ptr_off, r21.len_off, r21.data_size) == (12, 16, OFF_NONE, 128)
    assert (r64.size, r64.match_off, r64.ptr_off, r64.len_off) == (48, 12, 16, OFF_NONE)
    assert r21.match == r64.match == (0x3F, 0x40)
    assert r21.flags & RULE_F_LEN_FIXED and r64.data_size == 128


def test_alloc_rules_one_pair_per_params_size() -> None:
    """Classes of different alloc params get a pair of rules each; classes
    whose params vgpud does not know get a pair that copies nothing."""
    rules = rm_alloc_classes([NvClass.ROOT_CLIENT, NvClass.DEVICE_0, 0x40,
                              NvClass.SUBDEVICE_0, 0x3F])
    by_size = {(r.size, r.data_size): r.match for r in rules}
    assert by_size == {
        (32, 0): (NvClass.ROOT_CLIENT, NvClass.SUBDEVICE_0),
        (48, 0): (NvClass.ROOT_CLIENT, NvClass.SUBDEVICE_0),
        (32, 56): (NvClass.DEVICE_0,), (48, 56): (NvClass.DEVICE_0,),
        (32, 128): (0x3F, 0x40), (48, 128): (0x3F, 0x40),
    }
    assert all(r.ptr_off == OFF_NONE for r in rules if not r.data_size)
    # Every rule names its classes: none of them selects every RM_ALLOC.
    assert all(r.match for r in rules)


def test_fixed_length_rules_round_trip_the_wire() -> None:
    (rule, _) = rm_alloc_classes([0x40], post=True, shadow=True)
    raw = rule.pack()
    assert struct.unpack_from("=I", raw, RULE.offsets["len_off"])[0] == 128
    assert Rule.unpack(raw) == rule
    with pytest.raises(ValueError):
        Rule(node_mask=1, nr=0x2B, size=32, ptr_off=16, len_off=24, data_size=128)
    with pytest.raises(ValueError):
        Rule(node_mask=1, nr=0x2B, size=32, data_size=128)
    with pytest.raises(ValueError):
        Rule(node_mask=1, nr=0x2B, size=32, ptr_off=16, data_size=PARAMS_MAX + 1)


def test_control_rule() -> None:
    rule = rm_control_cmds([0xA06C0101])
    assert (rule.nr, rule.size, rule.match_off, rule.ptr_off, rule.len_off) == (
        0x2A, 32, 8, 16, 24)


def test_rule_limits() -> None:
    with pytest.raises(ValueError):
        rm_control_cmds(range(33))
    with pytest.raises(ValueError):
        rm_alloc_classes([])


def test_filter_specs() -> None:
    assert parse_filter_spec("open").flags == FILTER_OPEN
    assert parse_filter_spec("alloc:0x40,0x3f").rules == rm_alloc_classes([0x40, 0x3F])
    assert parse_filter_spec("control:0xa06c0101").rules == (rm_control_cmds([0xA06C0101]),)
    assert parse_filter_spec("alloc+shadow:0x40").rules == rm_alloc_classes([0x40], shadow=True)
    assert parse_filter_spec("control+shadow:0x1").rules == (rm_control_cmds([1], shadow=True),)
    for bad in ("nope", "alloc:", "open:1", "alloc:zz", "alloc+post:0x40", "open+shadow"):
        with pytest.raises(ValueError):
            parse_filter_spec(bad)
    assert parse_filter_spec("open").rules == ()
    assert parse_filter_spec("alloc:0x40").rules[0].ptr_off != OFF_NONE


# --- rewriting the memory figures a tenant sees ---

FB_VALUES = {0x07: 100, 0x16: 40}


def _entries(*pairs: tuple[int, int]) -> bytes:
    return b"".join(L.FB_INFO_ENTRY.struct.pack(i, d) for i, d in pairs)


def test_rewrite_fb_info_list() -> None:
    driver = _entries((0x07, 400), (0x33, 9), (0x16, 300), (0x07, 400))
    assert L.rewrite_fb_info(driver, FB_VALUES) == _entries(
        (0x07, 100), (0x33, 9), (0x16, 40), (0x07, 100))
    assert L.rewrite_fb_info(_entries((0x07, 100), (0x33, 1)), FB_VALUES) is None
    assert L.rewrite_fb_info(b"", FB_VALUES) is None
    assert L.rewrite_fb_info(_entries((0x07, 1)), {0x07: -5, 0x16: 1}) == _entries((0x07, 0))
    assert L.rewrite_fb_info(_entries((0x07, 1)), {0x07: 2**40}) == _entries((0x07, 2**32 - 1))
    with pytest.raises(DecodeError):
        L.rewrite_fb_info(b"\0" * 12, FB_VALUES)


def test_rewrite_fb_info_v2_only_within_its_count() -> None:
    entries = _entries((0x07, 400), (0x16, 300))
    buf = struct.pack("=I", 1) + entries + b"\0" * (1024 - len(entries))
    out = L.rewrite_fb_info_v2(buf, FB_VALUES)
    assert out is not None and len(out) == 1028
    assert out[4:20] == _entries((0x07, 100), (0x16, 300))  # the second is past the count
    assert L.rewrite_fb_info_v2(buf[:-1], FB_VALUES) is None
    assert L.rewrite_fb_info_v2(struct.pack("=I", 129) + buf[4:], FB_VALUES) is None


def test_vid_heap_info_decode_and_rewrite() -> None:
    params = L.NVOS32_INFO.struct.pack(1, 2, 5, 0, 0, 0, 8 << 30, 6 << 30, 0, 4096, 5 << 30,
                                       8192)
    assert L.decode_vid_heap_info(params) == L.VidHeapInfo(0, 8 << 30, 6 << 30, 0, 4096,
                                                           5 << 30, 8192)
    out = L.rewrite_vid_heap_info(params, 1 << 30, 256 << 20)
    assert L.decode_vid_heap_info(out) == L.VidHeapInfo(0, 1 << 30, 256 << 20, 0, 4096,
                                                        256 << 20, 8192)
    assert out[:24] == params[:24] and out[64:] == params[64:]
    assert L.rewrite_vid_heap_info(out, 1 << 30, 256 << 20) is None  # nothing to change
    assert L.rewrite_vid_heap_info(params[:-1], 1, 1) is None
    with pytest.raises(DecodeError):
        L.decode_vid_heap_info(params[:100])
