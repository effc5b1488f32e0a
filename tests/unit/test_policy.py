"""Policies and the daemon's dispatcher (sans-I/O)."""

from __future__ import annotations

import errno

import pytest

from tests.support.fakekernel import FAMILY, genl, upcall_msg
from tests.support.policies import AllowAll, DenyClasses, parse_policy
from vgpud.kernel import codec, uapi
from vgpud.kernel.uapi import ALLOW, Cmd, Filter, Node, UpcallKind, Verdict, VerdictAction
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import Escape, NvStatus
from vgpud.policy.base import Request
from vgpud.policy.dispatch import Dispatcher
from vgpud.policy.rules import rm_alloc_classes


def upcall(params: bytes, nr: int = Escape.RM_ALLOC, **kw) -> codec.Upcall:
    (msg,) = codec.decode_datagram(upcall_msg(params, nr=nr, **kw), FAMILY)
    return msg


ALLOC21 = L.NVOS21.struct.pack(1, 2, 3, 0x40, 0, 0, 0)
ALLOC64 = L.NVOS64.struct.pack(1, 2, 3, 0x40, 0, 0, 0, 0, 0)
DEVICE21 = L.NVOS21.struct.pack(1, 2, 3, 0x80, 0, 0, 0)


def test_deny_classes_answers_out_of_memory_at_the_status_offset() -> None:
    policy = DenyClasses({0x40})
    assert policy.filter() == Filter(rules=rm_alloc_classes([0x40]))
    d = Dispatcher(policy)
    assert d.on_upcall(upcall(ALLOC21)) == Verdict(VerdictAction.FAIL_STATUS, 0, 0x51, 28)
    assert d.on_upcall(upcall(ALLOC64)) == Verdict(VerdictAction.FAIL_STATUS, 0, 0x51, 40)
    assert d.on_upcall(upcall(DEVICE21)) == ALLOW
    assert d.counters.upcalls == d.counters.verdicts == 3


def test_allow_all() -> None:
    d = Dispatcher(AllowAll())
    assert AllowAll().filter() == Filter()
    assert d.on_upcall(upcall(b"", kind=UpcallKind.OPEN, cgroup="/")) == ALLOW


def test_parse_policy() -> None:
    assert isinstance(parse_policy("allow"), AllowAll)
    deny = parse_policy("deny-class:0x40,0x3f")
    assert isinstance(deny, DenyClasses) and deny.classes == {0x40, 0x3F}
    assert deny.status == NvStatus.NO_MEMORY
    for bad in ("deny", "deny-class:", "allow:1", "deny-class:x"):
        with pytest.raises(ValueError):
            parse_policy(bad)


class Broken:
    def __init__(self, verdict=None) -> None:
        self.verdict = verdict

    def filter(self) -> Filter:
        return Filter()

    def decide(self, request: Request) -> Verdict:
        if self.verdict is None:
            raise RuntimeError("bug")
        return self.verdict

    def on_event(self, event) -> None:
        raise RuntimeError("bug")


@pytest.mark.parametrize("verdict", [None, "ALLOW", Verdict.fail_status(0x51, 30)])
def test_policy_failures_get_the_safe_verdict(verdict) -> None:
    d = Dispatcher(Broken(verdict))
    assert d.on_upcall(upcall(ALLOC21)) == Verdict.deny(errno.EIO)
    assert d.counters.policy_errors == 1
    assert Dispatcher(Broken(verdict), fail_open=True).on_upcall(upcall(ALLOC21)) == ALLOW


def test_fail_status_on_open_is_refused() -> None:
    d = Dispatcher(Broken(Verdict.fail_status(0x51, 0)))
    assert d.on_upcall(upcall(b"", kind=UpcallKind.OPEN)) == Verdict.deny(errno.EIO)


def test_event_failure_is_counted() -> None:
    d = Dispatcher(Broken())
    d.on_event(codec.CloseEvent(1))
    assert (d.counters.events, d.counters.policy_errors) == (1, 1)


def test_malformed_upcalls() -> None:
    d = Dispatcher(AllowAll())
    assert d.on_malformed(codec.DecodeError("x", upcall_id=3)) == Verdict.deny(errno.EPROTO)
    assert d.on_malformed(codec.DecodeError("x")) is None
    assert (d.counters.malformed, d.counters.unanswered) == (2, 1)
    assert Dispatcher(AllowAll(), fail_open=True).on_malformed(
        codec.DecodeError("x", upcall_id=3)) == ALLOW


def spying_dispatcher() -> tuple[Dispatcher, list[object]]:
    """A Dispatcher over a policy that allows all and keeps each decoded call."""
    seen: list[object] = []

    class Spy(AllowAll):
        def decide(self, request: Request) -> Verdict:
            seen.append(request.call)
            return ALLOW

    return Dispatcher(Spy()), seen


def test_undecodable_rm_params_reach_the_policy_as_no_call() -> None:
    d, seen = spying_dispatcher()
    d.on_upcall(upcall(b"\0" * 40))
    d.on_upcall(upcall(b"\0" * 40, node=Node.UVM, nr=0x30000001 & 0xFF))
    assert seen == [None, None] and d.counters.call_errors == 1


def test_params_are_decoded_only_when_the_policy_reads_them() -> None:
    d = Dispatcher(AllowAll())
    assert d.on_upcall(upcall(b"\0" * 40)) is ALLOW
    assert d.counters.call_errors == 0


def test_replies_to_other_commands_decode() -> None:
    assert codec.decode_datagram(genl(Cmd.UNREGISTER), FAMILY)[0].cmd == Cmd.UNREGISTER


class Replying(AllowAll):
    def __init__(self, verdict: Verdict) -> None:
        self.verdict = verdict
        self.posts = 0

    def decide(self, request: Request) -> Verdict:
        return self.verdict

    def decide_post(self, request: Request) -> Verdict:
        self.posts += 1
        return self.verdict


CTRL = L.NVOS54.struct.pack(1, 2, 0x20801303, 0, 0x1000, 8, 0)


@pytest.mark.parametrize(("kind", "verdict", "ok"), [
    (UpcallKind.IOCTL, Verdict.reply(b"\0" * 32), True),
    (UpcallKind.IOCTL, Verdict.reply(data=b"\0" * 8), True),
    (UpcallKind.POST, Verdict.reply(b"\0" * 32, b"\0" * 8), True),
    (UpcallKind.POST, Verdict.reply(b"\0" * 31), False),
    (UpcallKind.POST, Verdict.reply(data=b"\0" * 9), False),
    (UpcallKind.POST, Verdict.deny(errno.EPERM), False),
    (UpcallKind.POST, Verdict.fail_status(0x51, 28), True),  # v4: the daemon undid the call
    (UpcallKind.IOCTL, Verdict(VerdictAction.ALLOW, flags=1), True),
    (UpcallKind.IOCTL, Verdict(VerdictAction.ALLOW, flags=2), False),
    (UpcallKind.POST, Verdict(VerdictAction.ALLOW, flags=1), False),
    (UpcallKind.IOCTL, Verdict(VerdictAction.DENY, 1, flags=1), False),
    (UpcallKind.IOCTL, Verdict(VerdictAction.ALLOW, data=b"\0" * 8), False),
    # v5: an ALLOW names the params the driver reads, at the upcall's length.
    (UpcallKind.IOCTL, Verdict(VerdictAction.ALLOW, flags=1, params=b"\0" * 32), True),
    (UpcallKind.IOCTL, Verdict(VerdictAction.ALLOW, params=b"\0" * 31), False),
    (UpcallKind.POST, Verdict(VerdictAction.ALLOW, params=b"\0" * 32), False),
    (UpcallKind.IOCTL, Verdict(VerdictAction.DENY, 1, params=b"\0" * 32), False),
    (UpcallKind.MMAP, Verdict.reply(b"\0" * 32), False),
    (UpcallKind.MMAP, Verdict.deny(errno.ENOMEM), True),
])
def test_verdicts_are_checked_against_the_upcall(kind, verdict, ok) -> None:
    policy = Replying(verdict)
    d = Dispatcher(policy)
    data = None if kind is UpcallKind.MMAP else b"\1" * 8
    u = upcall(CTRL, nr=0x2A, data=data, kind=kind)
    got = d.on_upcall(u)
    if ok:
        assert got == verdict
    elif kind is UpcallKind.POST:
        assert got == ALLOW  # the call has happened: keep the driver's results
    else:
        assert got == Verdict.deny(errno.EIO)
    assert policy.posts == (kind is UpcallKind.POST)


@pytest.mark.parametrize(("nr", "size", "flags", "ok"), [
    (0x2B, 32, 2, True),   # RM_ALLOC, NVOS21
    (0x2B, 48, 3, True),   # NVOS64, with a POST upcall too
    (0x2B, 40, 2, False),  # a size the module does not read
    (0x2A, 32, 2, False),  # not an RM_ALLOC
    (0x2B, 32, 4, False),  # unknown flag
])
def test_sched_off_fits_rm_allocs_only(nr: int, size: int, flags: int, ok: bool) -> None:
    verdict = Verdict(VerdictAction.ALLOW, flags=flags)
    got = Dispatcher(Replying(verdict)).on_upcall(upcall(b"\0" * size, nr=nr))
    assert got == (verdict if ok else Verdict.deny(errno.EIO))


def test_mmap_params_reach_the_policy_decoded() -> None:
    d, seen = spying_dispatcher()
    d.on_upcall(upcall(uapi.MMAP_PARAMS.struct.pack(0, 4096, 3, 1), kind=UpcallKind.MMAP,
                       node=Node.UVM))
    d.on_upcall(upcall(b"\0" * 8, kind=UpcallKind.MMAP, node=Node.UVM))
    assert seen == [uapi.MmapParams(0, 4096, 3, 1), None] and d.counters.call_errors == 1
