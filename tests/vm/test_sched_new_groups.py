"""VERDICT_F_SCHED_OFF and VGPU_SCHED_OWNER_OFF against the real module over nvsim (VM tier).

A raw responder (tests/support/vgpu_genl.py's Genl) answers RM_ALLOC upcalls of channel
groups; nvsim's /proc/driver/nvsim/groups shows whether a group is enabled.

    scripts/test-vm -k sched_new_groups
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.calls import RM_ALLOC, Call
from tests.support.sched import aio, group_enabled, list_contexts, traced
from tests.support.vgpu_genl import (
    A_PARAMS,
    ALLOW,
    CTL,
    U_ID,
    U_NR,
    VERDICT_F_POST,
    Genl,
    NlError,
    daemon,
    rule,
)

pytestmark = pytest.mark.vm

SCHED_OFF = 1 << 1
SCHED_STATE_OFF, SCHED_STATE_ON, SCHED_STATE_OWNER_OFF = 0, 1, 2
CMD_SCHEDULE, A_SCHED, A_SCHED_RESULT = 9, 13, 14
SCHED = struct.Struct("=QIIII")
NVOS21_STATUS, NVOS21_HCLASS = 28, 12
RM_CONTROL = 0x2A
TSG_RULES = [rule(CTL, RM_ALLOC, 32, NVOS21_HCLASS, (nv.KEPLER_CHANNEL_GROUP_A,)),
             rule(CTL, RM_ALLOC, 48, NVOS21_HCLASS, (nv.KEPLER_CHANNEL_GROUP_A,))]
MEM_RULE = rule(CTL, RM_ALLOC, 32, NVOS21_HCLASS, (0x40,))
CONTROL_RULE = rule(CTL, RM_CONTROL, 32, 8, (nv.NVA06C_CTRL_CMD_GPFIFO_SCHEDULE,))


@pytest.fixture
def ctl(vgpu: Path) -> Iterator[tuple[int, nv.Tree]]:
    """Our own nvidiactl file on /dev/vgpu, with a client / device / subdevice tree."""
    fd = os.open(vgpu / "nvidiactl", os.O_RDWR)
    try:
        yield fd, nv.build_tree(fd)
    finally:
        os.close(fd)


def ctx_of(fd: int) -> int:
    """The module's context id of our own nvidiactl fd (LIST_CONTEXTS, newest)."""
    mine = [c.ctx_id for c in aio(list_contexts()) if c.tgid == os.getpid()]
    return max(mine)


def tsg_alloc(fd: int, tree: nv.Tree, size64: bool = False, parent: int | None = None):
    return nv.rm_alloc(fd, tree.client, tree.device if parent is None else parent, 0,
                       nv.KEPLER_CHANNEL_GROUP_A, nv.TSG_ALLOC.pack(0, 0, 0, 0, 0),
                       size64=size64)


def answer_next(g: Genl, flags: int) -> int:
    hdr, _ = g.next_upcall()
    g.verdict(hdr[U_ID], ALLOW, flags=flags)
    return hdr[U_NR]


def schedule(g: Genl, entries: list[tuple[int, int, int, int]]) -> list[tuple[int, int]]:
    _, (reply,) = g.request(CMD_SCHEDULE, [(A_SCHED, b"".join(
        SCHED.pack(c, h, o, e, 0) for c, h, o, e in entries))])
    return list(struct.iter_unpack("=iI", reply[A_SCHED_RESULT]))


def test_a_group_allowed_with_sched_off_is_off_when_the_call_returns(
        ctl: tuple[int, nv.Tree], sched_trace: Path) -> None:
    fd, tree = ctl
    with daemon(TSG_RULES) as g:
        made = []
        for size64, flags in ((False, SCHED_OFF), (True, SCHED_OFF | VERDICT_F_POST),
                              (False, 0)):
            c = Call(tsg_alloc, fd, tree, size64)
            assert answer_next(g, flags) == RM_ALLOC
            if flags & VERDICT_F_POST:  # the POST upcall: the group is off already
                hdr, attrs = g.next_upcall()
                (handle,) = struct.unpack_from("=I", attrs[A_PARAMS], 8)  # hObjectNew
                assert group_enabled(tree.client, handle) is False
                g.verdict(hdr[U_ID], ALLOW)
            r = c.result()
            assert (r.errno, r.status) == (0, nv.NV_OK)
            made.append(r.handle)
        assert [group_enabled(tree.client, h) for h in made] == [False, False, True]
        offs = [e for e in traced(sched_trace) if e["enable"] == "0"]
        assert [(int(e["object"], 16), e["error"], e["status"]) for e in offs] == [
            (made[0], "0", "0x0"), (made[1], "0", "0x0")]
        ctx = ctx_of(fd)
        # Remembered like a SCHEDULE "off": on again when the next daemon registers.
        assert schedule(g, [(ctx, tree.client, made[1], SCHED_STATE_ON)]) == [(0, 0)]
    with daemon([]):
        assert [group_enabled(tree.client, h) for h in made] == [True, True, True]


def test_sched_off_leaves_other_allocs_and_failed_ones_alone(
        ctl: tuple[int, nv.Tree], sched_trace: Path) -> None:
    fd, tree = ctl
    with daemon([*TSG_RULES, MEM_RULE]) as g:
        c = Call(nv.alloc_memory, fd, tree.client, tree.device, 1 << 20)
        answer_next(g, SCHED_OFF)
        assert c.result().status == nv.NV_OK
        c = Call(tsg_alloc, fd, tree, parent=0xBAD)  # no such parent: the driver fails it
        answer_next(g, SCHED_OFF)
        assert c.result().status != nv.NV_OK
    assert traced(sched_trace) == []


def test_sched_off_on_anything_but_rm_alloc_is_refused(ctl: tuple[int, nv.Tree]) -> None:
    fd, tree = ctl
    handle = tsg_alloc(fd, tree).handle
    with daemon([CONTROL_RULE]) as g:
        c = Call(nv.gpfifo_schedule, fd, tree.client, handle, False)
        hdr, _ = g.next_upcall()
        with pytest.raises(NlError) as err:
            g.verdict(hdr[U_ID], ALLOW, flags=SCHED_OFF)
        assert err.value.errno == errno.EINVAL and "RM_ALLOC" in err.value.msg
        assert c.alive(), "a refused verdict completed the waiter"
        g.verdict(hdr[U_ID], ALLOW)
        assert c.result() == (0, nv.NV_OK)
    assert group_enabled(tree.client, handle) is False


def test_an_owner_off_is_not_turned_back_on(ctl: tuple[int, nv.Tree]) -> None:
    fd, tree = ctl
    g1, g2 = tsg_alloc(fd, tree).handle, tsg_alloc(fd, tree).handle
    ctx = ctx_of(fd)
    g = Genl()
    try:
        g.register()
        assert schedule(g, [(ctx, tree.client, g1, SCHED_STATE_OFF),
                            (ctx, tree.client, g2, SCHED_STATE_OFF),
                            (ctx, tree.client, g2, SCHED_STATE_OWNER_OFF)]) == [(0, 0)] * 3
        with pytest.raises(NlError) as err:
            schedule(g, [(ctx, tree.client, g1, 6)])  # no such op (v8: 3 to 5 are)
        assert err.value.errno == errno.EINVAL
    finally:
        g.close()  # dies with g1 off (its record) and g2 off for its owner (none)
    with daemon([]):
        assert [group_enabled(tree.client, h) for h in (g1, g2)] == [True, False]
