"""The channel against a fake kernel on a socketpair(AF_UNIX, SOCK_DGRAM),
and the real netlink family lookup (this host has no vgpu module)."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from tests.support.fakekernel import (
    FAMILY,
    FakeKernel,
    close_event_msg,
    genl,
    make_stats,
    make_stats4,
    post_event_msg,
    upcall_msg,
)
from tests.support.policies import DenyClasses
from vgpud.kernel import channel as ch
from vgpud.kernel.uapi import PROTO_VERSION, Cmd, Filter, VerdictAction
from vgpud.nvidia import layouts as L
from vgpud.policy.dispatch import Dispatcher

ALLOC21 = L.NVOS21.struct.pack(1, 2, 3, 0x40, 0, 0, 0)


class Recorder(Dispatcher):
    def __init__(self) -> None:
        super().__init__(DenyClasses({0x40}))
        self.events: list = []

    def on_event(self, event) -> None:
        super().on_event(event)
        self.events.append(event)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def pair(handler=None, **fake):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    kernel = FakeKernel(theirs, **fake)
    kernel.start()
    channel = ch.GenlChannel(ours, FAMILY, handler)
    channel.start()
    return channel, kernel


def test_register_filter_stats_unregister() -> None:
    async def main():
        channel, kernel = await pair(stats=make_stats(upcalls=3))
        await channel.register()
        await channel.set_filter(DenyClasses({0x40}).filter())
        stats = await channel.get_stats()
        await channel.unregister()
        assert kernel.requests == [Cmd.REGISTER, Cmd.SET_FILTER, Cmd.GET_STATS, Cmd.UNREGISTER]
        assert kernel.filters == [DenyClasses({0x40}).filter()]
        assert stats.upcalls == 3
        channel.close()
        kernel.stop()

    run(main())


@pytest.mark.parametrize("v4", [True, False], ids=["stats4", "no-stats4"])
def test_counters_carry_stats4_when_the_module_sends_it(v4: bool) -> None:
    async def main():
        stats4 = make_stats4(throttled=9) if v4 else None
        channel, kernel = await pair(stats=make_stats(upcalls=3), stats4=stats4)
        stats, got4 = await channel.get_counters()
        assert stats.upcalls == 3
        assert got4 == stats4
        channel.close()
        kernel.stop()

    run(main())


@pytest.mark.parametrize(("err", "exc", "text"), [
    (errno.EBUSY, ch.AlreadyRegistered, "another vgpud is registered"),
    (errno.EPERM, ch.NotPermitted, "CAP_NET_ADMIN"),
    (errno.EPROTONOSUPPORT, ch.ProtocolMismatch,
     f"module speaks protocol v{PROTO_VERSION + 1}, daemon v{PROTO_VERSION}"),
    (errno.EINVAL, ch.RequestFailed, "register failed: Invalid argument"),
])
def test_register_errors(err: int, exc: type, text: str) -> None:
    async def main():
        channel, kernel = await pair(errors={Cmd.REGISTER: err},
                                     stats=make_stats(version=PROTO_VERSION + 1))
        with pytest.raises(exc, match=text):
            await channel.register()
        channel.close()
        kernel.stop()

    run(main())


def test_request_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ch, "REQUEST_TIMEOUT", 0.05)

    async def main():
        channel, kernel = await pair(silent={Cmd.REGISTER})
        with pytest.raises(ch.ChannelError, match="no answer"):
            await channel.register()
        channel.close()
        kernel.stop()

    run(main())


def test_a_cancel_that_meets_the_reply_cancels() -> None:
    """The reply arrives and the caller is cancelled in the same loop turn
    (a refresher stopped while GET_STATS is answered): the caller ends
    cancelled, as asked; Python 3.11's asyncio.wait_for would return the
    reply instead, and the refresher would go on, its stop() waiting forever."""

    async def main():
        channel, kernel = await pair(silent={Cmd.GET_STATS})
        task = asyncio.create_task(channel.get_counters())
        while not channel._pending:
            await asyncio.sleep(0)
        (pending,) = channel._pending.values()
        pending.future.set_result([])
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not channel._pending
        channel.close()
        kernel.stop()

    run(main())


def test_upcalls_get_verdicts_and_events_reach_the_handler() -> None:
    async def main():
        handler = Recorder()
        channel, kernel = await pair(handler)
        kernel.send(upcall_msg(ALLOC21, id=11, nr=0x2B))
        assert await kernel.verdicts.get() == (11, VerdictAction.FAIL_STATUS, 0, 0x51, 28, 0, 0)
        kernel.send(post_event_msg(7, 11, 0x2B, 0, ALLOC21) + close_event_msg(7))
        kernel.send(upcall_msg(b"\0" * 16, id=12, nr=0x29))
        assert await kernel.verdicts.get() == (12, VerdictAction.ALLOW, 0, 0, 0, 0, 0)
        assert [type(e).__name__ for e in handler.events] == ["PostEvent", "CloseEvent"]
        assert channel.stats.verdicts_sent == 2
        channel.close()
        kernel.stop()

    run(main())


def test_malformed_upcall_is_answered_when_its_id_is_readable() -> None:
    async def main():
        handler = Recorder()
        channel, kernel = await pair(handler)
        kernel.send(genl(Cmd.UPCALL, b"\x02\0"))  # unreadable: no answer
        kernel.send(upcall_msg(ALLOC21, id=13, kind=7))
        assert await kernel.verdicts.get() == (13, VerdictAction.DENY, errno.EPROTO, 0, 0, 0, 0)
        assert (handler.counters.malformed, handler.counters.unanswered) == (2, 1)
        channel.close()
        kernel.stop()

    run(main())


def test_refused_verdicts_are_counted_not_fatal() -> None:
    async def main():
        channel, kernel = await pair(Recorder(), late=True)
        kernel.send(upcall_msg(ALLOC21, id=14))
        await kernel.verdicts.get()
        for _ in range(50):
            if channel.stats.refused_verdicts:
                break
            await asyncio.sleep(0.01)
        assert channel.stats.refused_verdicts == 1
        kernel.send(upcall_msg(ALLOC21, id=15))
        assert (await kernel.verdicts.get())[0] == 15
        channel.close()
        kernel.stop()

    run(main())


class OverrunOnce:
    """A socket whose first recv fails with ENOBUFS, as netlink does on overrun."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._overrun = True

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def recvfrom(self, size: int) -> tuple[bytes, object]:
        if self._overrun:
            self._overrun = False
            raise OSError(errno.ENOBUFS, "No buffer space available")
        return self._sock.recvfrom(size)


def test_enobufs_is_counted_and_reading_goes_on() -> None:
    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        kernel = FakeKernel(theirs)
        kernel.start()
        channel = ch.GenlChannel(OverrunOnce(ours), FAMILY, Recorder())
        channel.start()
        kernel.send(upcall_msg(ALLOC21, id=16))
        assert (await kernel.verdicts.get())[0] == 16
        assert channel.stats.enobufs == 1
        channel.close()
        kernel.stop()

    run(main())


class AsNetlink:
    """Our end of the pair as a netlink socket: each datagram comes from the next
    address in ``sources``, else from the kernel's (nl_pid 0)."""

    family = socket.AF_NETLINK

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.sources: list[tuple[int, int]] = []

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def recvfrom(self, size: int) -> tuple[bytes, tuple[int, int]]:
        buf, _ = self._sock.recvfrom(size)
        return buf, self.sources.pop(0) if self.sources else ch.KERNEL


def test_a_message_not_from_the_kernel_is_dropped_and_the_next_handled(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        kernel = FakeKernel(theirs)
        kernel.start()
        sock = AsNetlink(ours)
        recorder = Recorder()
        channel = ch.GenlChannel(sock, FAMILY, recorder)
        channel.start()
        sock.sources = [(4321, 0), (0, 1), (4321, 0)]
        kernel.send(upcall_msg(ALLOC21, id=15))  # a forged upcall: no verdict
        kernel.send(close_event_msg(7))  # from the kernel, but a multicast group
        kernel.send(close_event_msg(8))  # a forged CLOSE: nothing forgotten
        kernel.send(upcall_msg(ALLOC21, id=16))
        assert (await kernel.verdicts.get())[0] == 16
        assert kernel.verdicts.empty() and recorder.events == []
        assert channel.stats.foreign == 3 and channel.stats.datagrams == 4
        channel.close()
        kernel.stop()

    run(main())
    warned = [r for r in caplog.records if "not the kernel" in r.getMessage()]
    assert len(warned) == 1 and "4321" in warned[0].getMessage()  # rate-limited


def test_the_real_socket_takes_unicasts_from_the_kernel_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GenlChannel.open connects its socket to the kernel: another port's
    unicast is refused by the kernel (NETLINK_USERSOCK here: any uid may
    send on it, and this host has no vgpu family)."""
    async def family(name: str = "vgpu") -> int:
        return FAMILY

    monkeypatch.setattr(ch, "resolve_family", family)
    monkeypatch.setattr(ch, "NETLINK_GENERIC", 2)  # NETLINK_USERSOCK

    async def main():
        channel = await ch.GenlChannel.open(Recorder(), rcvbuf=1 << 16)
        forger = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 2)
        try:
            forger.bind((0, 0))
            with pytest.raises(ConnectionRefusedError):
                forger.sendto(upcall_msg(ALLOC21, id=17), channel._sock.getsockname())
        finally:
            forger.close()
            channel.close()

    run(main())


def test_peer_gone_closes_the_channel_and_fails_requests() -> None:
    async def main():
        channel, kernel = await pair(silent={Cmd.REGISTER})
        task = asyncio.create_task(channel.register())
        await asyncio.sleep(0.01)
        kernel.send(b"")
        await channel.wait_closed()
        with pytest.raises(ch.ChannelError, match="channel closed"):
            await task
        with pytest.raises(ch.ChannelError, match="not running"):
            await channel.set_filter(Filter())
        channel.close()
        kernel.stop()

    run(main())


def test_real_netlink_family_missing() -> None:
    with pytest.raises(ch.FamilyNotFound,
                       match=r"generic netlink family 'vgpu' not found: is vgpu.ko loaded\?"):
        run(ch.GenlChannel.open())


def test_real_netlink_family_lookup_works() -> None:
    assert run(ch.resolve_family("nlctrl")) == 0x10
