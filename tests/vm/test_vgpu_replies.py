"""Verdicts that carry results (VM tier): REPLY with params and data written back
to the caller, malformed REPLYs refused, POST upcalls (ALLOW + F_POST) that
rewrite the driver's results, and a POST upcall timing out.

    scripts/test-vm -k test_vgpu_replies
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import struct
import time
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.calls import NV_ERR_NO_MEMORY, NVOS21, RM_ALLOC, Call, alloc, rm_calls, status_of
from tests.support.guest import Env, set_param
from tests.support.responder import start
from tests.support.vgpu_genl import (
    A_DATA,
    A_DATA2,
    A_PARAMS,
    ALLOW,
    CTL,
    DENY,
    F_XFER,
    FAIL_STATUS,
    FILTER_OPEN,
    REPLY,
    U_FLAGS,
    U_ID,
    U_KIND,
    U_NR,
    U_RET,
    UPCALL_IOCTL,
    UPCALL_OPEN,
    UPCALL_POST,
    VERDICT_F_POST,
    NlError,
    daemon,
    rule,
    stats,
)
from vgpud.kernel.uapi import (
    ERRNO_MAX,
    VERDICT_F_SCHED_OFF,
    UpcallKind,
    Verdict,
    VerdictAction,
)
from vgpud.kernel.verdicts import Sent, check

pytestmark = pytest.mark.vm

# RM_ALLOC of class 0x40, with the alloc-params buffer (ptr@16, len@24) as data.
ALLOC40_DATA = rule(CTL, RM_ALLOC, 32, 12, (0x40,), ptr_off=16, len_off=24)
# The same with NV_MEMORY_ALLOCATION_PARAMS as data, as vgpud's rule: the 128
# bytes the driver reads for the class (VGPU_RULE_F_LEN_FIXED, 4), whatever
# paramsSize says (nvclient sends 0, as libcuda).
ALLOC40_CLASS = rule(CTL, RM_ALLOC, 32, 12, (0x40,), ptr_off=16, len_off=128, flags=4)


def test_reply_verdict(vg: Env) -> None:
    fd = vg.open()
    buf = ctypes.create_string_buffer(b"\x11" * 56)
    try:
        with daemon([ALLOC40_DATA]) as g:
            calls, before = rm_calls(), stats()
            c = Call(alloc, fd, 0x40, ctypes.addressof(buf), 56)
            hdr, attrs = g.next_upcall()
            assert hdr[U_KIND] == UPCALL_IOCTL and hdr[U_RET] == 0
            assert len(attrs[A_PARAMS]) == 32 and attrs[A_DATA] == b"\x11" * 56
            new = NVOS21.pack(1, 2, 0xCAFE, 0x40, 0x1000, 8, 0x1234)
            g.verdict(hdr[U_ID], REPLY, params=new, data=b"\x5a" * 56)
            ret, params = c.result()
            # Written where the caller's pointer was, not where the reply's points.
            assert (ret, params, buf.raw[:56]) == (0, new, b"\x5a" * 56)
            # DATA alone: the params stay as the caller wrote them.
            c = Call(alloc, fd, 0x40, ctypes.addressof(buf), 56)
            hdr, attrs = g.next_upcall()
            g.verdict(hdr[U_ID], REPLY, data=bytes(range(56)))
            ret, params = c.result()
            assert ret == 0 and params == attrs[A_PARAMS] and buf.raw[:56] == bytes(range(56))
            # PARAMS alone, wrapped in XFER: the inner params (alloc checks the wrapper).
            c = Call(alloc, fd, 0x40, xfer=True)
            hdr, attrs = g.next_upcall()
            assert hdr[U_FLAGS] == F_XFER and A_DATA not in attrs
            new = NVOS21.pack(3, 4, 0xBEEF, 0x40, 0, 0, NV_ERR_NO_MEMORY)
            g.verdict(hdr[U_ID], REPLY, params=new)
            assert c.result() == (0, new)
            after = stats()
            assert after["verdicts"] == before["verdicts"] + 3
            assert after["events"] == before["events"]  # no POST event for a REPLY
            assert rm_calls() == calls, "a REPLY reached the driver"
    finally:
        os.close(fd)


def test_reply_malformed(vg: Env) -> None:
    fd = vg.open()
    buf = ctypes.create_string_buffer(56)
    try:
        with daemon([ALLOC40_DATA]) as g:
            before = stats()
            c = Call(alloc, fd, 0x40, ctypes.addressof(buf), 56)
            hdr, _ = g.next_upcall()
            uid = hdr[U_ID]
            bad = [dict(params=bytes(31)), dict(params=bytes(33)), dict(params=b""),
                   dict(data=bytes(55)), dict(data=bytes(57)),
                   dict(params=bytes(32), data=bytes(8)), dict(params=bytes(30), data=bytes(56)),
                   dict(), dict(params=bytes(32), error=1), dict(params=bytes(32), reserved=1),
                   dict(params=bytes(32), flags=VERDICT_F_POST)]
            for b in bad:
                with pytest.raises(NlError) as e:
                    g.verdict(uid, REPLY, **b)
                assert e.value.errno == errno.EINVAL, b
            # v5: ALLOW may carry PARAMS, as long as sent; no DATA.
            for action, kw in ((ALLOW, dict(params=bytes(31))), (ALLOW, dict(data=bytes(56))),
                               (DENY, dict(data=bytes(56))), (FAIL_STATUS, dict(params=bytes(32)))):
                with pytest.raises(NlError) as e:
                    g.verdict(uid, action, error=13 if action == DENY else 0, **kw)
                assert e.value.errno == errno.EINVAL, (action, kw)
            time.sleep(0.1)
            assert c.alive(), "a refused verdict completed the waiter"
            assert buf.raw == bytes(56)
            n = len(bad) + 4
            assert stats()["bad_verdicts"] == before["bad_verdicts"] + n
            g.verdict(uid, DENY, error=errno.EACCES)
            with pytest.raises(PermissionError):
                c.result()
            # No data sent (no pointer): DATA in the REPLY is refused.
            c = Call(alloc, fd, 0x40)
            hdr, attrs = g.next_upcall()
            assert A_DATA not in attrs
            for b in (dict(data=bytes(8)), dict(params=bytes(32), data=b"")):
                with pytest.raises(NlError) as e:
                    g.verdict(hdr[U_ID], REPLY, **b)
                assert e.value.errno == errno.EINVAL
            g.verdict(hdr[U_ID], REPLY, params=bytes(32))
            assert c.result() == (0, bytes(32))
            # An OPEN upcall takes ALLOW or DENY only.
            g.set_filter([], FILTER_OPEN)
            c = Call(vg.open)
            hdr, attrs = g.next_upcall()
            assert hdr[U_KIND] == UPCALL_OPEN
            for action, kw in ((REPLY, dict(params=bytes(4))), (ALLOW, dict(flags=VERDICT_F_POST)),
                               (FAIL_STATUS, {})):
                with pytest.raises(NlError) as e:
                    g.verdict(hdr[U_ID], action, **kw)
                assert e.value.errno == errno.EINVAL, action
            g.verdict(hdr[U_ID], ALLOW)
            os.close(c.result())
    finally:
        os.close(fd)


def test_allow_names_the_params_the_driver_reads(vg: Env) -> None:
    """v5: an ALLOW carrying PARAMS has the driver run on those: here an
    allocation the driver would name (hObjectNew 0) is made under the handle
    the verdict chose, which the caller's results then show; the rule's
    pointer field stays the module's (a verdict's pointer is ignored)."""
    if not vg.nvsim:
        pytest.skip("needs nvsim")
    ctl = vg.open()
    try:
        t = nv.build_tree(ctl)
        with daemon([ALLOC40_CLASS]) as g:
            c = Call(nv.alloc_memory, ctl, t.client, t.subdevice, 1 << 20, hclass=0x40)
            hdr, attrs = g.next_upcall()
            h_root, h_parent, h_new, h_class, _, size, _ = NVOS21.unpack(attrs[A_PARAMS])
            assert (h_root, h_parent, h_new, h_class) == (t.client, t.subdevice, 0, 0x40)
            named = NVOS21.pack(h_root, h_parent, 0xCAF80001, h_class, 0xDEAD000, size, 0)
            g.verdict(hdr[U_ID], ALLOW, params=named, flags=VERDICT_F_POST)
            post, pattrs = g.next_upcall()
            assert post[U_KIND] == UPCALL_POST and post[U_RET] == 0
            assert NVOS21.unpack(pattrs[A_PARAMS])[2] == 0xCAF80001
            g.verdict(post[U_ID], ALLOW)
            r = c.result()
            assert (r.errno, r.status, r.handle) == (0, 0, 0xCAF80001)
        assert nv.rm_free(ctl, t.client, t.subdevice, 0xCAF80001) == (0, 0)
    finally:
        os.close(ctl)


def test_post_upcall_virtualizes_fb_info(vg: Env) -> None:
    """ALLOW + F_POST, then REPLY to the POST upcall: FB_GET_INFO_V2 rewritten."""
    if not vg.nvsim:
        pytest.skip("needs nvsim")
    ctl = vg.open()
    try:
        t = nv.build_tree(ctl)
        idx = [nv.FB_TOTAL_RAM_SIZE, nv.FB_HEAP_FREE]
        _, _, real = nv.fb_get_info_v2(ctl, t.client, t.subdevice, idx)
        # RM_CONTROL FB_GET_INFO_V2, its params (ptr@16, len@24) as data.
        fb_rule = rule(CTL, 0x2A, 32, 8, (nv.NV2080_CTRL_CMD_FB_GET_INFO_V2,),
                       ptr_off=16, len_off=24)
        with daemon([fb_rule]) as g:
            calls, before = rm_calls(), stats()
            c = Call(nv.fb_get_info_v2, ctl, t.client, t.subdevice, idx)
            hdr, attrs = g.next_upcall()
            assert hdr[U_KIND] == UPCALL_IOCTL and len(attrs[A_DATA]) == nv.FB_INFO_V2_SIZE
            g.verdict(hdr[U_ID], ALLOW, flags=VERDICT_F_POST)
            post, pattrs = g.next_upcall()
            assert post[U_KIND] == UPCALL_POST and post[U_ID] == hdr[U_ID]
            assert post[U_RET] == 0 and post[U_NR] == 0x2A
            assert len(pattrs[A_PARAMS]) == 32
            data = bytearray(pattrs[A_DATA])
            assert struct.unpack_from("=II", data, 4) == (nv.FB_TOTAL_RAM_SIZE,
                                                         real[nv.FB_TOTAL_RAM_SIZE])
            struct.pack_into("=IIII", data, 4, nv.FB_TOTAL_RAM_SIZE, 262144,
                             nv.FB_HEAP_FREE, 131072)
            g.verdict(post[U_ID], REPLY, data=bytes(data))
            assert c.result() == (0, 0, {nv.FB_TOTAL_RAM_SIZE: 262144, nv.FB_HEAP_FREE: 131072})
            assert rm_calls() == calls + 1, "the driver was not called exactly once"
            # ALLOW to the POST upcall keeps the driver's results.
            c = Call(nv.fb_get_info_v2, ctl, t.client, t.subdevice, idx)
            hdr, _ = g.next_upcall()
            g.verdict(hdr[U_ID], ALLOW, flags=VERDICT_F_POST)
            post, _ = g.next_upcall()
            # A POST upcall takes ALLOW, REPLY or (v4) FAIL_STATUS only; REPLY
            # as long as sent.
            for action, kw in ((DENY, dict(error=1)),
                               (ALLOW, dict(flags=VERDICT_F_POST)),
                               (ALLOW, dict(params=bytes(32))),
                               (REPLY, dict(data=bytes(8)))):
                with pytest.raises(NlError) as e:
                    g.verdict(post[U_ID], action, **kw)
                assert e.value.errno == errno.EINVAL, action
            g.verdict(post[U_ID], ALLOW)
            assert c.result() == (0, 0, real)
            # The daemon goes while a POST upcall waits: the results stay.
            c = Call(nv.fb_get_info_v2, ctl, t.client, t.subdevice, idx)
            hdr, _ = g.next_upcall()
            g.verdict(hdr[U_ID], ALLOW, flags=VERDICT_F_POST)
            g.next_upcall()
            g.unregister()
            assert c.result() == (0, 0, real)
            after = stats()
            assert after["events"] == before["events"], "POST event sent besides the upcall"
            assert after["upcalls"] == before["upcalls"] + 6
            assert after["fail_closed"] == before["fail_closed"]
    finally:
        os.close(ctl)


def test_post_timeout_keeps_results(vg: Env, responder_bin: Path, responders) -> None:
    r = start(responders, responder_bin, "-f", f"ctl:{RM_ALLOC:#x}:0:12:-:-:0x41",
              "-a", "post-ignore")
    set_param("vgpu", "upcall_timeout_ms", "300")
    fd = vg.open()
    try:
        before = stats()
        if vg.nvsim:
            ret, params = alloc(fd, 0x41)
            assert ret == 0 and status_of(params) == 0 and NVOS21.unpack(params)[2] != 0
        else:
            with pytest.raises(OSError) as e:
                alloc(fd, 0x41)
            assert e.value.errno == errno.ENOTTY  # the driver's answer, not the policy's
        up = r.expect("upcall")
        post = r.expect("upcall")
        assert up["kind"] == "2" and post["kind"] == "3" and post["id"] == up["id"]
        assert int(post["ret"]) == (0 if vg.nvsim else -errno.ENOTTY)
        after = stats()
        assert after["timeouts"] == before["timeouts"] + 1
        assert after["fail_closed"] == before["fail_closed"]
        assert after["verdicts"] == before["verdicts"] + 1
    finally:
        os.close(fd)


def test_responder_post(vg: Env, responder_bin: Path, responders) -> None:
    r = start(responders, responder_bin, "-f", f"ctl:{RM_ALLOC:#x}:0:12:-:-:0x41",
              "-a", "post")
    fd = vg.open()
    try:
        before = stats()
        with contextlib.suppress(OSError):
            alloc(fd, 0x41)
        up, post = r.expect("upcall"), r.expect("upcall")
        assert (up["kind"], post["kind"], post["plen"]) == ("2", "3", "32")
        assert post["id"] == up["id"]
        after = stats()
        assert after["verdicts"] == before["verdicts"] + 2
        assert after["events"] == before["events"]
    finally:
        os.close(fd)
    r.expect("event kind=2")


def _candidates(sent: Sent) -> list[Verdict]:
    """Verdicts of every action, flag and block combination, each block
    absent, as long as the upcall's (8 bytes where it sent none) or a byte
    longer; and the error and status_off edges."""
    blocks: list[tuple[bytes | None, ...]] = [()]
    for size in (sent.params, sent.data, sent.data2):
        right = size or 8
        blocks = [(*b, v) for b in blocks for v in (None, bytes(right), bytes(right + 1))]
    out = [Verdict(action, error, status, off, flags, *b)
           for action, error, status, off in ((VerdictAction.ALLOW, 0, 0, 0),
                                              (VerdictAction.DENY, errno.EACCES, 0, 0),
                                              (VerdictAction.FAIL_STATUS, 0, 0x51, 0),
                                              (VerdictAction.REPLY, 0, 0, 0))
           for flags in (0, VERDICT_F_POST, VERDICT_F_SCHED_OFF,
                         VERDICT_F_POST | VERDICT_F_SCHED_OFF, 1 << 2)
           for b in blocks]
    out += [Verdict(VerdictAction.DENY, 0), Verdict(VerdictAction.DENY, ERRNO_MAX + 1),
            Verdict(VerdictAction.ALLOW, 1),
            Verdict(VerdictAction.FAIL_STATUS, status=0x51, status_off=max(sent.params - 4, 0)),
            Verdict(VerdictAction.FAIL_STATUS, status=0x51, status_off=max(sent.params - 3, 0))]
    return out


def _legal(v: Verdict, sent: Sent) -> bool:
    try:
        check(v, sent)
    except ValueError:
        return False
    return True


def _sent(hdr: tuple[int, ...], attrs: dict[int, bytes]) -> Sent:
    return Sent(UpcallKind(hdr[U_KIND]), hdr[U_NR], len(attrs.get(A_PARAMS, b"")),
                len(attrs.get(A_DATA, b"")), len(attrs.get(A_DATA2, b"")))


def test_the_verdict_table_is_the_modules(vg: Env) -> None:
    """vgpud.kernel.verdicts, the table the daemon checks its verdicts by,
    against the module's own check: every combination of action, flags and
    blocks, sent for an OPEN, an IOCTL (params and data) and a POST upcall,
    is refused (EINVAL) exactly when the table refuses it, and a refused one
    leaves the caller waiting."""
    fd = vg.open()
    buf = ctypes.create_string_buffer(56)
    wrong: list[str] = []
    try:
        with daemon([ALLOC40_DATA], FILTER_OPEN) as g:
            def upcall(kind: UpcallKind) -> tuple[Call, int, Sent]:
                if kind is UpcallKind.OPEN:
                    c = Call(vg.open)
                else:
                    c = Call(alloc, fd, 0x40, ctypes.addressof(buf), 56)
                hdr, attrs = g.next_upcall()
                if kind is UpcallKind.POST:
                    g.verdict(hdr[U_ID], ALLOW, flags=VERDICT_F_POST)
                    hdr, attrs = g.next_upcall()
                assert hdr[U_KIND] == kind
                return c, hdr[U_ID], _sent(hdr, attrs)

            def finish(c: Call, v: Verdict) -> None:
                if v.flags & VERDICT_F_POST:  # its POST upcall, answered
                    post, _ = g.next_upcall()
                    assert post[U_KIND] == UPCALL_POST
                    g.verdict(post[U_ID], ALLOW)
                with contextlib.suppress(OSError):
                    value = c.result()
                    if isinstance(value, int):  # an OPEN's new file
                        os.close(value)

            for kind in (UpcallKind.OPEN, UpcallKind.IOCTL, UpcallKind.POST):
                c, uid, sent = upcall(kind)
                tried = _candidates(sent)
                for v in tried:
                    try:
                        g.verdict(uid, int(v.action), error=v.error, status=v.status,
                                  status_off=v.status_off, flags=v.flags, params=v.params,
                                  data=v.data, data2=v.data2)
                        accepted = True
                    except NlError as e:
                        assert e.errno == errno.EINVAL, (v, e.msg)
                        accepted = False
                    if accepted != _legal(v, sent):
                        wrong.append(f"{kind.name}: module {'accepts' if accepted else 'refuses'}"
                                     f" {v}")
                    if accepted:
                        finish(c, v)
                        c, uid, sent = upcall(kind)
                    else:
                        assert c.alive(), "a refused verdict completed the caller"
                g.verdict(uid, ALLOW)
                finish(c, Verdict(VerdictAction.ALLOW))
                assert sum(_legal(v, sent) for v in tried) >= 2, kind  # some of each
    finally:
        os.close(fd)
    assert not wrong, "\n".join(wrong)
