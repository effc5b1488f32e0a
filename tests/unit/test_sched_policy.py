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
    Verdict,
    VerdictAction,
)
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import Ctrl, Escape, NvStatus
from vgpud.policy.dispatch import Dispatcher
from vgpud.policy.rules import rm_alloc_channel_groups, rm_control_cmds
from vgpud.policy.sched import SchedPolicy

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
    assert added == (*rm_alloc_channel_groups(post=True),
                     rm_control_cmds([Ctrl.GPFIFO_SCHEDULE], shadow=True))
    assert [(r.nr, r.size, r.match, r.post, r.shadow) for r in added] == [
        (Escape.RM_ALLOC, 32, (TSG,), True, True),
        (Escape.RM_ALLOC, 48, (TSG,), True, True),
        (Escape.RM_CONTROL, 32, (Ctrl.GPFIFO_SCHEDULE,), False, True),
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
