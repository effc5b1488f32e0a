"""SchedPolicy over the real QuotaPolicy: channel groups learned from upcalls and events."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from tests.support.quota_world import World, setup_gpu
from vgpud.core.groups import (
    Group,
    GroupEvent,
    GroupForgotten,
    GroupLearned,
    GroupPauseChanged,
    GroupTracker,
    group_id,
)
from vgpud.kernel.uapi import (
    ALLOW,
    ALLOW_SCHED_OFF,
    OFF_NONE,
    UPCALL_F_DATA_FAULT,
    Filter,
    Verdict,
    VerdictAction,
)
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import Ctrl, Escape, NvStatus
from vgpud.policy.dispatch import Dispatcher
from vgpud.policy.quota import QuotaPolicy
from vgpud.policy.rules import rm_alloc_channel_groups, rm_control_cmds, rm_dup_object
from vgpud.policy.sched import DEFAULT_TIMESLICE_US, MIN_TIMESLICE_US, SchedPolicy

TSG = 0xA06C


class Sink:
    """An observer of the tracker that records what it hears."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Group]] = []

    def notify(self, event: GroupEvent) -> None:
        match event:
            case GroupLearned(group):
                self.log.append(("created", group))
            case GroupForgotten(group):
                self.log.append(("freed", group))
            case GroupPauseChanged(group, paused):
                self.log.append(("paused" if paused else "resumed", group))


class SchedWorld(World):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.tracker = GroupTracker()
        self.sink = Sink()
        self.tracker.observers.subscribe(self.sink)
        self.sched = SchedPolicy(self.policy, self.tracker)
        self.d = Dispatcher(self.sched)

    def group(self, ctx: int, client: int, device: int, **kw) -> tuple[Verdict, int]:
        return self.rm_alloc(ctx, client, device, TSG, **kw)

    def groups(self) -> set[tuple[int, str, int, int, int]]:
        return {(g.ctx, g.tenant, g.gpu, g.client, g.handle) for g in self.tracker}


@pytest.fixture
def w(tmp_path: Path) -> SchedWorld:
    return SchedWorld(tmp_path)


def test_filter_adds_the_group_rules(w: SchedWorld) -> None:
    rules = w.sched.filter().rules
    assert rules[:len(w.policy.filter().rules)] == w.policy.filter().rules
    added = rules[len(w.policy.filter().rules):]
    # RM_FREE with POST is there already
    controls = (Ctrl.GPFIFO_SCHEDULE, Ctrl.SET_TIMESLICE, Ctrl.GET_TIMESLICE, Ctrl.PREEMPT,
                Ctrl.SET_INTERLEAVE_LEVEL, Ctrl.GET_INTERLEAVE_LEVEL)
    assert added == (*rm_alloc_channel_groups(post=True),
                     rm_control_cmds(controls, shadow=True))
    assert [(r.nr, r.size, r.match, r.post, r.shadow) for r in added] == [
        (Escape.RM_ALLOC, 32, (TSG,), True, True),
        (Escape.RM_ALLOC, 48, (TSG,), True, True),
        (Escape.RM_CONTROL, 32, tuple(sorted(controls)), False, True),
    ]
    assert added[0].ptr_off == added[1].ptr_off == OFF_NONE


def test_group_learned_with_tenant_gpu_and_owner(w: SchedWorld) -> None:
    client, device, _sub = setup_gpu(w, ctx=5, gpu=1)
    verdict, handle = w.group(5, client, device)
    assert verdict == ALLOW_SCHED_OFF  # the module makes it off
    (group,) = w.tracker
    assert group == Group(5, "a", 1, client, handle, device, 100)
    assert group.id == group_id(client, handle) == client << 32 | handle
    _, h64 = w.group(5, client, device, nvos=64)
    assert w.tracker.get(client, h64) is not None
    assert [kind for kind, _ in w.sink.log] == ["created", "created"]


def test_failed_allocs_are_not_groups(w: SchedWorld) -> None:
    client, device, _sub = setup_gpu(w, ctx=5)
    w.group(5, client, device, status=NvStatus.NO_MEMORY)
    uid, verdict = w.upcall(5, _nvos21(client, device, 0), nr=Escape.RM_ALLOC)
    assert verdict == ALLOW_SCHED_OFF
    w.post(5, uid, Escape.RM_ALLOC, _nvos21(client, device, 0x77), ret=-22)
    assert len(w.tracker) == 0


def test_group_on_an_unknown_device_takes_the_quota_policy_gpu(w: SchedWorld) -> None:
    assert w.open(6, uid=5, cgroup="/pods/b-1") == ALLOW  # tenant b: gpus = [1]
    w.group(6, 0xC1, 0xD1)
    assert w.groups() == {(6, "b", 1, 0xC1, next(iter(w.tracker)).handle)}


def test_frees_take_groups_their_device_and_client(w: SchedWorld) -> None:
    client, device, sub = setup_gpu(w, ctx=5)
    g1, g2 = w.group(5, client, device)[1], w.group(5, client, device)[1]
    w.free(5, client, g1, status=NvStatus.INVALID_ARGUMENT)  # failed: kept
    assert len(w.tracker) == 2
    w.free(5, client, sub)  # a sibling: nothing
    w.free(5, client, g1)
    assert [g.handle for g in w.tracker] == [g2]
    device2, _ = w.device(5, client, 0)
    g3 = w.group(5, client, device2)[1]
    w.free(5, client, device)
    assert [g.handle for g in w.tracker] == [g3]
    w.free(5, client, client)
    assert len(w.tracker) == 0
    assert [g.handle for kind, g in w.sink.log if kind == "freed"] == [g1, g2, g3]


def test_close_forgets_the_context_groups(w: SchedWorld) -> None:
    c1, d1, _ = setup_gpu(w, ctx=5)
    c2, d2, _ = setup_gpu(w, ctx=6)
    w.group(5, c1, d1)
    w.group(5, c1, d1)
    kept = w.group(6, c2, d2)[1]
    w.close(5)
    assert [(g.ctx, g.handle) for g in w.tracker] == [(6, kept)]
    assert not w.tracker.has_client(c1)


def test_refused_context_learns_nothing(w: SchedWorld) -> None:
    assert w.open(7, uid=5, cgroup="/nowhere") != ALLOW
    uid, verdict = w.upcall(7, _nvos21(0xC1, 0xD1, 0), nr=Escape.RM_ALLOC)
    assert verdict != ALLOW
    w.post(7, uid, Escape.RM_ALLOC, _nvos21(0xC1, 0xD1, 0x99))
    assert len(w.tracker) == 0


def test_a_failing_sink_leaves_the_quota_policy_whole(w: SchedWorld) -> None:
    class Broken:
        def notify(self, event: GroupEvent) -> None:
            raise RuntimeError("boom")

    client, device, _ = setup_gpu(w, ctx=5)
    w.tracker.observers.subscribe(Broken())
    w.group(5, client, device)
    assert w.d.counters.policy_errors == 1
    w.mem(5, client, device, 1 << 20)  # the quota side still works
    assert w.used("a") == 1 << 20


def _nvos21(client: int, parent: int, h_new: int, status: int = 0) -> bytes:
    return L.NVOS21.struct.pack(client, parent, h_new, TSG, 0, 0, status)


def test_only_channel_group_allocs_are_made_off(w: SchedWorld) -> None:
    client = w.client(5)
    dev_params = L.NV0080_ALLOC_PARAMETERS.struct.pack(0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert w.rm_alloc(5, client, client, 0x80, dev_params)[0] == ALLOW
    assert w.open(7, uid=5, cgroup="/nowhere") != ALLOW  # no tenant: not ours to schedule
    assert w.upcall(7, _nvos21(0xC1, 0xD1, 0), nr=Escape.RM_ALLOC)[1].flags == 0


def _schedule(w: SchedWorld, ctx: int, client: int, group: int, params: bytes | None,
              size: int = 3, **kw) -> Verdict:
    nvos54 = L.NVOS54.struct.pack(client, group, Ctrl.GPFIFO_SCHEDULE, 0, 0x7F00_0000_1000,
                                  size, 0)
    return w.upcall(ctx, nvos54, params, nr=Escape.RM_CONTROL, **kw)[1]


OWNER_OK = Verdict.fail_status(NvStatus.OK, L.NVOS54.offsets["status"])


def test_the_owner_schedule_is_answered_and_recorded_never_forwarded(w: SchedWorld) -> None:
    client, device, _ = setup_gpu(w, ctx=5)
    handle = w.group(5, client, device)[1]
    (group,) = w.tracker
    assert _schedule(w, 5, client, handle, b"\x01\x00\x00") == OWNER_OK  # on, as it is
    assert not w.tracker.paused(group) and len(w.sink.log) == 1
    assert _schedule(w, 5, client, handle, b"\x00\x00\x00") == OWNER_OK
    assert w.tracker.paused(group)
    assert _schedule(w, 5, client, handle, b"\x00\x00\x00") == OWNER_OK  # no change
    assert _schedule(w, 5, client, handle, b"\x02\x00\x00") == OWNER_OK  # NvBool: nonzero
    assert not w.tracker.paused(group)
    assert [kind for kind, _ in w.sink.log] == ["created", "paused", "resumed"]


def test_bad_owner_schedule_calls_change_nothing(w: SchedWorld) -> None:
    client, device, _ = setup_gpu(w, ctx=5)
    handle = w.group(5, client, device)[1]
    status = L.NVOS54.offsets["status"]
    assert _schedule(w, 5, client, handle, b"\x00\x00\x00\x00", size=4) == \
        Verdict.fail_status(NvStatus.INVALID_PARAM_STRUCT, status)
    assert _schedule(w, 5, client, handle, None, flags=UPCALL_F_DATA_FAULT) == \
        Verdict.fail_status(NvStatus.INVALID_ADDRESS, status)
    setup_gpu(w, ctx=6)  # tenant a too, another context: the owner's tenant
    assert _schedule(w, 6, client, handle, b"\x00\x00\x00") == OWNER_OK
    w.sink.log.clear()
    assert w.open(8, uid=5, cgroup="/pods/b-1") == ALLOW  # tenant b
    assert _schedule(w, 8, client, handle, b"\x01\x00\x00") == Verdict.deny(errno.EPERM)
    assert w.sink.log == []


def test_schedule_of_an_unknown_object_goes_to_the_driver(w: SchedWorld) -> None:
    client, _device, _ = setup_gpu(w, ctx=5)
    verdict = _schedule(w, 5, client, 0xBAD, b"\x01\x00\x00")
    assert verdict.action is VerdictAction.ALLOW and len(w.tracker) == 0


def test_filter_asks_for_dups_when_the_inner_policy_does_not(w: SchedWorld) -> None:
    class Bare(QuotaPolicy):
        def filter(self) -> Filter:
            return Filter(rules=tuple(r for r in super().filter().rules
                                      if r.nr != Escape.RM_DUP_OBJECT))

    bare = Bare(w.manager, w.ledger, cgroup_path=w.cgroups.get)
    rules = SchedPolicy(bare, GroupTracker()).filter().rules
    assert rules[-1] == rm_dup_object(shadow=True)
    assert sum(r.nr == Escape.RM_DUP_OBJECT for r in w.sched.filter().rules) == 1


# --- the owner's other scheduling controls (timeslice, interleave, preempt) ---

STATUS = L.NVOS54.offsets["status"]
INSUFFICIENT_PERMISSIONS, NOT_SUPPORTED = 0x1B, 0x56  # nvstatuscodes.h


def _control(w: SchedWorld, ctx: int, client: int, group: int, cmd: int,
             params: bytes | None, size: int | None = None, status: int = 0,
             **kw) -> tuple[bytes, Verdict]:
    """An owner's RM_CONTROL upcall: (the NVOS54 sent, the verdict)."""
    size = len(params or b"") if size is None else size
    nvos54 = L.NVOS54.struct.pack(client, group, cmd, 0, 0x7F00_0000_1000, size, status)
    return nvos54, w.upcall(ctx, nvos54, params, nr=Escape.RM_CONTROL, **kw)[1]


def _ts(us: int) -> bytes:
    return L.NVA06C_CTRL_TIMESLICE_PARAMS.struct.pack(us)


def _get_timeslice(w: SchedWorld, ctx: int, client: int, group: int) -> int:
    nvos54, verdict = _control(w, ctx, client, group, Ctrl.GET_TIMESLICE, _ts(0x5555),
                               status=0x77)
    assert verdict.action is VerdictAction.REPLY
    # The driver's copy-out: the caller's NVOS54 with status NV_OK, and the value.
    assert verdict.params == nvos54[:STATUS] + b"\0\0\0\0" + nvos54[STATUS + 4:]
    assert verdict.data is not None and verdict.data2 is None
    return L.decode_timeslice(verdict.data)


@pytest.fixture
def owned(w: SchedWorld) -> tuple[int, int]:
    """Tenant a's context 5 with one known group: (client, group handle)."""
    client, device, _ = setup_gpu(w, ctx=5)
    return client, w.group(5, client, device)[1]


def test_get_timeslice_answers_nvidia_default_until_set(w: SchedWorld,
                                                        owned: tuple[int, int]) -> None:
    client, handle = owned
    assert _get_timeslice(w, 5, client, handle) == DEFAULT_TIMESLICE_US == 1024
    assert w.d.counters.policy_errors == 0


def test_set_timeslice_is_recorded_per_group_and_never_forwarded(
        w: SchedWorld, owned: tuple[int, int]) -> None:
    client, handle = owned
    other = w.group(5, client, next(g.parent for g in w.tracker))[1]
    assert _control(w, 5, client, handle, Ctrl.SET_TIMESLICE, _ts(1_000_000))[1] == OWNER_OK
    assert _get_timeslice(w, 5, client, handle) == 1_000_000
    assert _get_timeslice(w, 5, client, other) == DEFAULT_TIMESLICE_US  # per group
    assert _control(w, 5, client, other, Ctrl.SET_TIMESLICE, _ts(2048))[1] == OWNER_OK
    assert _control(w, 5, client, handle, Ctrl.SET_TIMESLICE, _ts(2**64 - 1))[1] == OWNER_OK
    assert _get_timeslice(w, 5, client, handle) == 2**64 - 1
    assert _get_timeslice(w, 5, client, other) == 2048
    group = w.tracker.get(client, handle)
    assert group is not None and w.sched.requested_timeslice(group) == 2**64 - 1
    # Nothing reached the tracker's observers (the scheduler): no pause, no change.
    assert [kind for kind, _ in w.sink.log] == ["created", "created"]


def test_set_timeslice_below_the_driver_minimum(w: SchedWorld, owned: tuple[int, int]) -> None:
    client, handle = owned
    assert _control(w, 5, client, handle, Ctrl.SET_TIMESLICE, _ts(MIN_TIMESLICE_US))[1] == \
        OWNER_OK
    assert _control(w, 5, client, handle, Ctrl.SET_TIMESLICE, _ts(MIN_TIMESLICE_US - 1))[1] == \
        Verdict.fail_status(NOT_SUPPORTED, STATUS)
    assert _get_timeslice(w, 5, client, handle) == MIN_TIMESLICE_US  # unchanged


@pytest.mark.parametrize("cmd", [Ctrl.SET_TIMESLICE, Ctrl.GET_TIMESLICE, Ctrl.PREEMPT,
                                 Ctrl.SET_INTERLEAVE_LEVEL, Ctrl.GPFIFO_SCHEDULE])
def test_malformed_params_get_the_driver_status_and_change_nothing(
        w: SchedWorld, owned: tuple[int, int], cmd: int) -> None:
    client, handle = owned
    assert _control(w, 5, client, handle, Ctrl.SET_TIMESLICE, _ts(4096))[1] == OWNER_OK
    size = {Ctrl.SET_TIMESLICE: 8, Ctrl.GET_TIMESLICE: 8, Ctrl.PREEMPT: 8,
            Ctrl.SET_INTERLEAVE_LEVEL: 4, Ctrl.GPFIFO_SCHEDULE: 3}[cmd]
    struct_error = Verdict.fail_status(NvStatus.INVALID_PARAM_STRUCT, STATUS)
    for bad in (size - 1, size + 1, 0, 4096):  # short, long, none, big
        assert _control(w, 5, client, handle, cmd, b"\x01" * bad)[1] == struct_error
    # paramsSize that does not match the buffer copied
    assert _control(w, 5, client, handle, cmd, b"\x01" * size, size=size + 8)[1] == struct_error
    assert _control(w, 5, client, handle, cmd, None, size=size, flags=UPCALL_F_DATA_FAULT)[1] \
        == Verdict.fail_status(NvStatus.INVALID_ADDRESS, STATUS)
    assert _get_timeslice(w, 5, client, handle) == 4096
    group = w.tracker.get(client, handle)
    assert group is not None and not w.tracker.paused(group)
    assert [kind for kind, _ in w.sink.log] == ["created"]


def test_interleave_level_is_refused_as_to_an_unprivileged_client(
        w: SchedWorld, owned: tuple[int, int]) -> None:
    client, handle = owned
    level = L.NVA06C_CTRL_INTERLEAVE_LEVEL_PARAMS.struct.pack
    for value in (0, 1, 2, 7):  # LOW, MEDIUM, HIGH, invalid: the privilege check comes first
        assert _control(w, 5, client, handle, Ctrl.SET_INTERLEAVE_LEVEL, level(value))[1] == \
            Verdict.fail_status(INSUFFICIENT_PERMISSIONS, STATUS)
    # GET is not a control of KEPLER_CHANNEL_GROUP_A: the lookup fails, whatever the size.
    for params in (level(0), b"", b"\0" * 8):
        assert _control(w, 5, client, handle, Ctrl.GET_INTERLEAVE_LEVEL, params)[1] == \
            Verdict.fail_status(NOT_SUPPORTED, STATUS)
    assert [kind for kind, _ in w.sink.log] == ["created"]


def _preempt(wait: int, manual: int, timeout_us: int) -> bytes:
    return L.NVA06C_CTRL_PREEMPT_PARAMS.struct.pack(wait, manual, timeout_us)


def test_preempt_of_its_own_group_is_ok_and_issues_nothing(
        w: SchedWorld, owned: tuple[int, int]) -> None:
    client, handle = owned
    for params in (_preempt(0, 0, 0), _preempt(1, 0, 0xFFFF_FFFF), _preempt(1, 1, 1_000_000),
                   _preempt(0xFF, 0xFF, 0)):
        assert _control(w, 5, client, handle, Ctrl.PREEMPT, params)[1] == OWNER_OK
    assert _control(w, 5, client, handle, Ctrl.PREEMPT, _preempt(1, 1, 1_000_001))[1] == \
        Verdict.fail_status(NvStatus.INVALID_ARGUMENT, STATUS)
    assert [kind for kind, _ in w.sink.log] == ["created"]


@pytest.mark.parametrize("cmd, params", [
    (Ctrl.SET_TIMESLICE, _ts(1_000_000)), (Ctrl.GET_TIMESLICE, _ts(0)),
    (Ctrl.PREEMPT, _preempt(1, 0, 0)),
    (Ctrl.SET_INTERLEAVE_LEVEL, L.NVA06C_CTRL_INTERLEAVE_LEVEL_PARAMS.struct.pack(2)),
    (Ctrl.GET_INTERLEAVE_LEVEL, b"\0" * 4)])
def test_another_tenants_group_is_eperm(w: SchedWorld, owned: tuple[int, int], cmd: int,
                                        params: bytes) -> None:
    client, handle = owned
    assert w.open(8, uid=5, cgroup="/pods/b-1") == ALLOW  # tenant b
    assert _control(w, 8, client, handle, cmd, params)[1] == Verdict.deny(errno.EPERM)
    setup_gpu(w, ctx=6)  # tenant a, another context: the owner's tenant
    assert _control(w, 6, client, handle, cmd, params)[1].action is not VerdictAction.DENY
    assert _get_timeslice(w, 5, client, handle) == (
        1_000_000 if cmd == Ctrl.SET_TIMESLICE else DEFAULT_TIMESLICE_US)


@pytest.mark.parametrize("cmd", [Ctrl.SET_TIMESLICE, Ctrl.GET_TIMESLICE, Ctrl.PREEMPT,
                                 Ctrl.SET_INTERLEAVE_LEVEL, Ctrl.GET_INTERLEAVE_LEVEL])
def test_controls_of_an_unknown_object_go_to_the_driver(w: SchedWorld, cmd: int) -> None:
    client, _device, _ = setup_gpu(w, ctx=5)
    verdict = _control(w, 5, client, 0xBAD, cmd, b"\0" * 8)[1]
    assert verdict.action is VerdictAction.ALLOW and len(w.tracker) == 0


def test_a_freed_or_closed_group_forgets_its_timeslice(w: SchedWorld,
                                                       owned: tuple[int, int]) -> None:
    client, handle = owned
    device = next(g.parent for g in w.tracker)
    assert _control(w, 5, client, handle, Ctrl.SET_TIMESLICE, _ts(5000))[1] == OWNER_OK
    w.free(5, client, handle)
    assert _control(w, 5, client, handle, Ctrl.SET_TIMESLICE, _ts(1))[1].action is \
        VerdictAction.ALLOW  # unknown now: the driver's business
    again = w.group(5, client, device, h_new=handle)[1]  # the handle, reused
    assert again == handle and _get_timeslice(w, 5, client, handle) == DEFAULT_TIMESLICE_US
    assert _control(w, 5, client, handle, Ctrl.SET_TIMESLICE, _ts(6000))[1] == OWNER_OK
    w.close(5)
    assert w.sched._timeslices == {}


def _dup(w: SchedWorld, ctx: int, client: int, parent: int, src_client: int,
         src: int) -> Verdict:
    nvos55 = L.NVOS55.struct.pack(client, parent, 0, src_client, src, 0, 0)
    return w.upcall(ctx, nvos55, nr=Escape.RM_DUP_OBJECT)[1]


def test_a_known_group_cannot_be_duplicated(w: SchedWorld, owned: tuple[int, int]) -> None:
    """A duplicate handle would be unknown, and its controls would reach the driver."""
    client, handle = owned
    device = next(g.parent for g in w.tracker)
    client2 = w.client(5)
    assert _dup(w, 5, client2, client2, client, handle) == Verdict.deny(errno.EPERM)
    assert _dup(w, 5, client2, client2, client, device).action is VerdictAction.ALLOW
