"""The upcall path of kmod/vgpu (VM tier): a filtered ioctl waits for a verdict
of tests/support/c_responder (FAIL_STATUS, ALLOW with a POST event, DENY), an
OPEN upcall, the fail policy without a daemon, the upcall timeout, and the
daemon killed while callers wait.

    scripts/test-vm -k test_vgpu_upcalls
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.calls import NV_ERR_NO_MEMORY, RM_ALLOC, alloc, status_of, waiters
from tests.support.guest import Env, set_param, wait_for
from tests.support.responder import CLASS40, start
from tests.support.vgpu_genl import (
    F_DATA_BIG,
    F_DATA_FAULT,
    F_XFER,
    NODE_CTL,
    rule,
    set_filter,
    stats,
)

pytestmark = pytest.mark.vm


def test_slow_path_fail_status(vg: Env, responder_bin: Path, responders) -> None:
    r = start(responders, responder_bin, *CLASS40, "-a", f"status={NV_ERR_NO_MEMORY:#x}@28")
    before = stats()
    fd = vg.open()
    try:
        ret, params = alloc(fd, 0x40)
        assert ret == 0 and status_of(params) == NV_ERR_NO_MEMORY
        up = r.expect("upcall")
        assert up["kind"] == "2" and up["nr"] == "0x2b" and up["plen"] == "32"
        assert up["flags"] == "0x0"
        # Wrapped in IOCTL_XFER_CMD: same rule, status in the inner params.
        ret, params = alloc(fd, 0x40, xfer=True)
        assert ret == 0 and status_of(params) == NV_ERR_NO_MEMORY
        assert r.expect("upcall")["flags"] == hex(F_XFER)
        # Another class does not match: the driver answers.
        if vg.nvsim:
            ret, params = alloc(fd, 0x41)
            assert ret == 0 and status_of(params) == 0
    finally:
        os.close(fd)
    after = stats()
    assert after["upcalls"] == before["upcalls"] + 2
    assert after["verdicts"] == before["verdicts"] + 2
    assert after["daemon_portid"] != 0


def test_slow_path_allow_post_and_data(vg: Env, responder_bin: Path, responders) -> None:
    # Every 32-byte RM_ALLOC, with the alloc-params buffer as data.
    r = start(responders, responder_bin, "-P", "-f", f"ctl:{RM_ALLOC:#x}:32:-:16:24:")
    fd = vg.open()
    try:
        if vg.nvsim:
            ret, params = alloc(fd, 0x41)
            assert ret == 0 and status_of(params) == 0
        else:
            with pytest.raises(OSError):
                alloc(fd, 0x41)
        up = r.expect("upcall")
        assert up["plen"] == "32" and up["dlen"] == "0"
        ev = r.expect("event kind=1")
        assert ev["upcall"] == up["id"] and ev["plen"] == "32"
        assert int(ev["ret"]) == (0 if vg.nvsim else -errno.ENOTTY)

        buf = ctypes.create_string_buffer(56)
        for pparams, psize, flags, dlen in ((ctypes.addressof(buf), 56, 0, "56"),
                                            (0x10, 8, F_DATA_FAULT, "0"),
                                            (ctypes.addressof(buf), 1 << 20, F_DATA_BIG, "0")):
            with contextlib.suppress(OSError):
                alloc(fd, 0x80, pparams, psize)
            up = r.expect("upcall")
            assert int(up["flags"], 16) == flags and up["dlen"] == dlen
    finally:
        os.close(fd)
    r.expect("event kind=2")


def test_post_event_only_when_the_rule_asks(vg: Env, responder_bin: Path, responders) -> None:
    r = start(responders, responder_bin, "-f", f"ctl:{RM_ALLOC:#x}:32:-:-:-")
    fd = vg.open()
    try:
        before = stats()
        with contextlib.suppress(OSError):
            alloc(fd, 0x41)
        r.expect("upcall")
        after = stats()
        assert after["upcalls"] == before["upcalls"] + 1
        assert after["events"] == before["events"]
    finally:
        os.close(fd)
    r.expect("event kind=2")


def test_deny_and_open_filter(vg: Env, responder_bin: Path, responders) -> None:
    r = start(responders, responder_bin, "-O", *CLASS40, "-a", "deny=13")
    with pytest.raises(PermissionError):
        vg.open()
    up = r.expect("upcall")
    assert up["kind"] == "1" and up["cgroup"].startswith("/")
    assert up["pid"] == str(os.getpid()) and up["uid"] == "0"
    r.kill()
    r = start(responders, responder_bin, "-O", *CLASS40, "-a", "allow")
    fd = vg.open()
    try:
        assert r.expect("upcall")["kind"] == "1"
        if vg.nvsim:
            ret, _ = alloc(fd, 0x40)  # allowed: reaches nvsim (no parent: a status)
            assert ret == 0
    finally:
        os.close(fd)


def test_no_daemon_fail_closed_and_open(vg: Env) -> None:
    set_filter([rule(1 << NODE_CTL, RM_ALLOC, 0, 12, (0x40,))])
    fd = vg.open()
    try:
        before = stats()
        with pytest.raises(OSError) as e:
            alloc(fd, 0x40)
        assert e.value.errno == errno.EHOSTDOWN
        assert stats()["fail_closed"] == before["fail_closed"] + 1
        set_param("vgpu", "fail_open", "1")
        if vg.nvsim:
            ret, _ = alloc(fd, 0x40)
            assert ret == 0
        else:
            with pytest.raises(OSError) as e:
                alloc(fd, 0x40)
            assert e.value.errno == errno.ENOTTY
        assert stats()["fail_open"] == before["fail_open"] + 1
    finally:
        os.close(fd)


def test_timeout(vg: Env, responder_bin: Path, responders) -> None:
    start(responders, responder_bin, *CLASS40, "-a", "ignore")
    set_param("vgpu", "upcall_timeout_ms", "300")
    fd = vg.open()
    try:
        before = stats()
        t0 = time.monotonic()
        with pytest.raises(OSError) as e:
            alloc(fd, 0x40)
        assert e.value.errno == errno.ETIMEDOUT
        assert time.monotonic() - t0 > 0.25  # no upper bound: a loaded guest wakes late
        assert stats()["timeouts"] == before["timeouts"] + 1  # the module's timer ended it
    finally:
        os.close(fd)


@pytest.mark.parametrize("fail_open", [False, True])
def test_daemon_sigkill_with_waiters(vg: Env, responder_bin: Path, responders,
                                     fail_open: bool) -> None:
    set_param("vgpu", "upcall_timeout_ms", "20000")
    set_param("vgpu", "fail_open", "1" if fail_open else "0")
    r = start(responders, responder_bin, *CLASS40, "-a", "ignore")
    before = stats()
    # As many waiters as one opener has upcall slots (upcalls_per_opener, 4):
    # all of them are pending at once.
    threads, results = waiters(vg, 4)
    wait_for(lambda: stats()["upcalls"] == before["upcalls"] + 4, what="4 pending upcalls")
    r.proc.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "waiters stuck after the daemon died"
    # the daemon's death ended the waits, not upcall_timeout_ms (20 s), however late
    assert stats()["timeouts"] == before["timeouts"]
    if fail_open:
        assert all(x == 0 if vg.nvsim else x == errno.ENOTTY for x in results), results
    else:
        assert results == [errno.EHOSTDOWN] * 4
    assert stats()["daemon_portid"] == 0
    # The filter survives the daemon; a new daemon resumes filtering.
    set_param("vgpu", "fail_open", "0")
    fd = vg.open()
    try:
        with pytest.raises(OSError) as e:
            alloc(fd, 0x40)
        assert e.value.errno == errno.EHOSTDOWN
        start(responders, responder_bin, "-a", f"status={NV_ERR_NO_MEMORY:#x}@28")
        ret, params = alloc(fd, 0x40)
        assert ret == 0 and status_of(params) == NV_ERR_NO_MEMORY
    finally:
        os.close(fd)
