"""Codec: kernel-built messages decode to typed requests; malformed ones to DecodeError."""

from __future__ import annotations

import errno
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fakekernel import (
    FAMILY,
    abandoned_event_msg,
    ack_msg,
    attr,
    close_event_msg,
    genl,
    make_stats,
    make_stats4,
    nlmsg,
    parse_filter,
    parse_request,
    post_event_msg,
    stats_msg,
    upcall_msg,
    upcall_struct,
)
from vgpud.kernel import codec, uapi
from vgpud.kernel.codec import (
    AbandonedEvent,
    CloseEvent,
    DecodeError,
    NlAck,
    PostEvent,
    Reply,
    Upcall,
)
from vgpud.kernel.uapi import Attr, Cmd, Filter, Node, UpcallKind, Verdict, VerdictAction
from vgpud.policy.rules import (
    rm_alloc_classes,
    rm_control_cmds,
    rm_control_fb_get_info,
    rm_free,
)

NVOS21 = struct.pack("=IIIIQII", 1, 2, 3, 0x40, 0x7F0000, 128, 0)
UPCALL_ATTR = attr(Attr.UPCALL, upcall_struct(id=5))


def decode_one(buf: bytes):
    (msg,) = codec.decode_datagram(buf, FAMILY)
    return msg


def test_ioctl_upcall() -> None:
    msg = decode_one(upcall_msg(NVOS21, data=b"\1" * 128, id=42, ctx_id=9, nr=0x2B,
                                cmd=0xC020462B, node=Node.CTL, flags=uapi.UPCALL_F_XFER))
    assert type(msg) is Upcall
    assert (msg.id, msg.ctx_id, msg.kind, msg.node, msg.nr, msg.cmd) == (
        42, 9, UpcallKind.IOCTL, Node.CTL, 0x2B, 0xC020462B)
    assert msg.flags == uapi.UPCALL_F_XFER
    assert msg.params == NVOS21 and msg.data == b"\1" * 128
    assert msg.opener == codec.Opener(100, 100, 1000, 1000, 0x100, None, None)
    assert (msg.caller_pid, msg.caller_tgid) == (101, 100)


def test_open_upcall_carries_cgroup() -> None:
    msg = decode_one(upcall_msg(cgroup="/kubepods/pod1", kind=UpcallKind.OPEN, node=Node.GPU,
                                minor=3, uid=0))
    assert msg.kind is UpcallKind.OPEN and msg.node is Node.GPU and msg.minor == 3
    assert msg.opener.cgroup == "/kubepods/pod1" and msg.opener.uid == 0
    assert msg.params == b"" and msg.data is None


def test_open_upcall_carries_the_openers_start_time() -> None:
    msg = decode_one(upcall_msg(cgroup="/", start_ns=123_456_789, kind=UpcallKind.OPEN))
    assert msg.opener.start_ns == 123_456_789
    assert decode_one(upcall_msg(kind=UpcallKind.OPEN)).opener.start_ns is None
    short = decode_one(genl(Cmd.UPCALL, attr(Attr.UPCALL, upcall_struct(
        id=3, kind=UpcallKind.OPEN)), attr(Attr.OPENER, b"\0" * 8)))
    assert isinstance(short, DecodeError) and "VGPU_A_OPENER is 8 bytes" in str(short)
    assert short.upcall_id == 3
    # only an OPEN upcall carries it
    err = decode_one(upcall_msg(NVOS21, start_ns=1))
    assert isinstance(err, DecodeError) and "unexpected attributes" in str(err)


def test_events() -> None:
    post = decode_one(post_event_msg(9, 42, 0x2B, -22, NVOS21, b"x"))
    assert post == PostEvent(9, 42, 0x2B, -22, NVOS21, b"x")
    assert decode_one(close_event_msg(9)) == CloseEvent(9)
    assert decode_one(abandoned_event_msg(9, 42, UpcallKind.OPEN, errno.EINTR)) == (
        AbandonedEvent(9, 42, UpcallKind.OPEN, errno.EINTR))


@pytest.mark.parametrize(("kind", "ret"), [(9, -errno.ETIMEDOUT), (UpcallKind.IOCTL, 0),
                                           (UpcallKind.IOCTL, 5), (UpcallKind.IOCTL, -4096)])
def test_abandoned_event_out_of_range_is_malformed(kind: int, ret: int) -> None:
    head = uapi.EVENT.struct.pack(9, 42, uapi.EventKind.ABANDONED, kind, ret, 0)
    assert isinstance(decode_one(genl(Cmd.EVENT, attr(Attr.EVENT, head))), DecodeError)


def test_revoked_event() -> None:
    head = uapi.EVENT.struct.pack(9, 0, uapi.EventKind.REVOKED, uapi.RevokeReason.SHADOW, 0, 0)
    assert decode_one(genl(Cmd.EVENT, attr(Attr.EVENT, head))) == codec.RevokedEvent(
        9, uapi.RevokeReason.SHADOW)


@pytest.mark.parametrize(("upcall_id", "nr", "ret"), [(1, 2, 0), (0, 0, 0), (0, 9, 0),
                                                      (0, 2, -5)])
def test_revoked_event_out_of_range_is_malformed(upcall_id: int, nr: int, ret: int) -> None:
    head = uapi.EVENT.struct.pack(9, upcall_id, uapi.EventKind.REVOKED, nr, ret, 0)
    assert isinstance(decode_one(genl(Cmd.EVENT, attr(Attr.EVENT, head))), DecodeError)


def test_params_may_be_absent() -> None:
    assert decode_one(genl(Cmd.UPCALL, UPCALL_ATTR)).params == b""
    post = genl(Cmd.EVENT, attr(Attr.EVENT, uapi.EVENT.struct.pack(1, 2, 1, 0, 0, 0)))
    assert decode_one(post) == PostEvent(1, 2, 0, 0, b"", None)


def test_attributes_in_any_order() -> None:
    first = decode_one(genl(Cmd.UPCALL, UPCALL_ATTR, attr(Attr.PARAMS, b"p"),
                            attr(Attr.DATA, b"d")))
    last = decode_one(genl(Cmd.UPCALL, attr(Attr.DATA, b"d"), attr(Attr.PARAMS, b"p"),
                           UPCALL_ATTR))
    assert first == last and (first.id, first.params, first.data) == (5, b"p", b"d")


def test_several_messages_in_one_datagram() -> None:
    buf = upcall_msg(NVOS21, id=1) + close_event_msg(2) + upcall_msg(NVOS21, id=3)
    assert [type(m) for m in codec.decode_datagram(buf, FAMILY)] == [Upcall, CloseEvent, Upcall]


def test_ack_and_error() -> None:
    request = codec.encode_register(FAMILY, 5)
    assert decode_one(ack_msg(request)) == NlAck(5, 0, FAMILY, b"", None)
    err = decode_one(ack_msg(request, errno.EBUSY))
    assert (err.seq, err.errno, err.request_type) == (5, errno.EBUSY, FAMILY)
    assert err.request == request[16:] and err.upcall_id() is None


def test_refused_verdict_names_its_upcall() -> None:
    verdict = codec.VerdictEncoder(FAMILY).encode(77, uapi.ALLOW)
    err = decode_one(ack_msg(verdict, errno.ENOENT))
    assert err.errno == errno.ENOENT and err.upcall_id() == 77


def test_extended_ack_message() -> None:
    request = codec.encode_register(FAMILY, 5)
    tlv = attr(1, b"bad version\0")
    buf = nlmsg(2, struct.pack("=i", -errno.EINVAL) + request + tlv, flags=0x200, seq=5)
    assert decode_one(buf).message == "bad version"


def test_stats_reply() -> None:
    stats = make_stats(upcalls=5, daemon_portid=1234, mmaps=2**63)
    reply = decode_one(stats_msg(8, stats))
    assert type(reply) is Reply and reply.seq == 8
    assert codec.decode_stats(reply) == stats


def test_verdict_encoding_is_what_the_kernel_parses() -> None:
    enc = codec.VerdictEncoder(FAMILY)
    buf = enc.encode(2**64 - 1, Verdict.fail_status(0x51, 28))
    assert len(buf) == 56
    seq, flags, cmd, attrs = parse_request(buf)
    assert (seq, flags, cmd) == (0, codec.NLM_F_REQUEST, Cmd.VERDICT)
    assert uapi.VERDICT.struct.unpack(attrs[Attr.VERDICT]) == (
        2**64 - 1, VerdictAction.FAIL_STATUS, 0, 0x51, 28, 0, 0)
    _, _, _, attrs = parse_request(enc.encode(1, Verdict.deny(errno.EPERM)))
    assert uapi.VERDICT.struct.unpack(attrs[Attr.VERDICT]) == (1, 2, errno.EPERM, 0, 0, 0, 0)
    _, _, _, attrs = parse_request(enc.encode(3, uapi.ALLOW_POST))
    assert uapi.VERDICT.struct.unpack(attrs[Attr.VERDICT]) == (
        3, VerdictAction.ALLOW, 0, 0, 0, uapi.VERDICT_F_POST, 0)


@pytest.mark.parametrize(("params", "data"), [(b"p" * 32, None), (None, b"d" * 1027),
                                              (b"p" * 5, b"d" * 8)])
def test_reply_verdict_carries_its_blocks(params, data) -> None:
    buf = codec.VerdictEncoder(FAMILY).encode(9, Verdict.reply(params, data))
    _seq, _flags, cmd, attrs = parse_request(buf)  # checks nlmsg_len against the buffer
    assert cmd == Cmd.VERDICT
    assert uapi.VERDICT.struct.unpack(attrs[Attr.VERDICT]) == (
        9, VerdictAction.REPLY, 0, 0, 0, 0, 0)
    assert (attrs.get(Attr.PARAMS), attrs.get(Attr.DATA)) == (params, data)
    assert len(buf) % 4 == 0


def test_reply_needs_a_block() -> None:
    with pytest.raises(ValueError):
        Verdict.reply()
    with pytest.raises(ValueError):
        Verdict.reply(b"x" * (uapi.PARAMS_MAX + 1))


@pytest.mark.parametrize("kind", [UpcallKind.POST, UpcallKind.MMAP])
def test_post_and_mmap_upcalls(kind) -> None:
    data = b"after" if kind is UpcallKind.POST else None
    msg = decode_one(upcall_msg(b"\1" * 24, data, kind=kind, id=4, ret=-22))
    assert (msg.kind, msg.id, msg.ret, msg.params, msg.data) == (kind, 4, -22, b"\1" * 24, data)


def test_mmap_upcall_with_data_is_malformed() -> None:
    err = decode_one(upcall_msg(b"\0" * 24, b"x", kind=UpcallKind.MMAP, id=5))
    assert isinstance(err, DecodeError) and err.upcall_id == 5


def test_mmap_params() -> None:
    assert uapi.MmapParams.unpack(uapi.MMAP_PARAMS.struct.pack(1, 2 << 20, 3, 1)) == (
        1, 2 << 20, 3, 1)
    with pytest.raises(DecodeError):
        uapi.MmapParams.unpack(b"\0" * 16)


def test_requests() -> None:
    seq, flags, cmd, attrs = parse_request(codec.encode_register(FAMILY, 3))
    assert (seq, flags, cmd) == (3, codec.NLM_F_REQUEST | codec.NLM_F_ACK, Cmd.REGISTER)
    assert attrs == {Attr.VERSION: struct.pack("=I", uapi.PROTO_VERSION)}
    filt = Filter(uapi.FILTER_OPEN, (*rm_alloc_classes([0x40]), rm_control_cmds([0xA06C0101])))
    _, _, cmd, attrs = parse_request(codec.encode_set_filter(FAMILY, 4, filt))
    assert cmd == Cmd.SET_FILTER and len(attrs[Attr.RULES]) == 3 * uapi.RULE.size
    assert parse_filter(attrs) == filt
    _, _, _, attrs = parse_request(codec.encode_set_filter(FAMILY, 4, Filter()))
    assert attrs[Attr.RULES] == b""
    assert parse_request(codec.encode_get_stats(FAMILY, 6))[2:] == (Cmd.GET_STATS, {})
    assert parse_request(codec.encode_unregister(FAMILY, 7))[2:] == (Cmd.UNREGISTER, {})


# -- malformed input ------------------------------------------------------


@pytest.mark.parametrize(
    ("buf", "upcall_id"),
    [
        pytest.param(genl(Cmd.UPCALL), None, id="no-upcall-attr"),
        pytest.param(genl(Cmd.UPCALL, attr(Attr.UPCALL, upcall_struct(id=5)[:40])), 5,
                     id="short-upcall-attr"),
        pytest.param(genl(Cmd.UPCALL, UPCALL_ATTR, attr(Attr.CGROUP, b"/\0")), 5,
                     id="cgroup-on-ioctl"),
        pytest.param(genl(Cmd.UPCALL, UPCALL_ATTR, attr(Attr.PARAMS, b""), attr(11, b"")), 5,
                     id="unknown-attr"),
        pytest.param(genl(Cmd.UPCALL, UPCALL_ATTR, attr(Attr.PARAMS, b""),
                          attr(Attr.PARAMS, b"")), 5, id="duplicate-attr"),
        pytest.param(genl(Cmd.UPCALL, UPCALL_ATTR, attr(Attr.STATS, b"")), 5,
                     id="attr-of-another-command"),
        pytest.param(genl(Cmd.UPCALL, UPCALL_ATTR, attr(Attr.PARAMS, b""), UPCALL_ATTR), 5,
                     id="duplicate-upcall-attr"),
        pytest.param(genl(Cmd.UPCALL, attr(Attr.UPCALL, upcall_struct(id=6, kind=9))), 6,
                     id="unknown-kind"),
        pytest.param(genl(Cmd.UPCALL, attr(Attr.UPCALL, upcall_struct(id=6, node=3))), 6,
                     id="unknown-node"),
        pytest.param(genl(Cmd.UPCALL, attr(Attr.UPCALL, upcall_struct(id=6, reserved=1)),
                          attr(Attr.PARAMS, b"")), 6, id="reserved-nonzero"),
        pytest.param(genl(Cmd.UPCALL, UPCALL_ATTR + struct.pack("=HH", 40, Attr.PARAMS)), 5,
                     id="attr-overruns-message"),
        pytest.param(genl(Cmd.UPCALL, UPCALL_ATTR + b"\x02\x00"), 5, id="truncated-attr-header"),
        pytest.param(genl(Cmd.UPCALL, struct.pack("=HH", 2, Attr.UPCALL)), None,
                     id="attr-len-below-header"),
    ],
)
def test_malformed_upcall(buf: bytes, upcall_id: int | None) -> None:
    err = decode_one(buf)
    assert isinstance(err, DecodeError) and err.upcall_id == upcall_id


@pytest.mark.parametrize(
    "buf",
    [
        pytest.param(genl(Cmd.EVENT), id="event-without-header"),
        pytest.param(genl(Cmd.EVENT, attr(Attr.EVENT, uapi.EVENT.struct.pack(1, 0, 9, 0, 0, 0))),
                     id="event-unknown-kind"),
        pytest.param(genl(Cmd.EVENT, attr(Attr.EVENT, uapi.EVENT.struct.pack(1, 2, 1, 0, 0, 0)),
                          attr(Attr.CGROUP, b"/\0")), id="post-with-cgroup"),
        pytest.param(genl(Cmd.EVENT, attr(Attr.EVENT, uapi.EVENT.struct.pack(1, 0, 2, 0, 0, 5))),
                     id="event-reserved"),
        pytest.param(genl(99), id="unknown-command"),
        pytest.param(nlmsg(FAMILY, b"\x04"), id="truncated-genl-header"),
        pytest.param(nlmsg(0x30, b"\0" * 4), id="foreign-type"),
        pytest.param(nlmsg(2, b"\0" * 8), id="truncated-error"),
        pytest.param(nlmsg(2, struct.pack("=i", -1) + struct.pack("=IHHII", 99, 0, 0, 0, 0)),
                     id="error-echo-overruns"),
    ],
)
def test_malformed_other(buf: bytes) -> None:
    assert isinstance(decode_one(buf), DecodeError)


def test_framing_errors_end_the_datagram() -> None:
    good = close_event_msg(1)
    out = codec.decode_datagram(good + b"\x05\0\0\0", FAMILY)
    assert out[0] == CloseEvent(1) and isinstance(out[1], DecodeError)
    bad_len = struct.pack("=IHHII", 4, FAMILY, 0, 0, 0)
    out = codec.decode_datagram(good + bad_len + good, FAMILY)
    assert len(out) == 2 and isinstance(out[1], DecodeError)


def test_noop_and_done_are_skipped() -> None:
    assert codec.decode_datagram(nlmsg(1, b"") + nlmsg(3, b"\0" * 4), FAMILY) == []


def test_decode_stats_rejects_other_replies() -> None:
    with pytest.raises(DecodeError):
        codec.decode_stats(Reply(1, Cmd.REGISTER, {}))


def test_verdict_constructors_check_ranges() -> None:
    with pytest.raises(ValueError):
        Verdict.deny(0)
    with pytest.raises(ValueError):
        Verdict.deny(4096)
    with pytest.raises(ValueError):
        Verdict.fail_status(0x51, uapi.PARAMS_MAX)


# -- properties -----------------------------------------------------------

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@given(id_=u64, ctx=u64, cg=u64, node=st.sampled_from(list(Node)), nr=u32, cmd=u32, pid=u32,
       params=st.binary(max_size=512), data=st.none() | st.binary(max_size=512))
def test_upcall_round_trip(id_, ctx, cg, node, nr, cmd, pid, params, data) -> None:
    msg = decode_one(upcall_msg(params, data, id=id_, ctx_id=ctx, cgroup_id=cg, node=node,
                                nr=nr, cmd=cmd, pid=pid))
    assert (msg.id, msg.ctx_id, msg.opener.cgroup_id, msg.node, msg.nr, msg.cmd) == (
        id_, ctx, cg, node, nr, cmd)
    assert (msg.opener.pid, msg.params, msg.data) == (pid, params, data)


@given(path=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
                   max_size=200))
def test_cgroup_round_trip(path: str) -> None:
    msg = decode_one(upcall_msg(cgroup=path, kind=UpcallKind.OPEN))
    assert msg.opener.cgroup == path


@given(id_=u64, action=st.sampled_from(list(VerdictAction)), error=u32, status=u32, off=u32)
def test_verdict_round_trip(id_, action, error, status, off) -> None:
    _, _, _, attrs = parse_request(
        codec.VerdictEncoder(FAMILY).encode(id_, Verdict(action, error, status, off)))
    assert uapi.VERDICT.struct.unpack(attrs[Attr.VERDICT]) == (
        id_, action, error, status, off, 0, 0)


@given(st.binary(max_size=400))
def test_random_bytes_decode_to_values_only(buf: bytes) -> None:
    for msg in codec.decode_datagram(buf, FAMILY):
        assert isinstance(msg, Upcall | PostEvent | CloseEvent | Reply | NlAck | DecodeError)


@given(st.binary(max_size=300))
def test_random_attributes_after_a_valid_header(body: bytes) -> None:
    buf = nlmsg(FAMILY, struct.pack("=BBH", Cmd.UPCALL, 1, 0) + body)
    for msg in codec.decode_datagram(buf, FAMILY):
        assert isinstance(msg, Upcall | DecodeError)


@given(st.lists(st.tuples(st.sampled_from([0x2B, 0x2A]), st.lists(u32, min_size=1,
                                                                   max_size=32)), max_size=10),
       st.sampled_from([0, uapi.FILTER_OPEN]))
def test_filter_round_trip(specs, flags) -> None:
    rules: list[uapi.Rule] = []
    for nr, keys in specs:
        rules.extend(rm_alloc_classes(keys) if nr == 0x2B else [rm_control_cmds(keys)])
    filt = Filter(flags, tuple(rules[: uapi.RULES_MAX]))
    assert parse_filter(parse_request(codec.encode_set_filter(FAMILY, 1, filt))[3]) == filt


def _general(buf: bytes) -> Upcall | DecodeError:
    """The attribute-walking decoder, which the one-unpack path must agree with."""
    try:
        return codec._decode_upcall(buf, codec._HDRS, len(buf))
    except DecodeError as exc:
        return exc


@given(kind=st.sampled_from(list(UpcallKind)), node=st.integers(0, 4), flags=u32, ret=u32,
       reserved=st.sampled_from([0, 0, 1]), params=st.binary(max_size=64),
       data=st.none() | st.binary(max_size=64), extra=st.sampled_from([b"", b"x", b"xyz"]),
       data_first=st.booleans())
def test_one_unpack_path_agrees_with_the_general_decoder(
        kind, node, flags, ret, reserved, params, data, extra, data_first) -> None:
    head = attr(Attr.UPCALL, upcall_struct(kind=kind, node=node, flags=flags, ret=ret - 2**31,
                                           reserved=reserved))
    blocks = [attr(Attr.PARAMS, params)] + ([] if data is None else [attr(Attr.DATA, data)])
    if data_first:
        blocks.reverse()
    buf = genl(Cmd.UPCALL, head, *blocks) + extra
    buf = struct.pack("=I", len(buf)) + buf[4:]  # trailing bytes inside the message
    got, want = codec.decode_datagram(buf, FAMILY), _general(buf)
    assert len(got) == 1
    usual = (kind in (UpcallKind.IOCTL, UpcallKind.POST) and node <= 2 and not reserved
             and not extra and (data is None or not data_first))
    assert (codec._decode_call_upcall(buf, len(buf)) is not None) == usual
    if isinstance(want, DecodeError):
        assert isinstance(got[0], DecodeError)
        assert (str(got[0]), got[0].upcall_id) == (str(want), want.upcall_id)
    else:
        assert got[0] == want
        assert type(got[0].kind) is UpcallKind and type(got[0].node) is Node


@given(id_=u64)
def test_allow_verdict_bytes_match_the_general_encoder(id_: int) -> None:
    enc = codec.VerdictEncoder(FAMILY)
    assert enc.encode(id_, uapi.ALLOW) == enc._encode(id_, uapi.ALLOW)


# -- nested lists (VGPU_A_NESTED, VGPU_A_DATA2) ---------------------------


@pytest.mark.parametrize("kind", [UpcallKind.IOCTL, UpcallKind.POST])
def test_upcall_carries_the_nested_list(kind) -> None:
    params = b"\1" * 32
    msg = decode_one(upcall_msg(params, b"\2" * 16, data2=b"\3" * 40, kind=kind, id=6,
                                flags=uapi.UPCALL_F_DATA2_BIG))
    assert type(msg) is Upcall
    assert (msg.params, msg.data, msg.data2) == (params, b"\2" * 16, b"\3" * 40)
    assert msg.flags == uapi.UPCALL_F_DATA2_BIG
    assert decode_one(upcall_msg(params, b"\2" * 16, kind=kind, id=6)).data2 is None


def test_open_or_mmap_upcall_with_data2_is_malformed() -> None:
    err = decode_one(upcall_msg(b"\0" * 24, data2=b"x", kind=UpcallKind.MMAP, id=7))
    assert isinstance(err, DecodeError) and err.upcall_id == 7


def test_set_filter_carries_nested_lists_by_rule_index() -> None:
    nested = rm_control_fb_get_info()
    filt = Filter(uapi.FILTER_OPEN, (*rm_alloc_classes([0x40]),)) + nested
    assert filt.nested == (uapi.RuleNested(2, 8, 0, 8, 128),)  # shifted past the two rules
    _, _, cmd, attrs = parse_request(codec.encode_set_filter(FAMILY, 4, filt))
    assert cmd == Cmd.SET_FILTER
    assert attrs[Attr.NESTED] == uapi.RULE_NESTED.struct.pack(2, 8, 0, 8, 128, 0)
    assert parse_filter(attrs) == filt
    # no nested list: no attribute
    _, _, _, attrs = parse_request(codec.encode_set_filter(FAMILY, 4, Filter()))
    assert Attr.NESTED not in attrs


def test_filter_refuses_nested_lists_that_name_no_buffer() -> None:
    rule = rm_control_cmds([1])
    with pytest.raises(ValueError):
        Filter(0, (rule,), (uapi.RuleNested(1, 8, 0, 8, 1),))  # no rule 1
    with pytest.raises(ValueError):
        Filter(0, (rule,), (uapi.RuleNested(0, 8, 0, 8, 1),) * 2)  # two on one rule
    with pytest.raises(ValueError):
        Filter(0, (rm_free(),), (uapi.RuleNested(0, 8, 0, 8, 1),))  # no buffer


def test_reply_verdict_carries_data2() -> None:
    buf = codec.VerdictEncoder(FAMILY).encode(9, Verdict.reply(data2=b"l" * 24))
    _seq, _flags, cmd, attrs = parse_request(buf)
    assert cmd == Cmd.VERDICT
    assert (attrs.get(Attr.PARAMS), attrs.get(Attr.DATA), attrs[Attr.DATA2]) == (
        None, None, b"l" * 24)
    assert len(buf) % 4 == 0
    with pytest.raises(ValueError):
        Verdict.reply(data2=b"x" * (uapi.PARAMS_MAX + 1))


def test_stats4_reply() -> None:
    stats4 = make_stats4(throttled=3, abandoned=2**63)
    reply = decode_one(stats_msg(9, make_stats(), stats4))
    assert type(reply) is Reply
    assert codec.decode_stats4(reply) == stats4


def test_stats4_absent_from_an_older_module() -> None:
    reply = decode_one(stats_msg(9, make_stats()))
    assert type(reply) is Reply and codec.decode_stats4(reply) is None
    with pytest.raises(DecodeError):
        codec.decode_stats4(Reply(1, Cmd.REGISTER, {}))


def _nlctrl_reply(seq: int, attrs: bytes, kind: int = codec.GENL_ID_CTRL) -> bytes:
    body = codec.GENL_HDR.pack(1, 2, 0) + attrs  # CTRL_CMD_NEWFAMILY
    return codec.NLMSG_HDR.pack(codec.NLMSG_HDR.size + len(body), kind, 0, seq, 0) + body


def _nla(kind: int, raw: bytes) -> bytes:
    return codec.NLA_HDR.pack(4 + len(raw), kind) + raw.ljust((len(raw) + 3) & ~3, b"\0")


def test_get_family_is_nlctrls_request_by_name() -> None:
    msg = codec.encode_get_family("vgpu", 7)
    length, kind, flags, seq, pid = codec.NLMSG_HDR.unpack_from(msg)
    assert (length, kind, flags, seq, pid) == (len(msg), 0x10, codec.NLM_F_REQUEST, 7, 0)
    assert codec.GENL_HDR.unpack_from(msg, 16) == (codec.CTRL_CMD_GETFAMILY, 1, 0)
    assert msg[20:] == _nla(codec.CTRL_ATTR_FAMILY_NAME, b"vgpu\0")
    assert len(msg) % 4 == 0


def test_the_family_id_is_read_among_the_other_attributes() -> None:
    attrs = (_nla(codec.CTRL_ATTR_FAMILY_NAME, b"vgpu\0") + _nla(1, struct.pack("=H", 32))
             + _nla(3, struct.pack("=I", 1)) + _nla(6 | 0x8000, b""))
    assert codec.decode_family_id(_nlctrl_reply(5, attrs), 5) == 32


def test_no_such_family_is_the_kernels_errno() -> None:
    request = codec.encode_get_family("nope", 9)
    payload = struct.pack("=i", -errno.ENOENT) + request
    msg = codec.NLMSG_HDR.pack(16 + len(payload), codec.NLMSG_ERROR, 0, 9, 0) + payload
    ack = codec.decode_family_id(msg, 9)
    assert isinstance(ack, NlAck) and ack.errno == errno.ENOENT


@pytest.mark.parametrize("msg, why", [
    (b"\0" * 8, "bytes"),
    (_nlctrl_reply(4, _nla(1, struct.pack("=H", 32))), "sequence 4"),
    (_nlctrl_reply(5, _nla(2, b"vgpu\0")), "without a family id"),
    (_nlctrl_reply(5, _nla(1, b"\x20")), "without a family id"),
    (_nlctrl_reply(5, _nla(1, struct.pack("=H", 32)), kind=0x11), "type 17"),
])
def test_a_bad_nlctrl_answer_is_a_decode_error(msg: bytes, why: str) -> None:
    with pytest.raises(DecodeError, match=why):
        codec.decode_family_id(msg, 5)


@given(st.binary(max_size=96))
def test_any_nlctrl_answer_decodes_or_is_refused(raw: bytes) -> None:
    try:
        answer = codec.decode_family_id(raw, 0)
    except DecodeError:
        return
    assert isinstance(answer, NlAck) or 0 <= answer <= 0xFFFF
