"""OBJECT (the driver's truth): the codec, the channel against the fake kernel,
and a POST upcall answered after an OBJECT round trip."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Sequence

import pytest

from tests.support.fakekernel import (
    FAMILY,
    FakeKernel,
    make_context,
    obj_results_msg,
    parse_request,
    upcall_msg,
)
from vgpud.kernel import channel as ch
from vgpud.kernel import codec, uapi
from vgpud.kernel.codec import DecodeError, Event, Reply, Upcall
from vgpud.kernel.uapi import (
    Attr,
    Cmd,
    Node,
    ObjOp,
    ObjOpKind,
    ObjQuery,
    ObjResult,
    UpcallKind,
    Verdict,
)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_encode_object_keeps_order() -> None:
    ops = [ObjOp(5, 0xC1, 0, 0xA1, ObjOpKind.CLASS), ObjOp(6, 0xC2, 0xD, 0xA2, ObjOpKind.FREE)]
    _seq, _flags, cmd, attrs = parse_request(codec.encode_object(FAMILY, 3, ops))
    assert cmd == Cmd.OBJECT
    assert list(uapi.OBJ_OP.struct.iter_unpack(attrs[Attr.OBJ])) == [
        (5, 0xC1, 0, 0xA1, 1), (6, 0xC2, 0xD, 0xA2, 4)]


@pytest.mark.parametrize("count", [0, uapi.OBJ_MAX + 1])
def test_encode_object_refuses_counts(count: int) -> None:
    with pytest.raises(ValueError, match="1 to 64 operations"):
        codec.encode_object(FAMILY, 1, [ObjOp(1, 2, 0, 3, ObjOpKind.CLASS)] * count)


def test_decode_obj_results() -> None:
    results = [ObjResult(0, 0, 2**40), ObjResult(-errno.ENOENT, 0, 0)]
    (reply,) = codec.decode_datagram(obj_results_msg(4, results), FAMILY)
    assert isinstance(reply, Reply)
    assert codec.decode_obj_results(reply, 2) == results
    with pytest.raises(DecodeError, match="for 3 operations"):
        codec.decode_obj_results(reply, 3)


async def pair(handler=None, **fake) -> tuple[ch.GenlChannel, FakeKernel]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    kernel = FakeKernel(theirs, **fake)
    kernel.start()
    channel = ch.GenlChannel(ours, FAMILY, handler)
    channel.start()
    return channel, kernel


def test_object_results_in_order() -> None:
    live = [make_context(1), make_context(2, Node.GPU, minor=0)]
    ops = [ObjOp(1, 0xC1, 0, 0xA1, ObjOpKind.MEM_SIZE), ObjOp(9, 0xC1, 0, 0xA1, ObjOpKind.CLASS),
           ObjOp(2, 0xC1, 0, 0xA1, ObjOpKind.CLASS), ObjOp(1, 0xC1, 0, 0xBAD, ObjOpKind.CLASS),
           ObjOp(1, 0xC1, 0xD, 0xA1, ObjOpKind.FREE), ObjOp(1, 0xC1, 0, 0xA1, ObjOpKind.PARENT)]

    async def main() -> list[ObjResult]:
        channel, kernel = await pair(contexts=live, objects={(0xC1, 0xA1): (0x40, 0xD, 2 << 20)})
        try:
            await channel.register()
            out = await channel.object_ops(ops)
            assert kernel.obj_requests == [ops]
            return out
        finally:
            channel.close()
            kernel.stop()

    assert run(main()) == [ObjResult(0, 0, 2 << 20), ObjResult(-errno.ENOENT, 0, 0),
                           ObjResult(-errno.EINVAL, 0, 0), ObjResult(0, 0x33, 0),
                           ObjResult(0, 0, 0), ObjResult(0, 0x33, 0)]


def test_object_not_registered_is_request_failed() -> None:
    async def main() -> None:
        channel, kernel = await pair(contexts=[make_context(1)])
        with pytest.raises(ch.RequestFailed, match="registered daemon only") as info:
            await channel.object_ops([ObjOp(1, 2, 0, 3, ObjOpKind.CLASS)])
        assert info.value.errno == errno.EPERM
        channel.close()
        kernel.stop()

    run(main())


class Asking:
    """A handler whose POST verdict waits for the size of (0xC1, 0xA1)."""

    def __init__(self) -> None:
        self.seen: list[Sequence[ObjResult] | None] = []

    def on_upcall(self, upcall: Upcall) -> Verdict | ObjQuery:
        def resume(results: Sequence[ObjResult] | None) -> Verdict:
            self.seen.append(results)
            return Verdict.fail_status(0x51, 28)

        return ObjQuery((ObjOp(upcall.ctx_id, 0xC1, 0, 0xA1, ObjOpKind.MEM_SIZE),), resume)

    def on_event(self, event: Event) -> None: ...

    def on_malformed(self, error: DecodeError) -> Verdict | None:
        return None


@pytest.mark.parametrize("registered", [True, False])
def test_a_post_upcall_is_answered_after_the_truth(registered: bool) -> None:
    handler = Asking()

    async def main() -> tuple:
        channel, kernel = await pair(handler, contexts=[make_context(7)],
                                     objects={(0xC1, 0xA1): (0x40, 0xD, 4096)})
        try:
            if registered:
                await channel.register()
            kernel.send(upcall_msg(b"\0" * 32, id=42, ctx_id=7, kind=UpcallKind.POST, nr=0x2B))
            return await kernel.verdicts.get()
        finally:
            channel.close()
            kernel.stop()

    verdict = run(main())
    assert verdict[:5] == (42, uapi.VerdictAction.FAIL_STATUS, 0, 0x51, 28)
    # Without the truth (the request refused), resume is told so.
    assert handler.seen == ([[ObjResult(0, 0, 4096)]] if registered else [None])
