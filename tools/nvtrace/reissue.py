"""Re-issue a trace's calls against a directory of nodes and compare the outcomes.

Each recorded ioctl is sent again with its recorded params (before the
call), on the same node name under ``nodes`` (e.g. a fresh /dev/nvsim), and
its errno and NVIDIA status are compared with the recorded ones. What only
held in the recording process is remapped:
- fds (of opens, dups; the fds inside REGISTER_FD, RM_MAP_MEMORY and
  RM_ALLOC_MEMORY params);
- handles the driver chose (a recorded new handle is mapped to the one the
  replay got, in the handle fields of the RM params that follow);
- pointers: the XFER payload and the buffer an RM_ALLOC / RM_CONTROL points
  to are our own copies of the recorded bytes; a mapping's address from
  RM_MAP_MEMORY is mapped for RM_UNMAP_MEMORY.
Handles inside alloc or control params, and buffers two pointers deep, are
sent as recorded. mmaps are made again (without MAP_FIXED) and compared by
success. Run it in a process of its own: mappings stay until it exits.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections import Counter
from dataclasses import dataclass, field

from tools.nvtrace.calls import Closed, Ioctl, Mmap, Opened, events
from tools.nvtrace.fmt import OpenHow, Tag, Trace
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import Escape, UvmCmd, iowr

__all__ = ["ReissueResult", "reissue"]

_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")
_XFER = struct.Struct("=IIQ")
MAP_FIXED = 0x10
MAP_FIXED_NOREPLACE = 0x100000

# Handle fields of the RM params (offsets), by (escape, params size).
_HANDLES: dict[tuple[int, int], tuple[int, ...]] = {
    (Escape.RM_FREE, 16): (0, 4, 8),
    (Escape.RM_ALLOC, 32): (0, 4, 8),
    (Escape.RM_ALLOC, 48): (0, 4, 8),
    (Escape.RM_CONTROL, 32): (0, 4),
    (Escape.RM_DUP_OBJECT, 28): (0, 4, 8, 12, 16),
    (Escape.RM_MAP_MEMORY, 56): (0, 4, 8),
    (Escape.RM_UNMAP_MEMORY, 32): (0, 4, 8),
    (Escape.RM_ALLOC_MEMORY, 56): (0, 4, 8),
    (Escape.RM_VID_HEAP_CONTROL, L.NVOS32.size): (0, 4, 12, L.NVOS32.offsets["hMemory"]),
}
# Where a call's new handle lies after it, by (escape, params size).
_NEW = {
    (Escape.RM_ALLOC, 32): 8, (Escape.RM_ALLOC, 48): 8, (Escape.RM_ALLOC_MEMORY, 56): 8,
    (Escape.RM_DUP_OBJECT, 28): 8,
    (Escape.RM_VID_HEAP_CONTROL, L.NVOS32.size): L.NVOS32.offsets["hMemory"],
}
# fd fields, by (escape, params size).
_FDS = {(Escape.REGISTER_FD, 4): 0, (Escape.RM_MAP_MEMORY, 56): 48,
        (Escape.RM_ALLOC_MEMORY, 56): 48}
# Nested pointer and length fields, by (escape, params size).
_NESTED = {(Escape.RM_ALLOC, 32): (16, 24), (Escape.RM_ALLOC, 48): (16, 32),
           (Escape.RM_CONTROL, 32): (16, 24)}
_MAP_ADDR = 32  # NVOS33.pLinearAddress
_UNMAP_ADDR = 16  # NVOS34.pLinearAddress
_UVM_STATUS: dict[int, int] = {UvmCmd.INITIALIZE: 8}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc.ioctl.restype = ctypes.c_int
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p


@dataclass(slots=True)
class ReissueResult:
    trace: str
    compared: int = 0
    mismatches: list[str] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not self.mismatches


class _Replayer:
    def __init__(self, trace: Trace, nodes: str) -> None:
        self.nodes = nodes
        self.res = ReissueResult(trace.name)
        self.fds: dict[int, int] = {}  # recorded fd -> ours
        self.handles: dict[int, int] = {}  # recorded handle -> ours
        self.addrs: dict[int, int] = {}  # recorded mapping address -> ours

    def opened(self, ev: Opened) -> None:
        how, old = ev.record.args[2], ev.record.args[3]
        if how == OpenHow.DUP and old in self.fds:
            self.fds[ev.fd] = os.dup(self.fds[old])
            return
        path = os.path.join(self.nodes, ev.node.name)
        try:
            self.fds[ev.fd] = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            self.res.skipped[f"open {path}: {exc.strerror}"] += 1

    def closed(self, ev: Closed) -> None:
        fd = self.fds.pop(ev.fd, None)
        if fd is not None:
            os.close(fd)

    def close_all(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def mmap(self, ev: Mmap) -> None:
        fd = self.fds.get(ev.fd)
        if fd is None:
            return
        flags = ev.flags & ~(MAP_FIXED | MAP_FIXED_NOREPLACE)
        ctypes.set_errno(0)
        addr = _libc.mmap(None, ev.length, ev.prot, flags, fd, ev.offset)
        ok = addr not in (None, ctypes.c_void_p(-1).value)
        self.res.compared += 1
        if ok != ev.ok:
            self.res.mismatches.append(f"#{ev.record.seq} mmap of {ev.length} bytes: recorded "
                                       f"errno {ev.record.err}, replayed "
                                       f"{'ok' if ok else ctypes.get_errno()}")

    def _map(self, value: int) -> int:
        return self.handles.get(value, value)

    def _params(self, ev: Ioctl, keep: list[ctypes.Array]) -> bytearray:
        """The recorded params with our fds, handles, addresses and buffers."""
        p = bytearray(ev.params_in or b"")
        key = (ev.nr, len(p))
        for off in _HANDLES.get(key, ()):
            _U32.pack_into(p, off, self._map(_U32.unpack_from(p, off)[0]))
        if key in _FDS:
            fd = struct.unpack_from("=i", p, _FDS[key])[0]
            struct.pack_into("=i", p, _FDS[key], self.fds.get(fd, fd))
        if key == (Escape.RM_UNMAP_MEMORY, 32):
            addr = _U64.unpack_from(p, _UNMAP_ADDR)[0]
            _U64.pack_into(p, _UNMAP_ADDR, self.addrs.get(addr, addr))
        if key in _NESTED and ev.data_in is not None and ev.data_in.whole:
            buf = ctypes.create_string_buffer(ev.data_in.data, max(len(ev.data_in.data), 1))
            keep.append(buf)
            _U64.pack_into(p, _NESTED[key][0], ctypes.addressof(buf))
        return p

    def _learn(self, ev: Ioctl, out: bytes) -> None:
        """Handles and addresses the driver chose, recorded -> ours."""
        key = (ev.nr, len(out))
        if ev.params_out is None or len(ev.params_out) != len(out):
            return
        if key in _NEW:
            rec, ours = (_U32.unpack_from(b, _NEW[key])[0] for b in (ev.params_out, out))
            if rec and ours and rec != ours:
                self.handles[rec] = ours
        if key == (Escape.RM_MAP_MEMORY, 56):
            self.addrs[_U64.unpack_from(ev.params_out, _MAP_ADDR)[0]] = \
                _U64.unpack_from(out, _MAP_ADDR)[0]

    def ioctl(self, ev: Ioctl) -> None:
        fd = self.fds.get(ev.fd)
        if fd is None:
            return
        if ev.params_in is None and ev.record.block(Tag.ARG) is not None:
            self.res.skipped["params not recorded whole"] += 1
            return
        keep: list[ctypes.Array] = []
        p = self._params(ev, keep) if ev.nvidia else bytearray(ev.params_in or b"")
        payload = ctypes.create_string_buffer(bytes(p), max(len(p), 1))
        arg, request = payload, ev.request
        if ev.xfer:
            arg = ctypes.create_string_buffer(
                _XFER.pack(ev.nr, len(p), ctypes.addressof(payload)), _XFER.size)
            request = iowr(Escape.IOCTL_XFER_CMD, _XFER.size)
        ctypes.set_errno(0)
        rc = _libc.ioctl(fd, request, ctypes.addressof(arg) if p else None)
        err = ctypes.get_errno() if rc < 0 else 0
        out = bytes(payload.raw[:len(p)])
        self._compare(ev, err, out)
        if ev.nvidia:
            self._learn(ev, out)

    def _compare(self, ev: Ioctl, err: int, out: bytes) -> None:
        rec_status, our_status = ev.status, None
        if ev.nvidia:
            off = L.status_offset(ev.nr, len(out))
        else:
            off = _UVM_STATUS.get(ev.nr)
            if off is not None and ev.params_out is not None and len(ev.params_out) > off:
                rec_status = _U32.unpack_from(ev.params_out, off)[0]
        if off is not None and len(out) >= off + 4:
            our_status = _U32.unpack_from(out, off)[0]
        self.res.compared += 1
        if (ev.err, rec_status) != (err, our_status):
            self.res.mismatches.append(
                f"#{ev.seq} {ev.node.name} escape {ev.nr:#x}{' (XFER)' if ev.xfer else ''}: "
                f"recorded errno {ev.err} status {_hex(rec_status)}, replayed errno {err} "
                f"status {_hex(our_status)}")


def _hex(v: int | None) -> str:
    return "-" if v is None else f"{v:#x}"


def reissue(trace: Trace, nodes: str) -> ReissueResult:
    """Send ``trace``'s calls again to the nodes under ``nodes``."""
    r = _Replayer(trace, nodes)
    try:
        for ev in events(trace):
            if isinstance(ev, Opened):
                r.opened(ev)
            elif isinstance(ev, Closed):
                r.closed(ev)
            elif isinstance(ev, Ioctl):
                r.ioctl(ev)
            else:
                r.mmap(ev)
    finally:
        r.close_all()
    return r.res
