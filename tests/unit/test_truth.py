"""The driver's truth about an allocation (issue 10, items 7 and 8).

After an allowed allocation the quota policy charges what the driver says the
created object holds (VGPU_CMD_OBJECT: class, parent, size), asked for the
handle decided on from the checked IOCTL upcall, whatever the results in the
tenant's memory say: a status rewritten to a failure, a handle rewritten, a
size the driver rounded up. An object over the quota is freed and the caller
gets NV_ERR_NO_MEMORY (FAIL_STATUS answering the POST upcall)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.quota_world import World, _alloc_params, _mem, setup_gpu
from vgpud.core.ledger import Key
from vgpud.kernel.uapi import (
    ALLOW,
    ALLOW_POST,
    ObjOp,
    ObjOpKind,
    ObjQuery,
    ObjResult,
    Verdict,
)
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED, Escape, NvStatus
from vgpud.nvidia.pages import granule
from vgpud.policy.handles import GENERATED_HANDLES

MIB = 2**20
GIB = 2**30
OOM = NvStatus.NO_MEMORY
BAD_HANDLE = 0x33  # NV_ERR_INVALID_OBJECT_HANDLE


class Driver:
    """What the driver holds, by (client, handle): (class, parent, size)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.ops: list[ObjOp] = []
        self.free_fails = False

    def run(self, op: ObjOp) -> ObjResult:
        self.ops.append(op)
        obj = self.objects.get((op.h_client, op.h_object))
        if obj is None:
            return ObjResult(0, BAD_HANDLE, 0)
        klass, parent, size = obj
        match op.op:
            case ObjOpKind.CLASS:
                return ObjResult(0, 0, klass)
            case ObjOpKind.PARENT:
                return ObjResult(0, 0, parent)
            case ObjOpKind.MEM_SIZE:
                return ObjResult(0, 0, size)
            case ObjOpKind.FREE:
                if self.free_fails:
                    return ObjResult(0, 0x40, 0)  # NV_ERR_INVALID_STATE
                del self.objects[op.h_client, op.h_object]
                return ObjResult(0, 0, 0)
        raise AssertionError(op)

    def answer(self, answer: Verdict | ObjQuery) -> Verdict:
        while isinstance(answer, ObjQuery):
            answer = answer.resume([self.run(op) for op in answer.ops])
        return answer


@pytest.fixture
def w(tmp_path: Path) -> World:
    return World(tmp_path, truth=True)


def alloc(w: World, drv: Driver, client: int, parent: int, size: int, h_new: int, *,
          made: int | None = None, status: int = 0, shown: int | None = None) -> Verdict:
    """RM_ALLOC of `size` bytes of NV01_MEMORY_LOCAL_USER under `h_new`; the driver
    makes an object of `made` bytes (None: none), and the results the daemon reads
    show `status` and handle `shown` (default `h_new`)."""
    params = _alloc_params(client, parent, h_new, 0x40, 21, _mem(size))
    uid, verdict = w.upcall(1, params, _mem(size), nr=Escape.RM_ALLOC)
    if verdict != ALLOW_POST:
        return verdict
    if made is not None:
        drv.objects[client, h_new] = (0x40, parent, made)
    after = _alloc_params(client, parent, h_new if shown is None else shown, 0x40, 21,
                          _mem(size), status)
    return drv.answer(w.post_upcall(1, uid, Escape.RM_ALLOC, after, _mem(size)))


def test_a_status_rewritten_to_failure_is_charged_all_the_same(w: World) -> None:
    drv = Driver()
    client, _, sub = setup_gpu(w, 1)
    assert alloc(w, drv, client, sub, 64 * MIB, 0x100, made=64 * MIB, status=OOM) == ALLOW
    assert w.used("a") == 64 * MIB
    assert [op.op for op in drv.ops] == [ObjOpKind.CLASS, ObjOpKind.PARENT, ObjOpKind.MEM_SIZE]
    assert {op.h_object for op in drv.ops} == {0x100}


def test_a_handle_rewritten_in_the_results_is_not_the_one_charged(w: World) -> None:
    drv = Driver()
    client, _, sub = setup_gpu(w, 1)
    assert alloc(w, drv, client, sub, 64 * MIB, 0x100, made=64 * MIB, shown=0x999) == ALLOW
    assert Key(client, 0x100) in w.ledger and Key(client, 0x999) not in w.ledger
    assert w.used("a") == 64 * MIB


def test_a_success_without_an_object_charges_nothing(w: World) -> None:
    drv = Driver()
    client, _, sub = setup_gpu(w, 1)
    assert alloc(w, drv, client, sub, 64 * MIB, 0x100, made=None) == ALLOW
    assert w.used("a") == 0


def test_the_charge_is_the_size_the_driver_allocated(w: World) -> None:
    drv = Driver()
    client, _, sub = setup_gpu(w, 1)
    assert alloc(w, drv, client, sub, 4096, 0x100, made=2 * MIB) == ALLOW
    assert w.used("a") == 2 * MIB
    w.free(1, client, 0x100)
    assert w.used("a") == 0


def test_over_the_quota_by_its_true_size_is_freed_and_fails(w: World) -> None:
    drv = Driver()
    client, _, sub = setup_gpu(w, 1)
    for n in range(511):  # 2 MiB pages, asked 4 KiB at a time
        assert alloc(w, drv, client, sub, 4096, 0x100 + n, made=2 * MIB) == ALLOW
    assert w.used("a") == GIB - 2 * MIB
    # 4 KiB fit what is left; the 2 MiB the driver made for them do not.
    got = alloc(w, drv, client, sub, 4096, 0x400, made=2 * MIB + 4096)
    assert got == Verdict.fail_status(OOM, L.NVOS21.offsets["status"])
    assert drv.ops[-1] == ObjOp(1, client, sub, 0x400, ObjOpKind.FREE)
    assert (client, 0x400) not in drv.objects
    assert w.used("a") == GIB - 2 * MIB and len(w.denied) == 1


def test_an_object_that_cannot_be_freed_is_charged_over_the_limit(w: World) -> None:
    drv = Driver()
    client, _, sub = setup_gpu(w, 1)
    assert alloc(w, drv, client, sub, GIB - MIB, 0x100, made=GIB - MIB) == ALLOW
    drv.free_fails = True
    assert alloc(w, drv, client, sub, MIB, 0x101, made=2 * MIB) == ALLOW
    assert w.used("a") == GIB + MIB  # the truth, over the limit


def test_an_object_not_of_video_memory_is_not_charged(w: World) -> None:
    drv = Driver()
    client, _, sub = setup_gpu(w, 1)
    params = _alloc_params(client, sub, 0x100, 0x40, 21, _mem(MIB))
    uid, verdict = w.upcall(1, params, _mem(MIB), nr=Escape.RM_ALLOC)
    assert verdict == ALLOW_POST
    drv.objects[client, 0x100] = (0x50A0, sub, MIB)  # a virtual range, made before
    assert drv.answer(w.post_upcall(1, uid, Escape.RM_ALLOC, params, _mem(MIB))) == ALLOW
    assert w.used("a") == 0 and (client, 0x100) in drv.objects
    assert alloc(w, drv, client, sub, MIB, 0x101, made=None) == ALLOW
    assert w.used("a") == 0


@pytest.mark.parametrize("made", ["class", "parent"])
def test_video_memory_of_another_class_or_parent_is_freed_and_fails(w: World,
                                                                    made: str) -> None:
    """A sibling rewrote hClass or hObjectParent in the shadow after the check:
    the driver made video memory under the decided handle, but not what was
    decided on. It is undone, whatever the results say."""
    drv = Driver()
    client, device, sub = setup_gpu(w, 1)
    params = _alloc_params(client, sub, 0x102, 0x40, 21, _mem(MIB))
    uid, _ = w.upcall(1, params, _mem(MIB), nr=Escape.RM_ALLOC)
    klass, parent = (0x3F, sub) if made == "class" else (0x40, device)
    drv.objects[client, 0x102] = (klass, parent, 64 * MIB)
    got = drv.answer(w.post_upcall(1, uid, Escape.RM_ALLOC, params, _mem(MIB)))
    assert got == Verdict.fail_status(OOM, L.NVOS21.offsets["status"])
    assert drv.ops[-1] == ObjOp(1, client, parent, 0x102, ObjOpKind.FREE)
    assert (client, 0x102) not in drv.objects
    assert w.used("a") == 0
    drv.objects[client, 0x103] = (klass, parent, 64 * MIB)
    drv.free_fails = True  # what cannot be undone is charged
    params = _alloc_params(client, sub, 0x103, 0x40, 21, _mem(MIB))
    uid, _ = w.upcall(1, params, _mem(MIB), nr=Escape.RM_ALLOC)
    assert drv.answer(w.post_upcall(1, uid, Escape.RM_ALLOC, params, _mem(MIB))) == ALLOW
    assert w.used("a") == 64 * MIB


def test_a_handle_already_charged_is_not_charged_twice(w: World) -> None:
    drv = Driver()
    client, _, sub = setup_gpu(w, 1)
    assert alloc(w, drv, client, sub, MIB, 0x100, made=MIB) == ALLOW
    # The same handle again: the driver refuses it (duplicate), the old object stays.
    assert alloc(w, drv, client, sub, MIB, 0x100, made=MIB, status=0x19) == ALLOW
    assert w.used("a") == MIB


def test_without_the_truth_the_results_decide(w: World) -> None:
    client, _, sub = setup_gpu(w, 1)
    params = _alloc_params(client, sub, 0x100, 0x40, 21, _mem(MIB))
    uid, _ = w.upcall(1, params, _mem(MIB), nr=Escape.RM_ALLOC)
    query = w.post_upcall(1, uid, Escape.RM_ALLOC, params, _mem(MIB))
    assert isinstance(query, ObjQuery)
    assert query.resume(None) == ALLOW
    assert w.used("a") == MIB


def _named(verdict: Verdict, params: bytes, at: int) -> int:
    """The handle an ALLOW_POST names at ``at`` of ``params``; nothing else changed."""
    assert verdict._replace(params=None) == ALLOW_POST and verdict.params is not None
    handle = int.from_bytes(verdict.params[at:at + 4], "little")
    assert verdict.params[:at] + verdict.params[at + 4:] == params[:at] + params[at + 4:]
    return handle


def test_a_handle_the_driver_would_generate_is_named_by_the_daemon(w: World) -> None:
    """hObjectNew 0: the driver would name the object and report the name only
    in the tenant-writable results. The daemon names it instead (its ALLOW
    carries the params the driver reads), and asks the truth about that name,
    whatever the results say (here: rewritten to name the parent)."""
    drv = Driver()
    client, _, sub = setup_gpu(w, 1)
    params = _alloc_params(client, sub, 0, 0x40, 21, _mem(MIB))
    uid, verdict = w.upcall(1, params, _mem(MIB), nr=Escape.RM_ALLOC)
    handle = _named(verdict, params, L.NVOS21.offsets["hObjectNew"])
    first, count = GENERATED_HANDLES
    assert first <= handle < first + count
    drv.objects[client, handle] = (0x40, sub, 2 * MIB)
    rewritten = _alloc_params(client, sub, sub, 0x40, 21, _mem(MIB), status=OOM)
    assert drv.answer(w.post_upcall(1, uid, Escape.RM_ALLOC, rewritten, _mem(MIB))) == ALLOW
    assert [op.h_object for op in drv.ops] == [handle] * 3
    assert w.used("a") == 2 * MIB


def test_a_vid_heap_handle_is_named_with_memory_handle_provided(w: World) -> None:
    drv = Driver()
    client, device, _ = setup_gpu(w, 1)
    values = [0] * 28
    values[:3] = [client, device, 2]  # ALLOC_SIZE, hMemory 0, no flags
    values[19] = 3 * MIB
    params = L.NVOS32.struct.pack(*values)
    uid, verdict = w.upcall(1, params, nr=Escape.RM_VID_HEAP_CONTROL)
    assert verdict.params is not None
    named = list(L.NVOS32.struct.unpack(verdict.params))
    handle = named[9]
    assert GENERATED_HANDLES[0] <= handle and named[11] == NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED
    assert named[:9] + named[10:11] + named[12:] == values[:9] + values[10:11] + values[12:]
    drv.objects[client, handle] = (0x40, device, 4 * MIB)
    after = list(values)
    after[9] = device  # the tenant's rewrite of the results
    query = w.post_upcall(1, uid, Escape.RM_VID_HEAP_CONTROL, L.NVOS32.struct.pack(*after))
    assert drv.answer(query) == ALLOW
    assert w.used("a") == 4 * MIB


def test_a_named_handle_skips_those_the_ledger_holds(w: World) -> None:
    drv = Driver()
    client, _, sub = setup_gpu(w, 1)
    params = _alloc_params(client, sub, 0, 0x40, 21, _mem(MIB))
    at = L.NVOS21.offsets["hObjectNew"]
    handles = []
    for _ in range(2):
        uid, verdict = w.upcall(1, params, _mem(MIB), nr=Escape.RM_ALLOC)
        handles.append(_named(verdict, params, at))
        drv.objects[client, handles[-1]] = (0x40, sub, MIB)
        assert drv.answer(w.post_upcall(1, uid, Escape.RM_ALLOC, params, _mem(MIB))) == ALLOW
    assert handles[0] != handles[1] and w.used("a") == 2 * MIB
    assert all(Key(client, h) in w.ledger for h in handles)


def test_a_chosen_handle_is_the_callers(w: World) -> None:
    client, _, sub = setup_gpu(w, 1)
    params = _alloc_params(client, sub, 0x100, 0x40, 21, _mem(MIB))
    assert w.upcall(1, params, _mem(MIB), nr=Escape.RM_ALLOC)[1] == ALLOW_POST


def test_a_context_closed_during_the_query_leaves_nothing(w: World) -> None:
    drv = Driver()
    client, _, sub = setup_gpu(w, 1)
    params = _alloc_params(client, sub, 0x100, 0x40, 21, _mem(MIB))
    uid, _ = w.upcall(1, params, _mem(MIB), nr=Escape.RM_ALLOC)
    query = w.post_upcall(1, uid, Escape.RM_ALLOC, params, _mem(MIB))
    drv.objects[client, 0x100] = (0x40, sub, MIB)
    w.close(1)
    assert drv.answer(query) == ALLOW
    assert w.used("a") == 0


def test_a_resume_that_raises_keeps_the_results(w: World) -> None:
    client, _, sub = setup_gpu(w, 1)
    params = _alloc_params(client, sub, 0x100, 0x40, 21, _mem(MIB))
    uid, _ = w.upcall(1, params, _mem(MIB), nr=Escape.RM_ALLOC)
    query = w.post_upcall(1, uid, Escape.RM_ALLOC, params, _mem(MIB))
    assert isinstance(query, ObjQuery)
    assert query.resume([ObjResult(-errno.EIO, 0, 0)]) == ALLOW  # wrong count: guarded
    assert w.d.counters.policy_errors == 1


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 64), st.sampled_from([1, 16, 512]),
                          st.booleans(), st.booleans(), st.booleans()), max_size=40))
def test_the_ledger_holds_the_true_sizes_of_what_exists(tmp_path_factory, steps) -> None:
    """Whatever the results say, what the ledger charges is the sum of the true
    sizes of the tenant's objects, and never more than its limit."""
    w = World(tmp_path_factory.mktemp("w"), truth=True)
    drv = Driver()
    client, _, sub = setup_gpu(w, 1)
    for n, (pages, pages_per, made, spoof, free) in enumerate(steps):
        size = pages * 4096
        true = -(-size // (pages_per * 4096)) * pages_per * 4096
        alloc(w, drv, client, sub, size, 0x100 + n, made=true if made else None,
              status=OOM if spoof else 0, shown=0x999 if spoof else None)
        if free and (client, 0x100 + n) in drv.objects:
            del drv.objects[client, 0x100 + n]
            w.free(1, client, 0x100 + n)
        held = sum(s for (c, _h), (_k, _p, s) in drv.objects.items() if c == client)
        assert w.used("a") == held <= GIB


@pytest.mark.parametrize(("attr", "attr2", "alignment", "want"), [
    (0, 0, 0, 4096),
    (1 << 23, 0, 0, 4096),
    (2 << 23, 0, 0, 64 << 10),
    (3 << 23, 0, 0, 2 * MIB),
    (3 << 23, 1 << 20, 0, 2 * MIB),
    (3 << 23, 2 << 20, 0, 512 * MIB),
    (0, 0, 8 * MIB, 8 * MIB),
    (0, 0, 3 * MIB, 4096),  # not a power of two: the driver refuses it
    (3 << 23, 0, MIB, 2 * MIB),
])
def test_the_reservation_rounds_as_the_driver_does(attr, attr2, alignment, want) -> None:
    assert granule(attr, attr2, alignment) == want


def test_a_huge_page_reservation_holds_its_page(w: World) -> None:
    client, _, sub = setup_gpu(w, 1)
    values = [0] * 23
    values[6], values[7], values[13] = 3 << 23, 1 << 20, 4096  # attr HUGE, attr2 2MB, size
    mem = L.NV_MEMORY_ALLOCATION_PARAMS.struct.pack(*values)
    _, verdict = w.upcall(1, _alloc_params(client, sub, 0x100, 0x40, 21, mem), mem,
                          nr=Escape.RM_ALLOC)
    assert verdict == ALLOW_POST
    assert w.ledger.usage("a", 0).reserved == 2 * MIB
