"""ModuleActuator's v7 ops: TIMESLICE and PREEMPT entries, through the fake module.

Entries go in as the scheduler service sends them: built by timeslice_entries
and preempt_entries (as vgpud.sched.modes.to_entries does) and given to ``run``.

The channel is vgpud's GenlChannel on a socketpair with tests/support/fakekernel,
which checks the entries as the module does (an unknown op, or an arg where
the op takes none, refuses the message), so the bytes on the wire are judged.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Awaitable, Callable

import pytest

from tests.support.fakekernel import FAMILY, FakeKernel, make_context
from vgpud.kernel import channel as ch
from vgpud.kernel import uapi
from vgpud.kernel.uapi import Node, Sched, SchedResult, SchedState
from vgpud.sched.actuator import (
    GroupRef,
    ModuleActuator,
    level_entries,
    preempt_entries,
    timeslice_entries,
)

NOT_SUPPORTED = 0x56
A = GroupRef(1, 0xC1, 0xA1)
B = GroupRef(1, 0xC1, 0xA2)
GONE = GroupRef(9, 0xC1, 0xA3)  # no such context


def with_actuator(body: Callable[[ModuleActuator, FakeKernel], Awaitable[None]],
                  **fake: object) -> None:
    async def main() -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        fake.setdefault("contexts", [make_context(1)])
        kernel = FakeKernel(theirs, **fake)  # type: ignore[arg-type]
        kernel.start()
        channel = ch.GenlChannel(ours, FAMILY)
        channel.start()
        try:
            await channel.register()
            await body(ModuleActuator(channel), kernel)
        finally:
            channel.close()
            kernel.stop()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_entries() -> None:
    assert timeslice_entries([(A, 2048), (B, 1024)]) == [
        Sched(1, 0xC1, 0xA1, SchedState.TIMESLICE, 2048),
        Sched(1, 0xC1, 0xA2, SchedState.TIMESLICE, 1024)]
    assert preempt_entries([B]) == [Sched(1, 0xC1, 0xA2, SchedState.PREEMPT, 0)]
    assert level_entries([(B, 2)]) == [Sched(1, 0xC1, 0xA2, SchedState.INTERLEAVE, 2)]
    assert Sched(*A, SchedState.TIMESLICE, 7).pack() == uapi.SCHED.struct.pack(
        1, 0xC1, 0xA1, 3, 7)
    for bad in (-1, 1 << 32):
        with pytest.raises(ValueError, match="not a u32"):
            timeslice_entries([(A, bad)])


def test_timeslice_and_preempt_entries_reach_the_module() -> None:
    async def body(act: ModuleActuator, kernel: FakeKernel) -> None:
        assert await act.run(timeslice_entries([(A, 2048), (B, 0), (GONE, 1024)])) == [
            SchedResult(0, 0), SchedResult(0, NOT_SUPPORTED), SchedResult(-errno.ENOENT, 0)]
        assert await act.run(preempt_entries([A, GONE])) == [
            SchedResult(0, 0), SchedResult(-errno.ENOENT, 0)]
        assert kernel.schedules == [timeslice_entries([(A, 2048), (B, 0), (GONE, 1024)]),
                                    preempt_entries([A, GONE])]
        s = act.stats
        assert (s.calls, s.entries, s.timeslices, s.preempts, s.failed, s.gone) == (
            2, 5, 3, 2, 1, 2)
        assert s.counts()["timeslices"] == 3 and s.counts()["preempts"] == 2

    with_actuator(body, statuses={(0xC1, 0xA2): NOT_SUPPORTED})


def test_refused_message_gives_no_results() -> None:
    """The module refuses a bad op whole: every entry of the call is None, one error."""
    async def body(act: ModuleActuator, kernel: FakeKernel) -> None:
        bad = [Sched(*A, SchedState.ON, 5), Sched(*B, 6)]  # an arg ON does not take; no op 6
        for entry in bad:
            assert await act.run([Sched(*A, SchedState.PREEMPT), entry]) == [None, None]
        assert kernel.schedules == []
        assert act.stats.errors == 2

    with_actuator(body)


def test_chunks_keep_one_result_per_entry() -> None:
    groups = [GroupRef(1, 0xC1, h) for h in range(uapi.SCHED_MAX + 3)]

    async def body(act: ModuleActuator, kernel: FakeKernel) -> None:
        out = await act.run(timeslice_entries((g, 1000 + g.h_object) for g in groups))
        assert out == [SchedResult(0, 0)] * len(groups)
        assert [len(c) for c in kernel.schedules] == [uapi.SCHED_MAX, 3]
        assert [e.arg for c in kernel.schedules for e in c] == [1000 + g.h_object for g in groups]

    with_actuator(body)


def test_a_node_that_is_not_nvidiactl() -> None:
    async def body(act: ModuleActuator, kernel: FakeKernel) -> None:
        assert await act.run(preempt_entries([GroupRef(2, 0xC1, 0xA1)])) == [
            SchedResult(-errno.EINVAL, 0)]
        assert act.stats.failed == 1

    with_actuator(body, contexts=[make_context(1), make_context(2, Node.GPU, minor=0)])
