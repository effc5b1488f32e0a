"""The quota daemon with its scheduler wired in: channel groups learned from the fake
kernel's upcalls and events, switched (frame mode) or given their timeslices (runlist
mode) through the channel, all back on (and the default timeslice back) at stop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.support import daemon_world
from tests.support.daemon_world import inventory, write_config
from tests.support.fakekernel import make_context, post_event_msg, upcall_msg
from vgpud.app import build_quota
from vgpud.daemon import Daemon
from vgpud.host.systemd import Notifier
from vgpud.kernel.uapi import (
    VERDICT_F_POST,
    VERDICT_F_SCHED_OFF,
    Sched,
    SchedResult,
    SchedState,
    UpcallKind,
    VerdictAction,
)
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import Escape
from vgpud.policy.dispatch import Dispatcher
from vgpud.policy.sched import SchedPolicy

TENANT_B = '\n[[tenant]]\nname = "b"\nmatch = [{ uid = 2000 }]\n'


class World(daemon_world.World):
    def __init__(self, tmp_path: Path, mode: str = "frame") -> None:
        super().__init__(tmp_path)
        config = write_config(tmp_path, TENANT_B)
        config.write_text(config.read_text().replace(
            "[daemon]\n", f'[daemon]\nsched_mode = "{mode}"\n', 1))
        self.policy, self.admin = build_quota(config, "off", inventory)
        self.ids = iter(range(1, 1000))
        self.scheduled: list[list[Sched]] = []

    def daemon(self) -> Daemon:
        return Daemon(Dispatcher(self.policy), self.policy.filter(), self.admin,
                      open_channel=self.open_channel, notifier=Notifier(self.notify_path))

    async def schedule(self, entries: Sequence[Sched]) -> list[SchedResult]:
        self.scheduled.append(list(entries))
        return [SchedResult(0, 0)] * len(entries)

    async def alloc(self, ctx: int, uid: int, client: int, parent: int, h_class: int,
                    handle: int, alloc: bytes | None = None) -> int:
        """An RM_ALLOC the driver names ``handle`` (hObjectNew 0), as the
        module runs it; returns the handle of the object made."""
        k = self.kernel
        upcall_id = next(self.ids)
        size, ptr = (0, 0) if alloc is None else (len(alloc), 0x7F0000001000)
        params = L.NVOS21.struct.pack(client, parent, 0, h_class, ptr, size, 0)
        k.send(upcall_msg(params, alloc, id=upcall_id, ctx_id=ctx, nr=Escape.RM_ALLOC,
                          uid=uid, tgid=uid))
        verdict = await k.verdicts.get()
        assert verdict[:2] == (upcall_id, VerdictAction.ALLOW)
        if h_class != 0xA06C:
            assert verdict[5] == 0  # flags
            after = L.NVOS21.struct.pack(client, parent, handle, h_class, ptr, size, 0)
            k.send(post_event_msg(ctx, upcall_id, Escape.RM_ALLOC, 0, after, alloc))
            return handle
        # A channel group: off before the call returns, counted on the driver's
        # truth (a POST upcall), under the handle the daemon named.
        assert verdict[5] == VERDICT_F_SCHED_OFF | VERDICT_F_POST
        named = k.blocks[upcall_id][0]
        assert named is not None
        handle = L.NVOS21.struct.unpack(named)[2]
        k.objects[client, handle] = (h_class, parent, 0)
        after = L.NVOS21.struct.pack(client, parent, handle, h_class, ptr, size, 0)
        k.send(upcall_msg(after, alloc, id=upcall_id, ctx_id=ctx, nr=Escape.RM_ALLOC,
                          kind=UpcallKind.POST, uid=uid, tgid=uid))
        assert (await k.verdicts.get())[:2] == (upcall_id, VerdictAction.ALLOW)
        return handle

    async def tenant_with_group(self, ctx: int, uid: int, client: int) -> int:
        """A context with a client, a device and a channel group: the group's handle."""
        k = self.kernel
        k.contexts.append(make_context(ctx))
        k.send(upcall_msg(kind=UpcallKind.OPEN, id=next(self.ids), ctx_id=ctx, uid=uid,
                          cgroup="/"))
        assert (await k.verdicts.get())[1] == VerdictAction.ALLOW
        await self.alloc(ctx, uid, 0, 0, 0x41, client)
        device = L.NV0080_ALLOC_PARAMETERS.struct.pack(0, 0, 0, 0, 0, 0, 0, 0, 0)
        await self.alloc(ctx, uid, client, client, 0x80, 0xD0, device)
        return await self.alloc(ctx, uid, client, 0xD0, 0xA06C, 0)


def test_daemon_switches_groups_and_restores_them(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    world = World(tmp_path)
    assert isinstance(world.policy, SchedPolicy)
    scheduler = world.admin.scheduler
    assert scheduler is not None

    async def main() -> None:
        daemon = world.daemon()
        serving = asyncio.create_task(daemon.serve())
        assert (await world.notification()).startswith("READY=1")
        assert daemon.channel is not None
        daemon.channel.schedule = world.schedule  # type: ignore[attr-defined]
        ga = await world.tenant_with_group(7, 1000, 0xC1)  # a: runnable at once, picked, on
        gb = await world.tenant_with_group(8, 2000, 0xC2)  # b: created outside its slot
        assert ga != gb
        for _ in range(100):
            if len(world.scheduled) >= 2:
                break
            await asyncio.sleep(0.01)
        assert world.scheduled[:2] == [[Sched(7, 0xC1, ga, True)],
                                       [Sched(8, 0xC2, gb, False)]]
        assert len(scheduler.tracker) == 2
        # frames of 100 ms, equal weights: within 0.3 s both have been switched in
        await asyncio.sleep(0.3)
        ons = {(e.ctx_id, e.enable) for call in world.scheduled for e in call}
        assert {(7, False), (7, True), (8, True)} <= ons
        os.kill(os.getpid(), signal.SIGTERM)
        assert await serving == 0
        assert sorted(world.scheduled[-1]) == [Sched(7, 0xC1, ga, True),
                                               Sched(8, 0xC2, gb, True)]

    asyncio.run(asyncio.wait_for(main(), 20))
    world.close()
    (stats,) = [m for m in caplog.messages if m.startswith("scheduler stats")]
    assert "'failed': 0" in stats and "'errors': 0" in stats


def test_daemon_in_runlist_mode_sets_timeslices_and_restores_them(tmp_path: Path) -> None:
    world = World(tmp_path, "runlist")

    async def main() -> None:
        daemon = world.daemon()
        serving = asyncio.create_task(daemon.serve())
        assert (await world.notification()).startswith("READY=1")
        assert daemon.channel is not None
        daemon.channel.schedule = world.schedule  # type: ignore[attr-defined]
        ga = await world.tenant_with_group(7, 1000, 0xC1)
        gb = await world.tenant_with_group(8, 2000, 0xC2)
        for _ in range(100):
            if len(world.scheduled) >= 2:
                break
            await asyncio.sleep(0.01)
        # equal weights, one group each: the driver's 1024 us, then on (never off)
        assert world.scheduled[:2] == [
            [Sched(7, 0xC1, ga, SchedState.TIMESLICE, 1024), Sched(7, 0xC1, ga, True)],
            [Sched(8, 0xC2, gb, SchedState.TIMESLICE, 1024), Sched(8, 0xC2, gb, True)]]
        await asyncio.sleep(0.3)
        assert len(world.scheduled) == 2  # no cap, no priority: nothing more to do
        os.kill(os.getpid(), signal.SIGTERM)
        assert await serving == 0
        assert world.scheduled[-1] == [
            Sched(7, 0xC1, ga, SchedState.TIMESLICE, 1024),
            Sched(8, 0xC2, gb, SchedState.TIMESLICE, 1024),
            Sched(7, 0xC1, ga, True), Sched(8, 0xC2, gb, True)]

    asyncio.run(asyncio.wait_for(main(), 20))
    world.close()
