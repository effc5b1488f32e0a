"""LIST_CONTEXTS and SCHEDULE: the codec, and the channel against the fake kernel."""

from __future__ import annotations

import asyncio
import errno
import socket
import struct

import pytest

from tests.support.fakekernel import (
    FAMILY,
    FakeKernel,
    attr,
    contexts_msg,
    genl,
    make_context,
    parse_request,
    sched_results_msg,
)
from vgpud.kernel import channel as ch
from vgpud.kernel import codec, uapi
from vgpud.kernel.codec import DecodeError, Reply
from vgpud.kernel.uapi import Attr, Cmd, Context, Node, Sched, SchedResult


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def reply_of(msg: bytes) -> Reply:
    (out,) = codec.decode_datagram(msg, FAMILY)
    assert isinstance(out, Reply), out
    return out


# --- codec ---------------------------------------------------------------------


def test_encode_list_contexts() -> None:
    seq, _flags, cmd, attrs = parse_request(codec.encode_list_contexts(FAMILY, 9, cursor=77))
    assert (seq, cmd) == (9, Cmd.LIST_CONTEXTS)
    assert attrs == {Attr.CURSOR: struct.pack("=Q", 77)}


def test_encode_schedule_keeps_order() -> None:
    entries = [Sched(5, 0xC1, 0xA1, False), Sched(6, 0xC2, 0xA2, True)]
    _seq, _flags, cmd, attrs = parse_request(codec.encode_schedule(FAMILY, 3, entries))
    assert cmd == Cmd.SCHEDULE
    assert list(uapi.SCHED.struct.iter_unpack(attrs[Attr.SCHED])) == [
        (5, 0xC1, 0xA1, 0, 0), (6, 0xC2, 0xA2, 1, 0)]


@pytest.mark.parametrize("count", [0, uapi.SCHED_MAX + 1])
def test_encode_schedule_refuses_counts(count: int) -> None:
    with pytest.raises(ValueError, match="1 to 256 entries"):
        codec.encode_schedule(FAMILY, 1, [Sched(1, 2, 3, True)] * count)


def test_decode_contexts() -> None:
    ctxs = [make_context(3), make_context(8, Node.GPU, minor=1, uid=0, cgroup_id=2**40)]
    page, cursor = codec.decode_contexts(reply_of(contexts_msg(4, ctxs, 12)))
    assert (page, cursor) == (ctxs, 12)
    assert page[1].node is Node.GPU
    assert codec.decode_contexts(reply_of(contexts_msg(4, [], 0))) == ([], 0)


def _raw_contexts(raw: bytes, cursor: bytes | None = struct.pack("=Q", 0),
                  cmd: int = Cmd.LIST_CONTEXTS) -> Reply:
    attrs = [attr(Attr.CONTEXTS, raw)]
    if cursor is not None:
        attrs.append(attr(Attr.CURSOR, cursor))
    return reply_of(genl(cmd, *attrs, seq=1))


def _ctx_bytes(*ids: int, node: int = 0) -> bytes:
    return b"".join(uapi.CONTEXT.struct.pack(i, 1, node, 0, 2, 2, 0, 0) for i in ids)


@pytest.mark.parametrize(("reply", "text"), [
    (_raw_contexts(_ctx_bytes(1)[:-1]), "context bytes"),
    (_raw_contexts(_ctx_bytes(1), cursor=None), "not a LIST_CONTEXTS reply"),
    (_raw_contexts(_ctx_bytes(1), cursor=b"\0" * 4), "cursor of 4"),
    (_raw_contexts(_ctx_bytes(1), cmd=Cmd.GET_STATS), "not a LIST_CONTEXTS reply"),
    (_raw_contexts(_ctx_bytes(1, node=7)), "bad context"),
    (_raw_contexts(_ctx_bytes(4, 2)), "out of ctx_id order"),
    (_raw_contexts(_ctx_bytes(4, 4)), "out of ctx_id order"),
    (_raw_contexts(_ctx_bytes(4, 6), struct.pack("=Q", 5)), "out of ctx_id order"),
    (_raw_contexts(b"", struct.pack("=Q", 5)), "out of ctx_id order"),
])
def test_decode_contexts_refuses(reply: Reply, text: str) -> None:
    with pytest.raises(DecodeError, match=text):
        codec.decode_contexts(reply)


def test_decode_contexts_refuses_too_many() -> None:
    too_many = _ctx_bytes(*range(1, uapi.LIST_MAX + 2))
    reply = Reply(1, Cmd.LIST_CONTEXTS, {Attr.CONTEXTS: too_many, Attr.CURSOR: bytes(8)})
    with pytest.raises(DecodeError, match="context bytes"):
        codec.decode_contexts(reply)


def test_decode_sched_results() -> None:
    results = [SchedResult(0, 0), SchedResult(-errno.ENOENT, 0), SchedResult(0, 0x33)]
    assert codec.decode_sched_results(reply_of(sched_results_msg(2, results)), 3) == results
    with pytest.raises(DecodeError, match="24 bytes for 2 entries"):
        codec.decode_sched_results(reply_of(sched_results_msg(2, results)), 2)
    wrong = reply_of(genl(Cmd.LIST_CONTEXTS, attr(Attr.SCHED_RESULT, bytes(8)), seq=2))
    with pytest.raises(DecodeError, match="not a SCHEDULE reply"):
        codec.decode_sched_results(wrong, 1)


# --- channel -------------------------------------------------------------------


async def pair(**fake) -> tuple[ch.GenlChannel, FakeKernel]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    kernel = FakeKernel(theirs, **fake)
    kernel.start()
    channel = ch.GenlChannel(ours, FAMILY)
    channel.start()
    return channel, kernel


def close(channel: ch.GenlChannel, kernel: FakeKernel) -> None:
    channel.close()
    kernel.stop()


@pytest.mark.parametrize(("count", "page", "cursors"), [
    (0, uapi.LIST_MAX, [0]),
    (5, uapi.LIST_MAX, [0]),
    (5, 2, [0, 7, 11]),
    (6, 2, [0, 7, 11]),
    (7, 2, [0, 7, 11, 15]),
])
def test_list_contexts_follows_the_cursor(count: int, page: int, cursors: list[int]) -> None:
    live = [make_context(3 + 2 * i, Node(i % 3)) for i in range(count)]

    async def main() -> list[Context]:
        channel, kernel = await pair(contexts=live, list_page=page)
        try:
            out = await channel.list_contexts()
            assert kernel.cursors == cursors
            return out
        finally:
            close(channel, kernel)

    assert run(main()) == live


def test_list_contexts_bad_cursor() -> None:
    """A cursor that does not move past the page (a broken module) ends the walk."""
    async def main() -> None:
        channel, kernel = await pair()
        kernel._list_contexts = lambda seq, attrs: kernel.send(
            contexts_msg(seq, [make_context(4)], 2))
        with pytest.raises(DecodeError, match="out of ctx_id order"):
            await channel.list_contexts()
        close(channel, kernel)

    run(main())


def test_schedule_results_in_order() -> None:
    live = [make_context(1), make_context(2, Node.GPU, minor=0)]
    entries = [Sched(1, 0xC1, 0xA1, False), Sched(9, 0xC1, 0xA2, True),
               Sched(2, 0xC1, 0xA3, True), Sched(1, 0xC1, 0xBAD, True)]

    async def main() -> list[SchedResult]:
        channel, kernel = await pair(contexts=live, statuses={(0xC1, 0xBAD): 0x33})
        try:
            await channel.register()
            out = await channel.schedule(entries)
            assert kernel.schedules == [entries]
            return out
        finally:
            close(channel, kernel)

    assert run(main()) == [SchedResult(0, 0), SchedResult(-errno.ENOENT, 0),
                           SchedResult(-errno.EINVAL, 0), SchedResult(0, 0x33)]


def test_schedule_chunks_above_sched_max() -> None:
    live = [make_context(i) for i in range(1, 601)]
    entries = [Sched(i, 0xC0, 0xA0 + i, bool(i % 2)) for i in range(1, 601)]

    async def main() -> None:
        channel, kernel = await pair(contexts=live,
                                     statuses={(0xC0, 0xA0 + 300): 0x1F})
        await channel.register()
        out = await channel.schedule(entries)
        assert [len(batch) for batch in kernel.schedules] == [256, 256, 88]
        assert [e for batch in kernel.schedules for e in batch] == entries
        assert len(out) == 600
        assert out[299] == SchedResult(0, 0x1F)
        assert all(r == SchedResult(0, 0) for i, r in enumerate(out) if i != 299)
        close(channel, kernel)

    run(main())


def test_schedule_nothing_sends_nothing() -> None:
    async def main() -> None:
        channel, kernel = await pair()
        assert await channel.schedule([]) == []
        assert kernel.requests == []
        close(channel, kernel)

    run(main())


def test_schedule_not_registered_is_request_failed() -> None:
    async def main() -> None:
        channel, kernel = await pair(contexts=[make_context(1)])
        with pytest.raises(ch.RequestFailed, match="registered daemon only") as info:
            await channel.schedule([Sched(1, 2, 3, True)])
        assert info.value.errno == errno.EPERM
        assert kernel.schedules == []
        close(channel, kernel)

    run(main())


def test_schedule_refused_midway() -> None:
    """A refused second request raises; the first one has been applied."""
    entries = [Sched(1, 2, 3, True)] * (uapi.SCHED_MAX + 1)

    async def main() -> None:
        channel, kernel = await pair(contexts=[make_context(1)])
        await channel.register()
        real = kernel._schedule

        def once(seq, attrs):
            kernel.errors[Cmd.SCHEDULE] = errno.EINVAL  # every later request
            return real(seq, attrs)

        kernel._schedule = once
        with pytest.raises(ch.RequestFailed, match="schedule failed: Invalid argument") as info:
            await channel.schedule(entries)
        assert info.value.errno == errno.EINVAL
        assert [len(batch) for batch in kernel.schedules] == [uapi.SCHED_MAX]
        close(channel, kernel)

    run(main())
