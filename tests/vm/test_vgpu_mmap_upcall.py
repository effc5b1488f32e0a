"""MMAP upcalls of nvidia-uvm (VM tier, FILTER_UVM_MMAP): ALLOW, DENY, MAP_PRIVATE
reported, the fail policy, and a caller killed while it waits under its
mmap_lock. The mmap runs in a child process (MmapChild says why).

    scripts/test-vm -k test_vgpu_mmap_upcall
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import select
import signal
import subprocess
import sys

import pytest

from tests.support.calls import libc
from tests.support.guest import ROOT, Env, set_param
from tests.support.vgpu_genl import (
    A_PARAMS,
    ALLOW,
    DENY,
    FAIL_STATUS,
    FILTER_UVM_MMAP,
    MMAP_PARAMS,
    NODE_UVM,
    REPLY,
    U_ID,
    U_KIND,
    U_NODE,
    UPCALL_MMAP,
    VERDICT_F_POST,
    NlError,
    daemon,
    set_filter,
    stats,
)

pytestmark = pytest.mark.vm

PAGE = mmap.PAGESIZE

libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.mmap.restype = ctypes.c_void_p
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class MmapChild:
    """mmap in a child process, which then touches the pages.

    The caller of mmap holds its mmap_lock while the upcall waits: a
    responder in the same process (a thread here) would block on it at its
    next page fault or heap growth, so the caller must be another process.
    result() returns "ok" or raises the mmap's OSError.
    """

    def __init__(self, fd: int, length: int, flags: int = mmap.MAP_SHARED,
                 offset: int = 0) -> None:
        rd, wr = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(rd)
            addr = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd,
                             offset)
            if addr in (None, ctypes.c_void_p(-1).value):
                out = f"errno {ctypes.get_errno()}"
            elif ctypes.string_at(addr, length) != bytes(length):
                out = "not zeroed"
            else:
                ctypes.memmove(addr + length - 4, b"uvm!", 4)
                out = "ok" if ctypes.string_at(addr + length - 4, 4) == b"uvm!" else "bad"
                libc.munmap(addr, length)
            os.write(wr, out.encode())
            os._exit(0)
        os.close(wr)
        self.rd = rd

    def result(self, timeout: float = 10) -> str:
        try:
            ready, _, _ = select.select([self.rd], [], [], timeout)
            assert ready, "mmap did not return"
            out = os.read(self.rd, 100).decode()
        finally:
            os.close(self.rd)
            os.waitpid(self.pid, 0)
        if out.startswith("errno "):
            e = int(out.split()[1])
            raise OSError(e, os.strerror(e))
        assert out == "ok", out
        return out


def _mmap(fd: int, length: int, flags: int = mmap.MAP_SHARED, offset: int = 0) -> None:
    MmapChild(fd, length, flags, offset).result()


def test_mmap_upcall(vg: Env) -> None:
    if not (vg.dev / "nvidia-uvm").exists():
        pytest.skip("no nvidia-uvm node")
    uvm = vg.open("nvidia-uvm")
    ctl = vg.open()
    try:
        with daemon([], FILTER_UVM_MMAP) as g:
            before = stats()
            c = MmapChild(uvm, 2 * PAGE, offset=3 * PAGE)
            hdr, attrs = g.next_upcall()
            assert (hdr[U_KIND], hdr[U_NODE]) == (UPCALL_MMAP, NODE_UVM)
            assert MMAP_PARAMS.unpack(attrs[A_PARAMS]) == (3, 2 * PAGE, 3, 1)
            for action, kw in ((REPLY, dict(params=bytes(24))), (FAIL_STATUS, {}),
                               (ALLOW, dict(flags=VERDICT_F_POST))):
                with pytest.raises(NlError) as e:
                    g.verdict(hdr[U_ID], action, **kw)
                assert e.value.errno == errno.EINVAL, action
            g.verdict(hdr[U_ID], ALLOW)
            if vg.nvsim:
                assert c.result() == "ok"  # zeroed pages, writable
            else:
                with pytest.raises(OSError):
                    c.result()
            assert stats()["mmaps"] == before["mmaps"] + 1
            # DENY: the errno, nothing mapped, nothing forwarded.
            c = MmapChild(uvm, PAGE)
            hdr, _ = g.next_upcall()
            g.verdict(hdr[U_ID], DENY, error=errno.EPERM)
            with pytest.raises(PermissionError):
                c.result()
            assert stats()["mmaps"] == before["mmaps"] + 1
            # MAP_PRIVATE is reported as such (nvsim then refuses it).
            c = MmapChild(uvm, PAGE, mmap.MAP_PRIVATE)
            hdr, attrs = g.next_upcall()
            assert MMAP_PARAMS.unpack(attrs[A_PARAMS])[3] == 2
            g.verdict(hdr[U_ID], ALLOW)
            with pytest.raises(OSError) as e:
                c.result()
            if vg.nvsim:
                assert e.value.errno == errno.EINVAL
            # Other nodes are not upcalled.
            with contextlib.suppress(OSError):
                _mmap(ctl, PAGE)
            assert stats()["upcalls"] == before["upcalls"] + 3
    finally:
        os.close(ctl)
        os.close(uvm)


def test_mmap_upcall_fail_policy(vg: Env) -> None:
    """No daemon: closed refuses, open forwards; without the flag no upcall."""
    if not (vg.dev / "nvidia-uvm").exists():
        pytest.skip("no nvidia-uvm node")
    uvm = vg.open("nvidia-uvm")
    try:
        with daemon([], FILTER_UVM_MMAP) as g:
            before = stats()
            g.unregister()
            with pytest.raises(OSError) as e:
                _mmap(uvm, PAGE)
            assert e.value.errno == errno.EHOSTDOWN
            set_param("vgpu", "fail_open", "1")
            with contextlib.suppress(OSError):
                _mmap(uvm, PAGE)
            assert stats()["fail_open"] == before["fail_open"] + 1
        set_param("vgpu", "fail_open", "0")
        set_filter([])
        before = stats()
        if vg.nvsim:
            _mmap(uvm, PAGE)
        assert stats()["upcalls"] == before["upcalls"]
    finally:
        set_param("vgpu", "fail_open", "0")
        os.close(uvm)


def test_mmap_upcall_caller_killed(vg: Env) -> None:
    """A caller killed while waiting under mmap_lock leaves no waiter."""
    if not (vg.dev / "nvidia-uvm").exists():
        pytest.skip("no nvidia-uvm node")
    code = ("import mmap, os\n"
            "fd = os.open('/dev/vgpu/nvidia-uvm', os.O_RDWR)\n"
            "print('calling', flush=True)\n"
            "mmap.mmap(fd, 4096)\n"
            "print('returned', flush=True)\n")
    with daemon([], FILTER_UVM_MMAP) as g:
        before = stats()
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                 text=True, cwd=ROOT)
        hdr, _ = g.next_upcall(timeout=30)
        assert hdr[U_KIND] == UPCALL_MMAP
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=5) == -signal.SIGKILL
        assert "returned" not in child.stdout.read()
        with pytest.raises(NlError) as e:
            g.verdict(hdr[U_ID], ALLOW)
        assert e.value.errno == errno.ENOENT
        assert stats()["killed"] == before["killed"] + 1
