"""Calls a tenant makes, for the module tests: RM_ALLOC through ctypes (plain or
wrapped in IOCTL_XFER_CMD), a call run in a thread while the test plays the
daemon, and nvsim's count of the calls that reached it.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from pathlib import Path

from tests.support.guest import Env


def iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord("F") << 8) | nr


RM_ALLOC, CHECK_VERSION_STR, REGISTER_FD, XFER = 0x2B, 210, 201, 211
NVOS21 = struct.Struct("=IIIIQII")  # hRoot hParent hNew hClass pAllocParms paramsSize status
NV_ERR_NO_MEMORY = 0x51

libc = ctypes.CDLL(None, use_errno=True)
libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
libc.ioctl.restype = ctypes.c_int


def ioctl(fd: int, cmd: int, buf: ctypes.Array[ctypes.c_char] | None) -> int:
    ret = libc.ioctl(fd, cmd, ctypes.addressof(buf) if buf is not None else None)
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret


def alloc(fd: int, h_class: int, pparams: int = 0, psize: int = 0,
          xfer: bool = False) -> tuple[int, bytes]:
    """RM_ALLOC (NVOS21) on @fd; returns (ioctl result, params after)."""
    buf = ctypes.create_string_buffer(NVOS21.pack(0, 0, 0, h_class, pparams, psize, 0xFFFF))
    if not xfer:
        return ioctl(fd, iowr(RM_ALLOC, NVOS21.size), buf), buf.raw[:NVOS21.size]
    x = ctypes.create_string_buffer(struct.pack("=IIQ", RM_ALLOC, NVOS21.size,
                                                ctypes.addressof(buf)))
    before = x.raw
    ret = ioctl(fd, iowr(XFER, 16), x)
    assert x.raw == before, "the XFER wrapper was modified"
    return ret, buf.raw[:NVOS21.size]


def status_of(params: bytes) -> int:
    return NVOS21.unpack(params)[6]


def rm_calls() -> int | None:
    """nvsim's count of calls it received, None without nvsim."""
    p = Path("/sys/module/nvsim/parameters/rm_calls")
    return int(p.read_text()) if p.exists() else None


class Call:
    """Runs fn(*args) in a thread; result() returns its value or raises its error."""

    def __init__(self, fn, *args, **kw) -> None:
        self.value: object = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn(*args, **kw)
            except BaseException as e:  # handed to result()
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def result(self, timeout: float = 10):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the call did not return"
        if self.error:
            raise self.error
        return self.value


def waiters(vg: Env, n: int) -> tuple[list[threading.Thread], list[object]]:
    """n threads, each opening a file of `vg` and calling RM_ALLOC of class 0x40;
    each result (a return value or an errno) lands in the list."""
    results: list[object] = [None] * n

    def call(i: int) -> None:
        fd = vg.open()
        try:
            results[i] = alloc(fd, 0x40)[0]
        except OSError as e:
            results[i] = e.errno
        finally:
            os.close(fd)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results
