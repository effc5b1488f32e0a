"""Another process's memory, with process_vm_readv / process_vm_writev.

For results the module cannot reach: FB_GET_INFO's list lies behind a pointer
inside the control params, in the caller's memory. The caller is blocked on
its POST upcall while the daemon rewrites the list, so the pages are there and
the pid is the caller's. The daemon needs the right to ptrace the caller
(CAP_SYS_PTRACE, or the same uid).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections.abc import Callable

__all__ = ["ProcessMemory"]


class _IoVec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _bind(name: str) -> Callable[..., int]:
    func = getattr(_libc, name)
    func.argtypes = (ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                     ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong)
    func.restype = ctypes.c_ssize_t
    return func


_IOV_FUNCS = {name: _bind(name) for name in ("process_vm_readv", "process_vm_writev")}


class ProcessMemory:
    """Reads and writes ``size`` bytes at ``address`` in process ``pid``; OSError
    (ESRCH: gone, EFAULT: not mapped, EPERM: not allowed) unless all of them
    were transferred."""

    def read(self, pid: int, address: int, size: int) -> bytes:
        buf = ctypes.create_string_buffer(size)
        self._transfer("process_vm_readv", pid, ctypes.addressof(buf), address, size)
        return buf.raw

    def write(self, pid: int, address: int, data: bytes) -> None:
        buf = ctypes.create_string_buffer(data, len(data))
        self._transfer("process_vm_writev", pid, ctypes.addressof(buf), address, len(data))

    @staticmethod
    def _transfer(name: str, pid: int, local: int, remote: int, size: int) -> None:
        local_iov = _IoVec(local, size)
        remote_iov = _IoVec(remote, size)
        done = _IOV_FUNCS[name](pid, ctypes.byref(local_iov), 1, ctypes.byref(remote_iov), 1, 0)
        if done < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{name} pid {pid}: {os.strerror(err)}")
        if done != size:
            raise OSError(errno.EFAULT, f"{name} pid {pid}: {done} of {size} bytes")
