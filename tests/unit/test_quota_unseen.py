"""Item 9: memory the quota never saw. Unknown and fabric memory classes are
refused, objects that make video memory implicitly are counted against the
tenant's object limits, and UVM calls that make video memory are refused to
tenants with uvm = "deny"."""

from __future__ import annotations

import errno
import struct
from pathlib import Path

import pytest

from tests.support.quota_world import World, setup_gpu
from vgpud.core.tenants import ObjectLimits, Tenant
from vgpud.kernel.uapi import (
    ALLOW,
    ALLOW_POST,
    OFF_NONE,
    Node,
    ObjOpKind,
    ObjQuery,
    ObjResult,
    Verdict,
    VerdictAction,
)
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import (
    LIMITED_CLASS_KIND,
    OBJECT_LIMIT_CLASSES,
    REFUSED_MEMORY_CLASSES,
    UNCHARGED_MEMORY_CLASSES,
    Escape,
    MemClass,
    NvStatus,
    UvmCmd,
)
from vgpud.policy.classes import UVM_ALLOCATING
from vgpud.policy.quota import QuotaPolicy
from vgpud.store.config import ConfigError, parse_config

TSG = 0xA06C
CHANNEL = 0xC86F
VASPACE = 0x90F1


@pytest.fixture
def w(tmp_path: Path) -> World:
    return World(tmp_path)


def held(policy: QuotaPolicy) -> dict[tuple[str, str], int]:
    """(tenant, kind) -> objects held, for every tenant and kind that holds any."""
    counts = {(t.name, kind): policy.objects.held(t.name, kind)
              for t in policy.directory.tenants for kind in set(LIMITED_CLASS_KIND.values())}
    return {slot: n for slot, n in counts.items() if n}


def _status(verdict: Verdict) -> int:
    assert verdict.action is VerdictAction.FAIL_STATUS, verdict
    return verdict.status


def test_filter_sends_every_class_up_after_the_named_ones(w: World) -> None:
    rules = w.policy.filter().rules
    allocs = [r for r in rules if r.nr == Escape.RM_ALLOC]
    # The catch-alls (no key) come last, one per params size, without POST.
    assert [(r.size, r.match_off, r.post) for r in allocs[-2:]] == [
        (L.NVOS21.size, OFF_NONE, False), (L.NVOS64.size, OFF_NONE, False)]
    assert all(r.match_off != OFF_NONE for r in allocs[:-2])
    limited = [r for r in allocs if set(r.match) == set(LIMITED_CLASS_KIND)]
    assert len(limited) == 2 and all(r.post and r.shadow for r in limited)
    mem = [r for r in rules if r.nr == Escape.RM_ALLOC_MEMORY]
    assert [r.match_off for r in mem][-1] == OFF_NONE
    uvm = {r.nr for r in rules if r.node_mask == 1 << Node.UVM}
    assert uvm == set(UVM_ALLOCATING)
    assert all(r.size == 0 and not r.shadow for r in rules if r.node_mask == 1 << Node.UVM)


@pytest.mark.parametrize("h_class", [*sorted(REFUSED_MEMORY_CLASSES), 0x3D, 0xEE, 0xFF, 0x43])
@pytest.mark.parametrize("nvos", [21, 64])
def test_refused_and_unknown_memory_classes(w: World, h_class: int, nvos: int) -> None:
    client, _, sub = setup_gpu(w, 1)
    verdict, _ = w.rm_alloc(1, client, sub, h_class, struct.pack("=48x"), nvos=nvos)
    assert _status(verdict) == NvStatus.INVALID_CLASS
    assert verdict.status_off == (28 if nvos == 21 else 40)
    assert w.used("a") == 0


ENGINES = [0x0, 0x1, 0x5, 0x79, 0xC6C0, 0xC8B5]  # roots, events, compute, copy


@pytest.mark.parametrize("h_class", [*sorted(UNCHARGED_MEMORY_CLASSES), *ENGINES])
def test_uncharged_classes_and_engine_objects_pass(w: World, h_class: int) -> None:
    client, device, _ = setup_gpu(w, 1)
    assert w.rm_alloc(1, client, device, h_class)[0] == ALLOW
    assert w.used("a") == 0


def test_fabric_is_refused(w: World) -> None:
    client, _, sub = setup_gpu(w, 1)
    fabric = struct.pack("=QQQI4xQII", 2 << 20, 64 << 20, 2 << 20, 0, 0, 0, 0)
    verdict, _ = w.rm_alloc(1, client, sub, MemClass.FABRIC, fabric)
    assert _status(verdict) == NvStatus.INVALID_CLASS


def _alloc_memory(w: World, ctx: int, client: int, parent: int, h_class: int) -> Verdict:
    params = L.NVOS02_WITH_FD.struct.pack(client, parent, 0, h_class, 0, 0, 4095, 0, 0)
    return w.upcall(ctx, params, nr=Escape.RM_ALLOC_MEMORY, node=Node.GPU)[1]


def test_alloc_memory_classes(w: World) -> None:
    client, device, _ = setup_gpu(w, 1)
    for h_class in (0x3E, 0x70, 0x71):
        assert _alloc_memory(w, 1, client, device, h_class) == ALLOW
    for h_class in (0xF8, 0x42, 0xC2, 0x1234):
        verdict = _alloc_memory(w, 1, client, device, h_class)
        assert _status(verdict) == NvStatus.INVALID_CLASS
        assert verdict.status_off == L.NVOS02_WITH_FD.offsets["status"]


@pytest.fixture
def lw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    """Tenant "a" with small object limits; "c" with the defaults."""
    import tests.support.quota_world as qw

    monkeypatch.setattr(qw, "CONFIG", qw.CONFIG.replace(
        'memory = "1GiB"\n',
        'memory = "1GiB"\nlimits = {{ channel_groups = 2, channels = 2, va_spaces = 1 }}\n', 1))
    return World(tmp_path)


def test_default_limits() -> None:
    assert ObjectLimits() == ObjectLimits(channel_groups=256, channels=1024, context_shares=1024,
                                          va_spaces=64, buffers=256)
    assert set(OBJECT_LIMIT_CLASSES) == set(ObjectLimits.model_fields)


def test_channel_groups_over_the_limit_are_refused_and_freed_again(lw: World) -> None:
    w = lw
    client, device, _ = setup_gpu(w, 1)
    groups = [w.rm_alloc(1, client, device, TSG) for _ in range(2)]
    assert all(v == ALLOW for v, _ in groups)
    verdict, _ = w.rm_alloc(1, client, device, TSG)
    assert _status(verdict) == NvStatus.INSUFFICIENT_RESOURCES
    assert held(w.policy) == {("a", "channel_groups"): 2}
    w.free(1, client, groups[0][1])
    assert w.rm_alloc(1, client, device, TSG)[0] == ALLOW
    # Freeing the device frees the groups under it.
    w.free(1, client, device)
    assert held(w.policy) == {}


def test_in_flight_allocations_count(lw: World) -> None:
    w = lw
    client, device, _ = setup_gpu(w, 1)
    params = L.NVOS21.struct.pack(client, device, 0, TSG, 0, 0, 0)
    first = w.upcall(1, params, nr=Escape.RM_ALLOC)
    second = w.upcall(1, params, nr=Escape.RM_ALLOC)
    third = w.upcall(1, params, nr=Escape.RM_ALLOC)
    assert first[1] == second[1] == ALLOW
    assert _status(third[1]) == NvStatus.INSUFFICIENT_RESOURCES
    # One fails in the driver: its place goes back.
    w.post(1, first[0], Escape.RM_ALLOC,
           L.NVOS21.struct.pack(client, device, 0, TSG, 0, 0, NvStatus.INSUFFICIENT_RESOURCES))
    w.abandon(1, second[0])
    assert w.rm_alloc(1, client, device, TSG)[0] == ALLOW
    assert held(w.policy) == {("a", "channel_groups"): 1}


def test_close_and_client_free_give_places_back(lw: World) -> None:
    w = lw
    client, device, _ = setup_gpu(w, 1)
    group = w.rm_alloc(1, client, device, TSG)[1]
    assert w.rm_alloc(1, client, group, CHANNEL)[0] == ALLOW
    assert w.rm_alloc(1, client, group, CHANNEL)[0] == ALLOW
    assert _status(w.rm_alloc(1, client, group, CHANNEL)[0]) == NvStatus.INSUFFICIENT_RESOURCES
    assert w.rm_alloc(1, client, device, VASPACE)[0] == ALLOW
    assert _status(w.rm_alloc(1, client, device, VASPACE)[0]) == NvStatus.INSUFFICIENT_RESOURCES
    w.free(1, client, group)  # its channels go with it
    assert held(w.policy) == {("a", "va_spaces"): 1}
    w.free(1, client, client)
    assert held(w.policy) == {}
    client, device, _ = setup_gpu(w, 2)
    w.rm_alloc(2, client, device, VASPACE)
    w.close(2)
    assert held(w.policy) == {}


def test_limits_are_per_tenant(lw: World) -> None:
    w = lw
    a_client, a_device, _ = setup_gpu(w, 1)
    c_client, c_device, _ = setup_gpu(w, 2, uid=3000)  # tenant c: the defaults
    assert w.rm_alloc(1, a_client, a_device, TSG)[0] == ALLOW
    assert w.rm_alloc(1, a_client, a_device, TSG)[0] == ALLOW
    assert _status(w.rm_alloc(1, a_client, a_device, TSG)[0]) == NvStatus.INSUFFICIENT_RESOURCES
    for _ in range(3):
        assert w.rm_alloc(2, c_client, c_device, TSG)[0] == ALLOW
    # Another file of the same tenant shares its limit.
    a2_client, a2_device, _ = setup_gpu(w, 3)
    assert _status(w.rm_alloc(3, a2_client, a2_device, TSG)[0]) == \
        NvStatus.INSUFFICIENT_RESOURCES


def test_a_limit_changed_at_runtime_applies_to_the_next_object(lw: World) -> None:
    """vgpuctl tenant set --limit: raised, the next group passes; lowered below
    what is held, nothing is freed and the next is refused."""
    w = lw
    client, device, _ = setup_gpu(w, 1)
    for _ in range(2):
        assert w.rm_alloc(1, client, device, TSG)[0] == ALLOW
    assert _status(w.rm_alloc(1, client, device, TSG)[0]) == NvStatus.INSUFFICIENT_RESOURCES
    w.manager.update_tenant("a", {"limits": {"channel_groups": 3}})
    assert w.rm_alloc(1, client, device, TSG)[0] == ALLOW
    w.manager.update_tenant("a", {"limits": {"channel_groups": 1}})
    assert _status(w.rm_alloc(1, client, device, TSG)[0]) == NvStatus.INSUFFICIENT_RESOURCES
    assert held(w.policy) == {("a", "channel_groups"): 3}


def test_a_dup_of_a_counted_object_is_counted(lw: World) -> None:
    w = lw
    client, device, _ = setup_gpu(w, 1)
    group = w.rm_alloc(1, client, device, TSG)[1]

    def dup() -> Verdict:
        params = L.NVOS55.struct.pack(client, device, 0, client, group, 0, 0)
        uid, verdict = w.upcall(1, params, nr=Escape.RM_DUP_OBJECT)
        if verdict == ALLOW:
            w.post(1, uid, Escape.RM_DUP_OBJECT,
                   L.NVOS55.struct.pack(client, device, 0x7777, client, group, 0, 0))
        return verdict

    assert dup() == ALLOW
    assert held(w.policy) == {("a", "channel_groups"): 2}
    assert _status(dup()) == NvStatus.INSUFFICIENT_RESOURCES
    w.free(1, client, group)  # the dup keeps the group: still counted once
    assert held(w.policy) == {("a", "channel_groups"): 1}


def test_uvm_calls_that_make_video_memory(w: World) -> None:
    w.open(1, uid=1000)  # a: count
    w.open(2, uid=5, cgroup="/pods/b-2")  # b: deny
    w.open(3, uid=3000)  # c: allow
    for cmd in UVM_ALLOCATING:
        assert w.upcall(1, nr=cmd, node=Node.UVM)[1] == ALLOW
        assert w.upcall(2, nr=cmd, node=Node.UVM)[1] == Verdict.deny(errno.ENOMEM)
        assert w.upcall(3, nr=cmd, node=Node.UVM)[1] == ALLOW
    assert w.upcall(2, nr=UvmCmd.REGISTER_GPU_VASPACE, node=Node.UVM)[1] == ALLOW


@pytest.mark.parametrize("limits, problem", [
    ("{ channel_groups = -1 }", "greater than or equal to 0"),
    ("{ channels = 1000001 }", "less than or equal to 1000000"),
    ('{ va_spaces = "8" }', "integer"),
    ("{ tsgs = 4 }", "unknown key"),
])
def test_bad_limits_are_config_errors(limits: str, problem: str) -> None:
    text = f'[[tenant]]\nname = "a"\nlimits = {limits}\n'
    with pytest.raises(ConfigError) as exc:
        parse_config(text)
    assert "limits" in str(exc.value) and problem in str(exc.value)


def test_limits_from_the_config() -> None:
    config = parse_config('[[tenant]]\nname = "a"\nlimits = { channel_groups = 8 }\n')
    (t,) = config.tenants
    assert t.limits == ObjectLimits(channel_groups=8)
    assert Tenant(name="b").limits == ObjectLimits()


@pytest.fixture
def tw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    """As lw, with the driver-truth check (a POST upcall per counted object)."""
    import tests.support.quota_world as qw

    monkeypatch.setattr(qw, "CONFIG", qw.CONFIG.replace(
        'memory = "1GiB"\n', 'memory = "1GiB"\nlimits = {{ channel_groups = 2 }}\n', 1))
    return World(tmp_path, truth=True)


def _class_of(objects: dict[int, int]):
    """An ObjQuery answerer: CLASS of the handles in ``objects``, else no such object."""
    def answer(query: ObjQuery) -> Verdict:
        (op,) = query.ops
        assert op.op is ObjOpKind.CLASS
        klass = objects.get(op.h_object)
        result = ObjResult(0, 0, klass) if klass is not None else ObjResult(0, 0x33, 0)
        verdict = query.resume([result])
        assert isinstance(verdict, Verdict)
        return verdict
    return answer


def test_a_counted_object_is_counted_on_the_drivers_truth(tw: World) -> None:
    """The results in the tenant's memory do not decide: a group whose status
    a sibling rewrote to a failure (or whose handle it rewrote) is counted when
    the driver holds it under the handle decided on; one the driver does not
    hold is not counted, whatever the results say."""
    w = tw
    client, device, _ = setup_gpu(w, 1)
    driver: dict[int, int] = {}
    answer = _class_of(driver)
    for h_new, made in ((0x702, False), (0x700, True), (0, True)):
        params = L.NVOS21.struct.pack(client, device, h_new, TSG, 0, 0, 0)
        uid, verdict = w.upcall(1, params, nr=Escape.RM_ALLOC)
        assert verdict.flags == ALLOW_POST.flags
        handle = h_new or L.NVOS21.struct.unpack(verdict.params)[2]
        assert (verdict.params is None) == bool(h_new)
        if made:
            driver[handle] = TSG
        lie = L.NVOS21.struct.pack(client, device, device, TSG, 0, 0,
                                   NvStatus.INSUFFICIENT_RESOURCES if made else NvStatus.OK)
        query = w.post_upcall(1, uid, Escape.RM_ALLOC, lie)
        assert isinstance(query, ObjQuery) and answer(query) == ALLOW
    assert held(w.policy) == {("a", "channel_groups"): 2}
    # At the limit now, for what nvsim holds.
    params = L.NVOS21.struct.pack(client, device, 0x703, TSG, 0, 0, 0)
    assert _status(w.upcall(1, params, nr=Escape.RM_ALLOC)[1]) == NvStatus.INSUFFICIENT_RESOURCES
