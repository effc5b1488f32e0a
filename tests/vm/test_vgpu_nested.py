"""Nested lists (VM tier): a list behind a pointer in a rule's buffer
(VGPU_A_NESTED), copied by the module in the caller's context and sent as
VGPU_A_DATA2, handed to the driver as the module's copy, and rewritten by a
REPLY's DATA2. FB_GET_INFO (v1) through nvsim, with the raw daemon of
tests/support/vgpu_genl.py; bad nested specs refused with nothing changed.

    scripts/vm-run -- python -m pytest -q -m vm tests/vm/test_vgpu_nested.py
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

import pytest

from tests.support import nvclient as nv
from tests.support.calls import Call
from tests.support.guest import Env
from tests.support.vgpu_genl import (
    A_DATA,
    A_DATA2,
    A_PARAMS,
    ALLOW,
    CTL,
    F_DATA2_BIG,
    F_DATA2_FAULT,
    NESTED_MAX,
    REPLY,
    U_FLAGS,
    U_ID,
    U_KIND,
    UPCALL_IOCTL,
    UPCALL_POST,
    VERDICT_F_POST,
    Genl,
    NlError,
    daemon,
    nested,
    rule,
)

pytestmark = pytest.mark.vm

RM_CONTROL = 0x2A
# RM_CONTROL (NVOS54: cmd @8, params @16, paramsSize @24) of FB_GET_INFO v1,
# its control params as the buffer: fbInfoListSize @0, fbInfoList @8.
FB_RULE = rule(CTL, RM_CONTROL, 32, 8, (nv.NV2080_CTRL_CMD_FB_GET_INFO,), ptr_off=16,
               len_off=24)
FB_NESTED = nested(0, 8, 0, 8, 128)
ENTRY = struct.Struct("=II")
CAPACITY_KIB = 1 << 20  # nvsim's GPUs: 1 GiB


def _entries(raw: bytes) -> list[tuple[int, int]]:
    return list(ENTRY.iter_unpack(raw))


def _fb_call(fd: int, tree: nv.Tree, lst: ctypes.Array, count: int,
             pointer: int | None = None) -> tuple[int, int]:
    ptr = ctypes.addressof(lst) if pointer is None else pointer
    e, st, _ = nv.rm_control(fd, tree.client, tree.subdevice, nv.NV2080_CTRL_CMD_FB_GET_INFO,
                             nv.FB_INFO.pack(count, ptr))
    return e, st


def test_bad_nested_specs_are_refused_and_change_nothing(vg: Env) -> None:
    g = Genl()
    try:
        g.register()
        plain = rule(CTL, 0x29)
        g.set_filter([FB_RULE, plain], nests=[FB_NESTED])  # a good one
        bad = [
            ([FB_RULE], [nested(1, 8, 0, 8, 128)]),  # no rule 1
            ([FB_RULE], [nested(0, 16377, 0, 8, 128)]),  # ptr beyond any buffer
            ([FB_RULE], [nested(0, 8, 16381, 8, 128)]),  # count beyond any buffer
            ([FB_RULE], [nested(0, 8, 0, 0, 128)]),  # elem_size 0
            ([FB_RULE], [nested(0, 8, 0, 16385, 1)]),  # elem_size over PARAMS_MAX
            ([FB_RULE], [nested(0, 8, 0, 8, 0)]),  # max_count 0
            ([FB_RULE], [nested(0, 8, 0, 8, NESTED_MAX + 1)]),  # over NESTED_MAX
            ([FB_RULE], [nested(0, 8, 0, 65, NESTED_MAX)]),  # the list over PARAMS_MAX
            ([FB_RULE], [nested(0, 8, 0, 8, 128, reserved=1)]),
            ([FB_RULE], [FB_NESTED, FB_NESTED]),  # two on one rule
            ([plain], [nested(0, 8, 0, 8, 128)]),  # a rule without a buffer
        ]
        for rules, nests in bad:
            with pytest.raises(NlError) as e:
                g.set_filter(rules, nests=nests)
            assert e.value.errno == errno.EINVAL, nests
        with pytest.raises(NlError) as e:
            g.set_filter([FB_RULE], nests=[FB_NESTED[:-4]])
        assert e.value.errno == errno.EINVAL
        # The good filter still stands: its list still goes up.
        fd = vg.open()
        try:
            tree = nv.build_tree(fd)
            lst = ctypes.create_string_buffer(ENTRY.pack(nv.FB_HEAP_SIZE, 0), 8)
            c = Call(_fb_call, fd, tree, lst, 1)
            hdr, attrs = g.next_upcall()
            assert attrs[A_DATA2] == ENTRY.pack(nv.FB_HEAP_SIZE, 0)
            g.verdict(hdr[U_ID], ALLOW)
            assert c.result() == (0, nv.NV_OK)
        finally:
            os.close(fd)
    finally:
        g.close()


def test_the_list_goes_up_and_a_reply_rewrites_it(vg: Env) -> None:
    fd = vg.open()
    try:
        tree = nv.build_tree(fd)
        with daemon([FB_RULE], nests=[FB_NESTED]) as g:
            sent = ENTRY.pack(nv.FB_HEAP_SIZE, 7) + ENTRY.pack(nv.FB_HEAP_FREE, 9)
            lst = ctypes.create_string_buffer(sent, 16)
            c = Call(_fb_call, fd, tree, lst, 2)
            hdr, attrs = g.next_upcall()
            assert hdr[U_KIND] == UPCALL_IOCTL and hdr[U_FLAGS] == 0
            assert attrs[A_DATA2] == sent
            # The buffer as the caller wrote it: the caller's list pointer.
            assert struct.unpack_from("=Q", attrs[A_DATA], 8)[0] == ctypes.addressof(lst)
            g.verdict(hdr[U_ID], ALLOW, flags=VERDICT_F_POST)
            hdr, attrs = g.next_upcall()
            assert hdr[U_KIND] == UPCALL_POST
            # What nvsim answered, on the module's copy of the list.
            assert _entries(attrs[A_DATA2]) == [(nv.FB_HEAP_SIZE, CAPACITY_KIB),
                                                (nv.FB_HEAP_FREE, CAPACITY_KIB)]
            assert struct.unpack_from("=Q", attrs[A_DATA], 8)[0] == ctypes.addressof(lst)
            assert len(attrs[A_PARAMS]) == 32
            new = ENTRY.pack(nv.FB_HEAP_SIZE, 4096) + ENTRY.pack(nv.FB_HEAP_FREE, 1024)
            with pytest.raises(NlError) as e:  # DATA2 as long as the DATA2 sent, no other
                g.verdict(hdr[U_ID], REPLY, data2=new + b"\0" * 8)
            assert e.value.errno == errno.EINVAL
            g.verdict(hdr[U_ID], REPLY, data2=new)
            assert c.result() == (0, nv.NV_OK)
            assert lst.raw[:16] == new

            # A REPLY to the IOCTL upcall: the driver is not called.
            lst = ctypes.create_string_buffer(sent, 16)
            c = Call(_fb_call, fd, tree, lst, 2)
            hdr, attrs = g.next_upcall()
            g.verdict(hdr[U_ID], REPLY, data2=new[::-1])
            assert c.result() == (0, 0)
            assert lst.raw[:16] == new[::-1]

            # ALLOW alone: the driver's answer reaches the caller's list.
            lst = ctypes.create_string_buffer(sent, 16)
            c = Call(_fb_call, fd, tree, lst, 2)
            hdr, _ = g.next_upcall()
            g.verdict(hdr[U_ID], ALLOW)
            assert c.result() == (0, nv.NV_OK)
            assert _entries(lst.raw[:16]) == [(nv.FB_HEAP_SIZE, CAPACITY_KIB),
                                             (nv.FB_HEAP_FREE, CAPACITY_KIB)]
    finally:
        os.close(fd)


def test_a_list_too_long_or_unreadable_is_flagged_not_copied(vg: Env) -> None:
    fd = vg.open()
    try:
        tree = nv.build_tree(fd)
        with daemon([FB_RULE], nests=[FB_NESTED]) as g:
            lst = ctypes.create_string_buffer(8 * 129)
            c = Call(_fb_call, fd, tree, lst, 129)
            hdr, attrs = g.next_upcall()
            assert hdr[U_FLAGS] == F_DATA2_BIG and A_DATA2 not in attrs
            g.verdict(hdr[U_ID], ALLOW)
            assert c.result() == (0, nv.NV_ERR_INVALID_ARGUMENT)  # the driver's own check
            c = Call(_fb_call, fd, tree, lst, 2, 8)
            hdr, attrs = g.next_upcall()
            assert hdr[U_FLAGS] == F_DATA2_FAULT and A_DATA2 not in attrs
            g.verdict(hdr[U_ID], ALLOW)
            assert c.result()[0] == 0
            # A count of 0: no list, no flag.
            c = Call(_fb_call, fd, tree, lst, 0)
            hdr, attrs = g.next_upcall()
            assert hdr[U_FLAGS] == 0 and A_DATA2 not in attrs
            g.verdict(hdr[U_ID], ALLOW)
            c.result()
    finally:
        os.close(fd)
