"""QuotaPolicy through the Dispatcher, with upcalls built as the module builds them."""

from __future__ import annotations

import errno
import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.fakekernel import mmap_params
from tests.support.quota_world import World, setup_gpu
from vgpud.core.ledger import Key
from vgpud.kernel.uapi import (
    ALLOW,
    ALLOW_POST,
    FILTER_OPEN,
    FILTER_UVM_MMAP,
    OFF_NONE,
    UPCALL_F_DATA2_BIG,
    UPCALL_F_DATA2_FAULT,
    UPCALL_F_DATA_FAULT,
    Context,
    Node,
    Rule,
    UpcallKind,
    Verdict,
    VerdictAction,
)
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import Ctrl, Escape, NvStatus

GIB, MIB, KIB = 2**30, 2**20, 2**10
OOM = NvStatus.NO_MEMORY


@pytest.fixture
def w(tmp_path: Path) -> World:
    return World(tmp_path)


def test_filter() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        filt = World(Path(tmp)).policy.filter()
    assert filt.flags == FILTER_OPEN | FILTER_UVM_MMAP
    by_nr: dict[tuple[int, int], Rule] = {}  # the first rule of each escape and size
    for r in filt.rules:
        by_nr.setdefault((r.nr, r.size), r)
    # The tree and the charged classes first, one rule per alloc params size
    # (none for the client and the subdevice, the device's, the memory's), of
    # NVOS21 and NVOS64 both.
    for size in (32, 48):
        first = [r for r in filt.rules if r.nr == Escape.RM_ALLOC and r.size == size][:3]
        assert set().union(*(r.match for r in first)) == {0x41, 0x80, 0x2080, 0x40, 0x3F}
        assert [r.data_size for r in first] == [0, L.NV0080_ALLOC_PARAMETERS.size,
                                                L.NV_MEMORY_ALLOCATION_PARAMS.size]
    assert by_nr[Escape.RM_FREE, 16].match == ()
    assert (Escape.RM_DUP_OBJECT, 28) in by_nr
    assert by_nr[Escape.RM_ALLOC_MEMORY, 56].node_mask == 1 << Node.GPU
    heap = [r for r in filt.rules if r.nr == Escape.RM_VID_HEAP_CONTROL]
    # Every function goes up (the unknown ones are refused), of the NVOS32 size;
    # the allocations and FREE complete on POST events, INFO asks for a POST upcall.
    assert [(r.size, r.match_off, r.post, r.shadow) for r in heap] == [
        (L.NVOS32.size, OFF_NONE, True, True)]
    control = [r.match for r in filt.rules
               if r.nr == Escape.RM_CONTROL and r.node_mask != 1 << Node.UVM]
    assert control == [(Ctrl.FB_GET_INFO_V2,), (Ctrl.FB_GET_INFO,)]  # v1 with its list
    assert not by_nr[Escape.RM_CONTROL, 32].post
    # What the ledger charges, tracks or frees is what the driver reads: only
    # the FB size queries, whose results are rewritten, go without a shadow.
    # UVM calls decided on the command alone (no params copied) go without one
    # too (tests/unit/test_quota_unseen.py).
    assert {(r.nr, r.match) for r in filt.rules
            if not r.shadow and r.node_mask != 1 << Node.UVM} == {
        (Escape.RM_CONTROL, (Ctrl.FB_GET_INFO,)), (Escape.RM_CONTROL, (Ctrl.FB_GET_INFO_V2,))}


def test_open_resolves_or_refuses(w: World) -> None:
    assert w.open(1, uid=1000) == ALLOW
    assert w.open(2, uid=5, cgroup="/pods/b-1") == ALLOW
    assert w.open(3, uid=5, cgroup="/other") == Verdict.deny(errno.EACCES)
    assert (w.manager.contexts("a"), w.manager.contexts("b")) == (1, 1)
    w.close(1)
    w.close(3)  # never opened: ignored
    assert w.manager.contexts("a") == 0


@pytest.mark.parametrize("nvos", [21, 64])
def test_denial_at_the_boundary(w: World, nvos: int) -> None:
    client, device, sub = setup_gpu(w, 1)
    assert w.mem(1, client, device, GIB - 8 * KIB, nvos=nvos)[0] == ALLOW
    assert w.used("a") == GIB - 8 * KIB
    assert w.mem(1, client, sub, 4 * KIB + 1, nvos=nvos)[0] == ALLOW  # rounded to 8 KiB: fits
    assert w.used("a") == GIB
    off = 28 if nvos == 21 else 40
    assert w.mem(1, client, device, 1, nvos=nvos)[0] == Verdict(
        VerdictAction.FAIL_STATUS, 0, OOM, off)
    (denied,) = w.denied
    assert (denied.tenant, denied.gpu, denied.size, denied.used, denied.limit) == (
        "a", 0, 4 * KIB, GIB, GIB)


def test_failed_alloc_releases_and_gpu_comes_from_the_device(w: World) -> None:
    client, device, _ = setup_gpu(w, 1, gpu=1)
    assert w.mem(1, client, device, MIB, status=OOM)[0] == ALLOW
    assert w.used("a", 1) == 0
    assert w.mem(1, client, device, MIB)[0] == ALLOW
    assert (w.used("a", 0), w.used("a", 1)) == (0, MIB)


def test_interleaved_tenants_frees_dups_and_close(w: World) -> None:
    ca, da, _ = setup_gpu(w, 1)
    cb, db, _ = setup_gpu(w, 2, gpu=1, uid=5, cgroup="/pods/b-7")
    _, m1 = w.mem(1, ca, da, 512 * MIB)
    _, m2 = w.mem(2, cb, db, GIB)
    _, m3 = w.mem(1, ca, da, 256 * MIB)
    assert (w.used("a"), w.used("b", 1)) == (768 * MIB, GIB)
    # dup m1 in the same client: one charge, two handles
    dup = L.NVOS55.struct.pack(ca, da, 0x7777, ca, m1, 0, 0)
    uid, verdict = w.upcall(1, dup, nr=Escape.RM_DUP_OBJECT)
    assert verdict == ALLOW
    w.post(1, uid, Escape.RM_DUP_OBJECT, dup)
    assert Key(ca, 0x7777) in w.ledger and w.used("a") == 768 * MIB
    assert w.free(1, ca, m1) == ALLOW
    assert w.used("a") == 768 * MIB  # the dup still holds it
    assert w.free(1, ca, 0x7777) == ALLOW
    assert w.used("a") == 256 * MIB
    assert w.free(1, ca, 0xDEAD) == ALLOW  # unknown: ignored
    w.free(2, cb, m2, status=0x33)  # the driver refused: nothing changes
    assert w.used("b", 1) == GIB
    assert w.free(1, ca, da) == ALLOW  # the device: its memory goes with it
    assert Key(ca, m3) not in w.ledger and w.used("a") == 0
    w.close(2)
    assert w.used("b", 1) == 0 and w.manager.contexts("b") == 0


def test_free_of_the_client_cascades(w: World) -> None:
    client, device, sub = setup_gpu(w, 1)
    w.mem(1, client, sub, 100 * MIB)
    w.free(1, client, client)
    assert w.used("a") == 0 and Key(client, device) not in w.ledger


def test_alloc_memory_and_vid_heap(w: World) -> None:
    client, device, _ = setup_gpu(w, 1, gpu=1)
    nvos02 = L.NVOS02_WITH_FD.struct.pack(client, device, 0x500, 0x40, 0, 0, MIB - 1, 0, 9)
    uid, verdict = w.upcall(1, nvos02, nr=Escape.RM_ALLOC_MEMORY, node=Node.GPU, minor=1)
    assert verdict == ALLOW
    w.post(1, uid, Escape.RM_ALLOC_MEMORY, nvos02)
    assert w.used("a", 1) == MIB
    big = L.NVOS02_WITH_FD.struct.pack(client, device, 0x501, 0x40, 0, 0, GIB - 1, 0, 9)
    assert w.upcall(1, big, nr=Escape.RM_ALLOC_MEMORY, node=Node.GPU, minor=1)[1] == (
        Verdict.fail_status(OOM, 40))

    def nvos32(function: int, h_memory: int, size: int, flags: int = 0) -> bytes:
        values = [0] * 28
        values[:3] = [client, device, function]
        values[9], values[11], values[19] = h_memory, flags, size
        return L.NVOS32.struct.pack(*values)

    uid, verdict = w.upcall(1, nvos32(2, 0, 3 * MIB), nr=Escape.RM_VID_HEAP_CONTROL)
    assert verdict == ALLOW
    w.post(1, uid, Escape.RM_VID_HEAP_CONTROL, nvos32(2, 0x600, 3 * MIB))
    assert w.used("a", 1) == 4 * MIB
    virtual = nvos32(2, 0, 8 * GIB, flags=0x80000)
    assert w.upcall(1, virtual, nr=Escape.RM_VID_HEAP_CONTROL)[1] == ALLOW  # not charged
    uid, verdict = w.upcall(1, nvos32(3, 0x600, 0), nr=Escape.RM_VID_HEAP_CONTROL)
    w.post(1, uid, Escape.RM_VID_HEAP_CONTROL, nvos32(3, 0x600, 0))
    assert w.used("a", 1) == MIB
    assert w.upcall(1, nvos32(2, 0, GIB), nr=Escape.RM_VID_HEAP_CONTROL)[1] == (
        Verdict.fail_status(OOM, 20))


def _tiled(client: int, parent: int, height: int, pitch: int, *, h_memory: int = 0,
           size: int = 0, flags: int = 0) -> bytes:
    """NVOS32 ALLOC_TILED_PITCH_HEIGHT; ``size`` is the field the driver ignores."""
    values = [0] * 30
    values[:3] = [client, parent, 6]
    values[9], values[11], values[12], values[13], values[20] = (h_memory, flags, height,
                                                                  pitch, size)
    return L.NVOS32_TILED.struct.pack(*values)


def _ranged(client: int, parent: int, size: int, begin: int = 0, end: int = 0, *,
            h_memory: int = 0, flags: int = 0, status: int = 0) -> bytes:
    values = [0] * 27
    values[:3] = [client, parent, 14]
    values[5] = status
    values[9], values[11], values[17], values[21], values[22] = (h_memory, flags, size,
                                                                  begin, end)
    return L.NVOS32_RANGE.struct.pack(*values)


def test_tiled_and_ranged_vid_heap_are_charged(w: World) -> None:
    client, device, sub = setup_gpu(w, 1, gpu=1)
    heap = Escape.RM_VID_HEAP_CONTROL
    # height x pitch, whatever the size field says
    uid, verdict = w.upcall(1, _tiled(client, device, 256, 4096, size=1), nr=heap)
    assert verdict == ALLOW
    w.post(1, uid, heap, _tiled(client, device, 256, 4096, h_memory=0x600))
    assert w.used("a", 1) == MIB
    uid, verdict = w.upcall(1, _ranged(client, sub, 3 * MIB, 0, 64 * MIB), nr=heap)
    assert verdict == ALLOW
    w.post(1, uid, heap, _ranged(client, sub, 3 * MIB, h_memory=0x601))
    assert w.used("a", 1) == 4 * MIB
    # refused as ALLOC_SIZE is, at NVOS32's status
    assert w.upcall(1, _tiled(client, device, 1024, MIB), nr=heap)[1] == (
        Verdict.fail_status(OOM, 20))
    assert w.upcall(1, _ranged(client, device, GIB), nr=heap)[1] == Verdict.fail_status(OOM, 20)
    # a negative pitch is a product near 2**64, as the driver computes it
    assert w.upcall(1, _tiled(client, device, 1, -4096), nr=heap)[1] == (
        Verdict.fail_status(OOM, 20))
    # a failed call gives its reservation back; FREE and RM_FREE free them
    uid, _ = w.upcall(1, _ranged(client, device, 8 * MIB), nr=heap)
    w.post(1, uid, heap, _ranged(client, device, 8 * MIB, h_memory=0x602, status=OOM))
    assert w.used("a", 1) == 4 * MIB
    free = L.NVOS32.struct.pack(client, device, 3, *[0] * 6, 0x600, *[0] * 18)
    uid, _ = w.upcall(1, free, nr=heap)
    w.post(1, uid, heap, free)
    assert w.free(1, client, 0x601) == ALLOW
    assert w.used("a", 1) == 0


def test_virtual_vid_heap_allocations_are_not_charged(w: World) -> None:
    client, device, _ = setup_gpu(w, 1)
    heap, virtual = Escape.RM_VID_HEAP_CONTROL, 0x80000
    assert w.upcall(1, _tiled(client, device, 2**20, 2**20, flags=virtual), nr=heap)[1] == ALLOW
    assert w.upcall(1, _ranged(client, device, 8 * GIB, flags=virtual), nr=heap)[1] == ALLOW
    assert w.used("a") == 0


@pytest.mark.parametrize("function", [0, 1, 4, 7, 13, 17, 19, 20, 21, 26, 28, 99, 2**32 - 1])
def test_unknown_vid_heap_functions_are_refused(w: World, function: int) -> None:
    """As the driver answers a function it has no handler for; HW_ALLOC (19) and
    HW_FREE (20) too (see VID_HEAP_HARMLESS)."""
    client, device, _ = setup_gpu(w, 1)
    call = L.NVOS32.struct.pack(client, device, function, *[0] * 25)
    assert w.upcall(1, call, nr=Escape.RM_VID_HEAP_CONTROL)[1] == Verdict.fail_status(
        NvStatus.INVALID_ARGUMENT, 20)


@pytest.mark.parametrize("function", [15, 16, 18, 27])
def test_harmless_vid_heap_functions_pass(w: World, function: int) -> None:
    client, device, _ = setup_gpu(w, 1)
    call = L.NVOS32.struct.pack(client, device, function, *[0] * 25)
    assert w.upcall(1, call, nr=Escape.RM_VID_HEAP_CONTROL)[1] == ALLOW
    assert w.used("a") == 0


def _fb_v2(entries: dict[int, int]) -> bytes:
    flat = [v for kv in entries.items() for v in kv]
    flat += [0] * (256 - len(flat))
    return L.NV2080_CTRL_FB_GET_INFO_V2_PARAMS.struct.pack(len(entries), *flat)


def _fb_entries(buf: bytes) -> dict[int, int]:
    count, *flat = L.NV2080_CTRL_FB_GET_INFO_V2_PARAMS.struct.unpack(buf)
    return {flat[2 * i]: flat[2 * i + 1] for i in range(count)}


def test_fb_view_is_the_tenant_limit(w: World) -> None:
    client, device, sub = setup_gpu(w, 1)
    w.mem(1, client, device, 300 * MIB)
    driver = {7: 4 * GIB // KIB, 8: 4 * GIB // KIB, 9: 4 * GIB // KIB - 1, 0x10: 5,
              0x16: 3 * GIB // KIB, 0x20: 4 * GIB // KIB}
    ctrl = L.NVOS54.struct.pack(client, sub, Ctrl.FB_GET_INFO_V2, 0, 0x7F00, 1028, 0)
    uid, verdict = w.upcall(1, ctrl, _fb_v2(dict.fromkeys(driver, 0)), nr=Escape.RM_CONTROL)
    assert verdict == ALLOW_POST
    reply = w.post_upcall(1, uid, Escape.RM_CONTROL, ctrl, _fb_v2(driver))
    assert reply.action is VerdictAction.REPLY and reply.params is None
    assert _fb_entries(reply.data) == {7: GIB // KIB, 8: GIB // KIB, 9: GIB // KIB, 0x10: 5,
                                       0x16: 724 * MIB // KIB, 0x20: GIB // KIB}
    # a failed control keeps the driver's answer
    uid, _ = w.upcall(1, ctrl, _fb_v2(driver), nr=Escape.RM_CONTROL)
    failed = L.NVOS54.struct.pack(client, sub, Ctrl.FB_GET_INFO_V2, 0, 0x7F00, 1028, 0x1F)
    assert w.post_upcall(1, uid, Escape.RM_CONTROL, failed, _fb_v2(driver)) == ALLOW


def test_fb_view_floor_and_unlimited_tenants(w: World) -> None:
    client, device, sub = setup_gpu(w, 1)
    w.mem(1, client, device, 900 * MIB)
    w.manager.update_tenant("a", {"memory": "512MiB"})  # below usage
    ctrl = L.NVOS54.struct.pack(client, sub, Ctrl.FB_GET_INFO_V2, 0, 0x7F00, 1028, 0)
    uid, _ = w.upcall(1, ctrl, _fb_v2({0x16: 1}), nr=Escape.RM_CONTROL)
    reply = w.post_upcall(1, uid, Escape.RM_CONTROL, ctrl, _fb_v2({0x16: 12345, 9: 1}))
    assert _fb_entries(reply.data) == {0x16: 0, 9: 512 * MIB // KIB}
    c_client, _, c_sub = setup_gpu(w, 2, uid=3000)  # tenant c: no limit
    ctrl = L.NVOS54.struct.pack(c_client, c_sub, Ctrl.FB_GET_INFO_V2, 0, 0x7F00, 1028, 0)
    assert w.upcall(2, ctrl, _fb_v2({7: 1}), nr=Escape.RM_CONTROL)[1] == ALLOW


# --- FB_GET_INFO (v1): the list behind a pointer, copied by the module (DATA2) ---


def _fb_list(entries: dict[int, int]) -> bytes:
    """A list as the module copied it (VGPU_A_DATA2)."""
    return b"".join(L.FB_INFO_ENTRY.struct.pack(i, d) for i, d in entries.items())


def _list_entries(buf: bytes | None) -> dict[int, int]:
    assert buf is not None
    return dict(L.FB_INFO_ENTRY.struct.iter_unpack(buf))


def _fb_v1_upcall(w: World, ctx: int, client: int, sub: int, count: int, pointer: int,
                  data2: bytes | None, flags: int = 0) -> tuple[int, Verdict]:
    ctrl = L.NVOS54.struct.pack(client, sub, Ctrl.FB_GET_INFO, 0, 0x7F00, 16, 0)
    params = L.NV2080_CTRL_FB_GET_INFO_PARAMS.struct.pack(count, pointer)
    return w.upcall(ctx, ctrl, params, nr=Escape.RM_CONTROL, data2=data2, flags=flags)


def _fb_v1(w: World, ctx: int, client: int, sub: int, entries: dict[int, int],
           status: int = 0, data2: bytes | None = b"-") -> Verdict:
    """FB_GET_INFO upcall, then its POST upcall with the driver's list `entries`."""
    sent = _fb_list({i: 0 for i in entries})
    uid, verdict = _fb_v1_upcall(w, ctx, client, sub, len(entries), 0x7F0000004000, sent)
    assert verdict == ALLOW_POST
    after = L.NVOS54.struct.pack(client, sub, Ctrl.FB_GET_INFO, 0, 0x7F00, 16, status)
    params = L.NV2080_CTRL_FB_GET_INFO_PARAMS.struct.pack(len(entries), 0x7F0000004000)
    return w.post_upcall(ctx, uid, Escape.RM_CONTROL, after, params,
                         data2=_fb_list(entries) if data2 == b"-" else data2)


DRIVER_FB = {7: 4 * GIB // KIB, 8: 4 * GIB // KIB, 9: 4 * GIB // KIB - 1, 0x10: 5,
             0x16: 3 * GIB // KIB, 0x20: 4 * GIB // KIB}


def test_fb_get_info_v1_rule_names_its_list(w: World) -> None:
    """The v1 rule is the only one with a nested list: the control params'
    fbInfoList (@8) and fbInfoListSize (@0), entries of 8 bytes, at most 128."""
    filt = w.policy.filter()
    (nested,) = filt.nested
    rule = filt.rules[nested.rule]
    assert rule.match == (Ctrl.FB_GET_INFO,) and rule.nr == Escape.RM_CONTROL
    assert (nested.ptr_off, nested.count_off, nested.elem_size, nested.max_count) == (
        8, 0, 8, 128)
    assert Ctrl.FB_GET_INFO not in {m for r in filt.rules if r is not rule for m in r.match}


def test_fb_get_info_v1_rewrites_the_list_by_reply(w: World) -> None:
    client, device, sub = setup_gpu(w, 1)
    w.mem(1, client, device, 300 * MIB)
    reply = _fb_v1(w, 1, client, sub, DRIVER_FB)
    assert reply.action is VerdictAction.REPLY
    assert reply.params is None and reply.data is None
    # the same figures as FB_GET_INFO_V2 (shared code), in the same order
    assert _list_entries(reply.data2) == {7: GIB // KIB, 8: GIB // KIB, 9: GIB // KIB, 0x10: 5,
                                          0x16: 724 * MIB // KIB, 0x20: GIB // KIB}
    assert [i for i, _ in L.FB_INFO_ENTRY.struct.iter_unpack(reply.data2)] == list(DRIVER_FB)
    # a failed control keeps the driver's answer
    assert _fb_v1(w, 1, client, sub, DRIVER_FB, status=0x1F) == ALLOW


def test_fb_get_info_v1_without_a_list_keeps_the_drivers_answer(w: World) -> None:
    client, _, sub = setup_gpu(w, 1)
    # no DATA2 (a count of 0), or one that is not whole entries
    assert _fb_v1(w, 1, client, sub, DRIVER_FB, data2=None) == ALLOW
    assert _fb_v1(w, 1, client, sub, DRIVER_FB, data2=b"\0" * 12) == ALLOW
    # nothing to change: no REPLY
    assert _fb_v1(w, 1, client, sub, {0x10: 5}) == ALLOW


def test_fb_get_info_v1_list_the_module_could_not_copy_is_refused(w: World) -> None:
    """Too long (DATA2_BIG) or unreadable (DATA2_FAULT): the driver must not read
    the caller's list, so the call fails as the driver fails such a list."""
    client, _, sub = setup_gpu(w, 1)
    status_off = L.NVOS54.offsets["status"]
    _, v = _fb_v1_upcall(w, 1, client, sub, 129, 0x7F0000004000, None, UPCALL_F_DATA2_BIG)
    assert v == Verdict.fail_status(NvStatus.INVALID_ARGUMENT, status_off)
    _, v = _fb_v1_upcall(w, 1, client, sub, 6, 8, None, UPCALL_F_DATA2_FAULT)
    assert v == Verdict.fail_status(NvStatus.INVALID_ADDRESS, status_off)


# --- RM_VID_HEAP_CONTROL INFO ---


def _heap_info(client: int, parent: int, total: int = 0, free: int = 0, block: int = 0,
               status: int = 0) -> bytes:
    return L.NVOS32_INFO.struct.pack(client, parent, 5, 0, 0, status, total, free, 0, 0x1000,
                                     block, 0x2000)


def test_vid_heap_info_is_the_tenant_limit(w: World) -> None:
    client, device, sub = setup_gpu(w, 1)
    w.mem(1, client, device, 300 * MIB + 100)  # charged in pages: 300 MiB + 4 KiB
    for parent in (device, sub):
        uid, verdict = w.upcall(1, _heap_info(client, parent), nr=Escape.RM_VID_HEAP_CONTROL)
        assert verdict == ALLOW_POST
        reply = w.post_upcall(1, uid, Escape.RM_VID_HEAP_CONTROL,
                              _heap_info(client, parent, 4 * GIB, 3 * GIB, 3 * GIB))
        assert reply.action is VerdictAction.REPLY and reply.data is None
        free = GIB - 300 * MIB - 4 * KIB
        assert L.decode_vid_heap_info(reply.params) == L.VidHeapInfo(
            0, GIB, free, 0, 0x1000, free, 0x2000)
    # a largest free block below the tenant's free stays as the driver said
    uid, _ = w.upcall(1, _heap_info(client, device), nr=Escape.RM_VID_HEAP_CONTROL)
    reply = w.post_upcall(1, uid, Escape.RM_VID_HEAP_CONTROL,
                          _heap_info(client, device, 4 * GIB, 3 * GIB, 16 * MIB))
    assert L.decode_vid_heap_info(reply.params).size == 16 * MIB
    # a failed call keeps the driver's answer
    uid, _ = w.upcall(1, _heap_info(client, device), nr=Escape.RM_VID_HEAP_CONTROL)
    assert w.post_upcall(1, uid, Escape.RM_VID_HEAP_CONTROL,
                         _heap_info(client, device, status=0x1F)) == ALLOW


def test_vid_heap_info_outside_a_limit(w: World) -> None:
    c_client, c_device, _ = setup_gpu(w, 2, uid=3000)  # tenant c: no limit
    assert w.upcall(2, _heap_info(c_client, c_device),
                    nr=Escape.RM_VID_HEAP_CONTROL)[1] == ALLOW
    client, _, _ = setup_gpu(w, 1)
    assert w.upcall(1, _heap_info(client, 0x999),  # a device it never saw: no GPU to name
                    nr=Escape.RM_VID_HEAP_CONTROL)[1] == ALLOW


# --- restart: the charge journal ---


def test_restart_keeps_the_charges_of_live_contexts(tmp_path: Path) -> None:
    charges = tmp_path / "run" / "charges"
    w = World(tmp_path, journal=charges)
    client, device, sub = setup_gpu(w, 1)
    w.mem(1, client, device, 700 * MIB)
    b_client, b_device, _ = setup_gpu(w, 2, gpu=1, uid=5, cgroup="/pods/b-2")
    w.mem(2, b_client, b_device, 200 * MIB)
    other, other_device, _ = setup_gpu(w, 3)
    w.mem(3, other, other_device, 100 * MIB)
    w.journal.close()  # type: ignore[union-attr]  # the daemon is killed

    again = World(tmp_path, journal=charges)
    again.handles = itertools.count(0x8000)  # the driver hands out new handles
    assert again.policy.restored == {1, 2, 3}
    assert (again.used("a"), again.used("b", 1)) == (800 * MIB, 200 * MIB)
    # calls of a restored context keep its tenant (no relearning from the header)
    assert again.mem(1, client, device, 300 * MIB)[0].action is VerdictAction.FAIL_STATUS
    # the module lists 1 and 2: 3 was closed while no daemon ran
    live = [Context(ctx, 0x100, Node.CTL, 0, 100, 100, 1000, 1000) for ctx in (1, 2, 99)]
    again.policy.reconcile(live)
    assert (again.used("a"), again.used("b", 1)) == (700 * MIB, 200 * MIB)
    assert again.manager.contexts("a") == 1
    # the restored device still names its GPU, its subdevice serves the FB view
    assert again.mem(1, client, device, 400 * MIB)[0].action is VerdictAction.FAIL_STATUS
    assert again.mem(1, client, device, 300 * MIB)[0] == ALLOW
    assert again.used("a") == 1000 * MIB
    assert again.upcall(1, _heap_info(client, sub),
                        nr=Escape.RM_VID_HEAP_CONTROL)[1] == ALLOW_POST
    # frees of restored objects count; a restored context closes as any other
    again.free(1, client, device)
    assert again.used("a") == 0
    again.close(2)
    assert again.used("b", 1) == 0 and again.manager.contexts("b") == 0
    again.journal.close()  # type: ignore[union-attr]
    third = World(tmp_path, journal=charges)
    assert third.policy.restored == {1}
    assert third.ledger.snapshot() == again.ledger.snapshot()


def test_uvm_policies(w: World) -> None:
    w.open(1, uid=1000)  # a: count
    w.open(2, uid=5, cgroup="/pods/b-2")  # b: deny
    w.open(3, uid=3000)  # c: allow
    kw = dict(kind=UpcallKind.MMAP, node=Node.UVM)
    assert w.upcall(1, mmap_params(512 * MIB), **kw)[1] == ALLOW
    assert w.used("a", 0) == 512 * MIB
    assert w.upcall(1, mmap_params(600 * MIB), **kw)[1] == Verdict.deny(errno.ENOMEM)
    assert w.denied[-1].tenant == "a"
    assert w.upcall(2, mmap_params(4096), **kw)[1] == Verdict.deny(errno.ENOMEM)
    assert w.upcall(3, mmap_params(100 * GIB), **kw)[1] == ALLOW
    w.close(1)
    assert w.used("a", 0) == 0


def test_uvm_count_charges_the_first_allowed_gpu(w: World) -> None:
    w.manager.update_tenant("b", {"memory": "1GiB"})
    w.open(1, uid=5, cgroup="/pods/b")
    w.manager.create_tenant("d", {"gpus": [1], "memory": "1GiB", "match": [{"uid": 7}]})
    w.open(2, uid=7)
    assert w.upcall(2, mmap_params(MIB), kind=UpcallKind.MMAP, node=Node.UVM)[1] == ALLOW
    assert (w.used("d", 0), w.used("d", 1)) == (0, MIB)


def test_live_limit_changes(w: World) -> None:
    client, device, _ = setup_gpu(w, 1)
    w.mem(1, client, device, 900 * MIB)
    assert w.mem(1, client, device, 200 * MIB)[0].action is VerdictAction.FAIL_STATUS
    w.manager.update_tenant("a", {"memory": "2GiB"})
    assert w.mem(1, client, device, 200 * MIB)[0] == ALLOW
    w.manager.update_tenant("a", {"memory": "512MiB"})
    assert w.used("a") == 1100 * MIB  # nothing freed
    assert w.mem(1, client, device, 4 * KIB)[0].action is VerdictAction.FAIL_STATUS


def test_restart_learns_contexts_lazily(tmp_path: Path) -> None:
    w = World(tmp_path, default="c")
    w.uids[9] = 1000
    client = 0x4242
    # an alloc under a device the daemon never saw: GPU falls back to the tenant's first
    assert w.mem(9, client, 0x5000, MIB)[0] == ALLOW
    assert w.manager.contexts("a") == 1 and w.used("a", 0) == MIB
    assert w.free(9, client, 0x1234) == ALLOW  # allocated before the restart: ignored
    # cgroup rules match through the cgroup id lookup
    w.cgroups[0x100] = "/pods/b-9"
    w.uids[10] = 5
    assert w.mem(10, client, 0x5000, MIB)[0] == ALLOW
    assert w.manager.contexts("b") == 1 and w.used("b", 1) == MIB
    w.close(9)
    assert w.manager.contexts("a") == 0


def test_restart_without_a_tenant_refuses(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.uids[9] = 4
    assert w.mem(9, 1, 2, MIB)[0] == Verdict.deny(errno.EACCES)
    assert w.upcall(9, mmap_params(1), kind=UpcallKind.MMAP, node=Node.UVM)[1] == (
        Verdict.deny(errno.EACCES))


@pytest.mark.parametrize(("flags", "alloc", "status"), [
    (UPCALL_F_DATA_FAULT, None, NvStatus.INVALID_ADDRESS),
    (0, None, NvStatus.INVALID_ARGUMENT),
    (0, b"\0" * 100, NvStatus.INVALID_PARAM_STRUCT),
])
def test_unreadable_alloc_params_are_refused_safely(w: World, flags, alloc, status) -> None:
    client, device, _ = setup_gpu(w, 1)
    verdict, _ = w.rm_alloc(1, client, device, 0x40, alloc, flags=flags)
    assert verdict == Verdict.fail_status(status, 28)
    assert w.used("a") == 0 and w.d.counters.policy_errors == 0


def test_malformed_params_never_raise(w: World) -> None:
    setup_gpu(w, 1)
    for nr in (Escape.RM_ALLOC, Escape.RM_FREE, Escape.RM_DUP_OBJECT, Escape.RM_CONTROL,
               Escape.RM_VID_HEAP_CONTROL, Escape.RM_ALLOC_MEMORY):
        for size in (0, 3, 32, 48, 200):
            w.upcall(1, b"\xff" * size, b"\xff" * 7, nr=nr)
    w.upcall(1, b"\0" * 5, kind=UpcallKind.MMAP, node=Node.UVM)
    w.post(1, 12345, Escape.RM_ALLOC, b"\0")
    assert w.d.counters.policy_errors == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["alloc", "fail", "free", "dup", "raise", "lower",
                                           "close"]),
                          st.integers(1, 400), st.integers(0, 50)), max_size=40))
def test_charged_never_exceeds_the_limit_at_admission(ops) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        w = World(Path(tmp))
        ctx = 1
        client, device, _ = setup_gpu(w, ctx)
        handles: list[int] = []
        for op, mib, pick in ops:
            if op in ("alloc", "fail"):
                before = w.used("a")
                limit = w.ledger.usage("a", 0).limit
                verdict, h = w.mem(ctx, client, device, mib * MIB,
                                   status=OOM if op == "fail" else 0)
                if verdict == ALLOW:
                    assert before + mib * MIB <= limit
                    if op == "alloc":
                        handles.append(h)
                else:
                    assert before + mib * MIB > limit
                    assert verdict == Verdict.fail_status(OOM, 28)
            elif op == "free" and handles:
                w.free(ctx, client, handles.pop(pick % len(handles)))
            elif op == "dup" and handles:
                dup = L.NVOS55.struct.pack(client, device, 0, client, handles[pick % len(handles)],
                                           0, 0)
                uid, _ = w.upcall(ctx, dup, nr=Escape.RM_DUP_OBJECT)
                h = next(w.handles)
                w.post(ctx, uid, Escape.RM_DUP_OBJECT,
                       L.NVOS55.struct.pack(client, device, h, client,
                                            handles[pick % len(handles)], 0, 0))
                handles.append(h)
            elif op == "raise":
                w.manager.update_tenant("a", {"memory": f"{mib * 4}MiB"})
            elif op == "lower":
                w.manager.update_tenant("a", {"memory": f"{mib}MiB"})
            elif op == "close":
                w.close(ctx)
                ctx += 1
                client, device, _ = setup_gpu(w, ctx)
                handles = []
            usage = w.ledger.usage("a", 0)
            assert usage.reserved == 0
        w.close(ctx)
        assert w.used("a") == 0


# --- a tenant's gpus list (issue 10, item 14) ---


def test_open_of_a_gpu_outside_the_list_is_refused(tmp_path: Path) -> None:
    w = World(tmp_path)
    # tenant b: gpus = [1]
    verdict = w.upcall(2, kind=UpcallKind.OPEN, cgroup="/pods/b-1", uid=5, node=Node.GPU,
                       minor=0)[1]
    assert verdict == Verdict.deny(errno.EACCES)
    assert w.manager.contexts("b") == 0
    assert w.upcall(3, kind=UpcallKind.OPEN, cgroup="/pods/b-1", uid=5, node=Node.GPU,
                    minor=1)[1] == ALLOW


def test_device_outside_the_list_looks_absent(tmp_path: Path) -> None:
    w = World(tmp_path)
    assert w.open(2, uid=5, cgroup="/pods/b-1") == ALLOW
    client = w.client(2)
    dev = L.NV0080_ALLOC_PARAMETERS.struct.pack(0, 0, 0, 0, 0, 0, 0, 0, 0)
    verdict, _ = w.rm_alloc(2, client, client, 0x80, dev)
    assert verdict == Verdict.fail_status(NvStatus.INVALID_CLASS, 28)
    # no alloc params at all: the driver takes device 0, refused the same way
    assert w.rm_alloc(2, client, client, 0x80)[0] == Verdict.fail_status(
        NvStatus.INVALID_CLASS, 28)
    device, _sub = w.device(2, client, 1)
    assert w.ledger.gpu_of(Key(client, device)) == 1


def test_memory_under_an_unknown_parent_is_refused(tmp_path: Path) -> None:
    """The GPU a charge goes to is the GPU the driver will use: under a parent
    the daemon never saw, there is no such GPU, so nothing is allocated."""
    w = World(tmp_path)
    client, _device, sub = setup_gpu(w, 1)
    assert w.mem(1, client, 0x7777, MIB)[0] == Verdict.fail_status(
        NvStatus.INVALID_OBJECT_PARENT, 28)
    assert w.mem(1, client, client, MIB)[0] == Verdict.fail_status(
        NvStatus.INVALID_OBJECT_PARENT, 28)
    assert w.used("a", 0) == 0
    assert w.mem(1, client, sub, MIB)[0] == ALLOW
    assert w.used("a", 0) == MIB


# --- pid bindings name one process (issue 10, item 15) ---


def test_binding_follows_the_process_not_the_pid(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.processes[4242] = 700  # started 7 s after boot
    w.manager.bind(4242, "c")
    # the bound process: uid 7 matches no rule, the binding decides
    assert w.open(1, uid=7, tgid=4242, start_ns=7_000_000_000) == ALLOW
    assert w.manager.contexts("c") == 1
    # the same pid, a later process (the first exited): refused
    assert w.open(2, uid=7, tgid=4242, start_ns=9_000_000_000) == Verdict.deny(errno.EACCES)
    # a start the module did not send: no binding applies
    assert w.open(3, uid=7, tgid=4242) == Verdict.deny(errno.EACCES)
    assert w.manager.contexts("c") == 1


# --- upcalls the module gave up on (issue 10, item 12) ---


def test_an_abandoned_allocation_gives_its_reservation_back(tmp_path: Path) -> None:
    w = World(tmp_path)
    client, _device, sub = setup_gpu(w, 1)
    uid, verdict = w.mem_upcall(1, client, sub, 768 * MIB)
    assert verdict == ALLOW and w.used("a", 0) == 768 * MIB  # reserved
    w.abandon(1, uid)  # the caller timed out: the verdict was never taken
    assert w.used("a", 0) == 0
    assert w.mem(1, client, sub, 768 * MIB)[0] == ALLOW  # the whole quota is there


def test_an_abandoned_open_never_was(tmp_path: Path) -> None:
    w = World(tmp_path)
    uid, verdict = w.upcall(5, kind=UpcallKind.OPEN, cgroup="/", uid=1000)
    assert verdict == ALLOW and w.manager.contexts("a") == 1
    w.abandon(5, uid, UpcallKind.OPEN)
    assert w.manager.contexts("a") == 0
    w.manager.update_tenant("a", {"memory": "2GiB"})  # the tenant is idle again
    w.abandon(5, uid, UpcallKind.OPEN)  # twice, or unknown: nothing happens


def test_an_abandoned_uvm_mapping_is_uncharged(tmp_path: Path) -> None:
    w = World(tmp_path)
    assert w.open(1) == ALLOW
    uid, verdict = w.upcall(1, mmap_params(64 * MIB), kind=UpcallKind.MMAP, node=Node.UVM)
    assert verdict == ALLOW and w.used("a", 0) == 64 * MIB
    w.abandon(1, uid, UpcallKind.MMAP)
    assert w.used("a", 0) == 0


def test_an_abandoned_post_upcall_leaves_the_charge_to_its_post_event(tmp_path: Path) -> None:
    """The call behind a POST upcall happened: giving up on the POST changes
    nothing of what the call's POST event settles."""
    w = World(tmp_path)
    client, _device, sub = setup_gpu(w, 1)
    uid, verdict = w.mem_upcall(1, client, sub, 256 * MIB)
    assert verdict == ALLOW
    w.abandon(1, uid, UpcallKind.POST)
    assert w.used("a", 0) == 256 * MIB  # still reserved


def test_closed_contexts_keep_their_tenant_for_late_readers(w: World) -> None:
    from vgpud.policy.quota import CLOSED_KEPT
    setup_gpu(w, 1)
    assert w.policy.context_tenant(1) == "a" and w.policy.closed_context_tenant(1) is None
    w.close(1)
    assert w.policy.context_tenant(1) is None and w.policy.closed_context_tenant(1) == "a"
    for ctx in range(100, 100 + CLOSED_KEPT):  # the memory is bounded: oldest first out
        w.open(ctx)
        w.close(ctx)
    assert w.policy.closed_context_tenant(1) is None
    assert w.policy.closed_context_tenant(100 + CLOSED_KEPT - 1) == "a"
