"""kmod/vgpu's generic netlink family refusing what it must (VM tier): the
registration (version, one daemon), malformed or foreign verdicts, unregister
and filters by another socket, filter validation, and commands from an unprivileged user.
The daemon is the raw client of tests/support/vgpu_genl.py.

    scripts/test-vm -k test_vgpu_protocol
"""

from __future__ import annotations

import errno
import os
import time

import pytest

from tests.support.calls import RM_ALLOC, waiters
from tests.support.guest import Env
from tests.support.vgpu_genl import (
    A_PARAMS,
    ALLOW,
    DENY,
    FAIL_STATUS,
    FILTER_OPEN,
    FILTER_UVM_MMAP,
    NODE_CTL,
    NODE_GPU,
    NODE_UVM,
    OFF_NONE,
    PROTO_VERSION,
    REPLY,
    RULE,
    VERDICT_F_POST,
    Genl,
    NlError,
    rule,
    stats,
)

pytestmark = pytest.mark.vm


def test_bad_verdicts_and_registration(vg: Env) -> None:
    g = Genl()
    other = Genl()
    try:
        with pytest.raises(NlError) as e:
            g.register(version=99)
        assert e.value.errno == errno.EPROTONOSUPPORT and f"version {PROTO_VERSION}" in e.value.msg
        g.register()
        g.register()  # idempotent for the same port
        with pytest.raises(NlError) as e:
            other.register()
        assert e.value.errno == errno.EBUSY
        # SET_FILTER: only by the daemon, whatever the sender's capabilities.
        with pytest.raises(NlError) as e:
            other.set_filter([])
        assert e.value.errno == errno.EPERM and "registered daemon" in e.value.msg
        g.set_filter([rule(1 << NODE_CTL, RM_ALLOC, 0, 12, (0x40,))])
        threads, results = waiters(vg, 1)
        hdr, attrs = g.next_upcall()
        uid = hdr[0]
        assert len(attrs[A_PARAMS]) == 32
        before = stats()
        with pytest.raises(NlError) as e:
            other.verdict(uid, ALLOW)
        assert e.value.errno == errno.EPERM
        bad = [dict(action=0), dict(action=REPLY), dict(action=5), dict(action=DENY, error=0),
               dict(action=DENY, error=4096), dict(action=ALLOW, error=1),
               dict(action=FAIL_STATUS, status=1, status_off=29),
               dict(action=FAIL_STATUS, status=1, status_off=0xFFFFFFFE),
               dict(action=ALLOW, reserved=1), dict(action=ALLOW, flags=4),
               dict(action=DENY, error=1, flags=VERDICT_F_POST)]
        for b in bad:
            with pytest.raises(NlError) as e:
                g.verdict(uid, **b)
            assert e.value.errno == errno.EINVAL, b
        with pytest.raises(NlError) as e:
            g.verdict(uid + 1000, ALLOW)
        assert e.value.errno == errno.ENOENT
        time.sleep(0.1)
        assert threads[0].is_alive(), "a refused verdict completed the waiter"
        after = stats()
        assert after["bad_verdicts"] == before["bad_verdicts"] + len(bad)
        assert after["lost"] == before["lost"] + 1
        g.verdict(uid, DENY, error=errno.EACCES)
        threads[0].join(5)
        assert results == [errno.EACCES]
        with pytest.raises(NlError) as e:
            g.verdict(uid, ALLOW)
        assert e.value.errno == errno.ENOENT
        # UNREGISTER: only by the daemon; pending waiters get the fail policy.
        threads, results = waiters(vg, 1)
        g.next_upcall()
        with pytest.raises(NlError) as e:
            other.unregister()
        assert e.value.errno == errno.EPERM
        g.unregister()
        threads[0].join(5)
        assert results == [errno.EHOSTDOWN]
        other.register()  # the slot is free again
    finally:
        g.close()
        other.close()


def test_filter_validation(vg: Env) -> None:
    g = Genl()
    try:
        g.register()
        ctl = 1 << NODE_CTL
        bad = [
            rule(0, RM_ALLOC),
            rule(1 << 3, RM_ALLOC),
            rule(ctl, RM_ALLOC, flags=8),  # POST 1, SHADOW 2, LEN_FIXED 4, no more
            rule(ctl, RM_ALLOC, 0, 12, (0x40,), n_match=33),
            rule(ctl, RM_ALLOC, 32, 29, (0x40,)),
            rule(ctl, RM_ALLOC, 32, ptr_off=28, len_off=24),
            rule(ctl, RM_ALLOC, 32, ptr_off=16, len_off=OFF_NONE),
            rule(ctl, RM_ALLOC, 32, ptr_off=16, len_off=30),
            rule(ctl, RM_ALLOC, 16385),
            rule(ctl, RM_ALLOC, 0, 16381, (1,)),
        ]
        for b in bad:
            with pytest.raises(NlError) as e:
                g.set_filter([rule(ctl, 0x29), b])
            assert e.value.errno == errno.EINVAL, RULE.unpack(b)[:8]
        with pytest.raises(NlError) as e:
            g.set_filter([], raw=rule(ctl, RM_ALLOC)[:-4])
        assert e.value.errno == errno.EINVAL
        with pytest.raises(NlError):
            g.set_filter([rule(ctl, RM_ALLOC)] * 33)
        with pytest.raises(NlError):
            g.set_filter([], flags=4)
        g.set_filter([], flags=FILTER_UVM_MMAP)
        g.set_filter([rule(ctl, RM_ALLOC)] * 32, flags=FILTER_OPEN)
        g.set_filter([rule(ctl | (1 << NODE_GPU) | (1 << NODE_UVM), 0x30000001, 16, 0, (1,),
                           ptr_off=8, len_off=0)])
        g.set_filter([])
    finally:
        g.close()


def test_commands_need_admin(vg: Env) -> None:
    pid = os.fork()
    if pid == 0:  # child: an unprivileged user
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            Genl().stats()
        except NlError as e:
            code = e.errno
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == errno.EPERM
