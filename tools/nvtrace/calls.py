"""A trace's records as NVIDIA calls: which node each fd names, XFER unwrapped.

``events(trace)`` walks a trace in the order its calls began, following the
OPEN and CLOSE records to know the path behind each fd, and yields Opened,
Closed, Ioctl and Mmap events. An Ioctl carries the escape after
IOCTL_XFER_CMD unwrapping (the number vgpu's filter and vgpud's decoders
use), the params before and after the call, and the buffer the params point
to (alloc params, control params) before and after: of an allocation, the
bytes the driver reads for its class (ALLOC_PARAMS), cut from the window the
recorder copies.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import Enum

from tools.nvtrace.fmt import Block, Kind, Record, Tag, Trace
from vgpud.nvidia import layouts as L
from vgpud.nvidia.escapes import IOCTL_MAGIC, Escape, ioc_nr, ioc_size

__all__ = ["Closed", "Event", "Ioctl", "Mmap", "Node", "NodeKind", "Opened", "events",
           "node_of"]

_GPU_NAME = re.compile(r"nvidia(\d+)")
_XFER = struct.Struct("=IIQ")
_U32 = struct.Struct("=I")


class NodeKind(Enum):
    CTL = "ctl"
    GPU = "gpu"
    UVM = "uvm"
    OTHER = "other"  # a node vgpu does not emulate (uvm-tools, modeset, caps, ...)


@dataclass(frozen=True, slots=True)
class Node:
    path: str
    kind: NodeKind
    minor: int = 0  # nvidiaN: N

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def node_of(path: str) -> Node:
    """The node a path names, by its last component (the directory may be
    /dev, /dev/nvsim, /dev/vgpu or a namespace's bind mount)."""
    name = path.rsplit("/", 1)[-1]
    if name == "nvidiactl":
        return Node(path, NodeKind.CTL, 255)
    if name == "nvidia-uvm":
        return Node(path, NodeKind.UVM)
    m = _GPU_NAME.fullmatch(name)
    if m:
        return Node(path, NodeKind.GPU, int(m.group(1)))
    return Node(path, NodeKind.OTHER)


@dataclass(frozen=True, slots=True)
class Opened:
    record: Record
    fd: int
    node: Node


@dataclass(frozen=True, slots=True)
class Closed:
    record: Record
    fd: int
    node: Node


@dataclass(frozen=True, slots=True)
class Mmap:
    record: Record
    fd: int
    node: Node
    addr: int
    length: int
    prot: int
    flags: int
    offset: int

    @property
    def ok(self) -> bool:
        return self.record.err == 0


@dataclass(frozen=True, slots=True)
class Ioctl:
    """One ioctl on a traced node.

    ``nr``: the escape (after XFER unwrapping) for NVIDIA-style requests, the
    command for nvidia-uvm, else the raw request. ``params_*``: the escape's
    params (the XFER payload when wrapped); None when not read whole.
    ``data_*``: the buffer the params point to, when the recorder copied it.
    """

    record: Record
    fd: int
    node: Node
    request: int
    nr: int
    xfer: bool
    nvidia: bool  # an _IOC('F') escape (RM and OS escapes); False for uvm and others
    params_in: bytes | None
    params_out: bytes | None
    data_in: Block | None
    data_out: Block | None

    @property
    def ret(self) -> int:
        return self.record.ret

    @property
    def err(self) -> int:
        return self.record.err

    @property
    def seq(self) -> int:
        return self.record.seq

    @property
    def status(self) -> int | None:
        """The NVIDIA status the driver wrote, for escapes with one."""
        if not self.nvidia or self.params_out is None:
            return None
        off = L.status_offset(self.nr, len(self.params_out))
        return None if off is None else _U32.unpack_from(self.params_out, off)[0]

    @property
    def ok(self) -> bool:
        """ioctl returned 0 and the status (if any) is NV_OK."""
        return self.ret == 0 and self.status in (None, 0)


Event = Opened | Closed | Ioctl | Mmap


def _whole(block: Block | None) -> bytes | None:
    return block.data if block is not None and block.whole else None


def _class_params(params: bytes | None, block: Block | None) -> Block | None:
    """An RM_ALLOC's alloc params block as the driver reads it: the size its
    class takes, when the recorder's window covers it (format 2 copies a
    window; format 1 copied paramsSize bytes, which the driver ignores)."""
    if block is None or params is None or len(params) not in (L.NVOS21.size, L.NVOS64.size):
        return block
    layout = L.ALLOC_PARAMS.get(_U32.unpack_from(params, L.NVOS21.offsets["hClass"])[0])
    if layout is None or len(block.data) < layout.size:
        return block
    return replace(block, want=layout.size, data=block.data[:layout.size], fault=False,
                   trunc=False)


def _ioctl(r: Record, node: Node) -> Ioctl:
    request = r.args[0]
    nvidia = node.kind is not NodeKind.UVM and (request >> 8) & 0xFF == IOCTL_MAGIC
    if not nvidia:
        arg_in, arg_out = r.block(Tag.ARG), r.block(Tag.ARG, out=True)
        return Ioctl(r, r.fd, node, request, request, False, False,
                     arg_in.data if arg_in else None, arg_out.data if arg_out else None,
                     None, None)
    nr, xfer = ioc_nr(request), False
    params_in, params_out = _whole(r.block(Tag.ARG)), _whole(r.block(Tag.ARG, out=True))
    if params_in is not None and len(params_in) != ioc_size(request):
        params_in = params_out = None
    if nr == Escape.IOCTL_XFER_CMD and params_in is not None and len(params_in) == _XFER.size:
        nr, xfer = _XFER.unpack(params_in)[0], True
        params_in, params_out = _whole(r.block(Tag.XFER)), _whole(r.block(Tag.XFER, out=True))
    data_in, data_out = r.block(Tag.PTR), r.block(Tag.PTR, out=True)
    if nr == Escape.RM_ALLOC:
        data_in, data_out = _class_params(params_in, data_in), _class_params(params_in, data_out)
    return Ioctl(r, r.fd, node, request, nr, xfer, True, params_in, params_out,
                 data_in, data_out)


def _mmap(r: Record, node: Node) -> Mmap:
    addr, length, protflags, offset = r.args
    return Mmap(r, r.fd, node, addr, length, protflags & 0xFFFFFFFF, protflags >> 32, offset)


def events(trace: Trace) -> Iterator[Event]:
    """The trace's events in the order the calls began (seq).

    A call on an fd without an OPEN record (the recorder always writes one
    first) is skipped; a CLOSE ends the fd's node.
    """
    nodes: dict[int, Node] = {}
    for r in sorted(trace.records, key=lambda rec: rec.seq):
        if r.kind == Kind.OPEN:
            path = r.block(Tag.PATH)
            node = node_of(path.data.decode(errors="replace") if path else "")
            nodes[r.fd] = node
            yield Opened(r, r.fd, node)
            continue
        node_or_none = nodes.get(r.fd)
        if node_or_none is None:
            continue
        if r.kind == Kind.CLOSE:
            del nodes[r.fd]
            yield Closed(r, r.fd, node_or_none)
        elif r.kind == Kind.IOCTL:
            yield _ioctl(r, node_or_none)
        elif r.kind == Kind.MMAP:
            yield _mmap(r, node_or_none)
