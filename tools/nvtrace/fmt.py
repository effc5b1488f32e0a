"""The nvtrace file format (tools/nvtrace/nvtrace.h, docs/nvtrace.md): reader and writer.

The writer makes the same bytes libnvtrace.so writes, so that synthetic
traces (tests, documentation) go through exactly the reader real traces do.
Files may be gzip-compressed (``.gz``).
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import BinaryIO

from vgpud.kernel.cstruct import CStruct

__all__ = [
    "BLOCK",
    "HEADER",
    "LAYOUTS",
    "META",
    "RECORD",
    "Block",
    "Header",
    "Kind",
    "Meta",
    "OpenHow",
    "Record",
    "Tag",
    "Trace",
    "TraceError",
    "TraceWriter",
    "read_trace",
]

MAGIC = b"NVTRACE\0"
VERSION = 2
# Versions this reader takes: 1 copied an RM_ALLOC's alloc params by its
# paramsSize, 2 a window of Header.window bytes (tools/nvtrace/nvtrace.h).
VERSIONS = (1, 2)
H_UNSAFE_COPY = 1 << 0
BF_OUT, BF_FAULT, BF_TRUNC = 1 << 0, 1 << 1, 1 << 2

HEADER = CStruct(
    "nvtrace_header",
    ("magic", "8s"), ("version", "H"), ("header_size", "H"), ("meta_size", "I"),
    ("pid", "I"), ("ppid", "I"), ("realtime_ns", "Q"), ("monotonic_ns", "Q"),
    ("flags", "I"), ("max_block", "I"), ("window", "I"), ("reserved", "I"),
)
META = CStruct("nvtrace_meta", ("tag", "H"), ("len", "H"))
RECORD = CStruct(
    "nvtrace_record",
    ("size", "I"), ("kind", "H"), ("nblocks", "H"), ("seq", "I"), ("tid", "I"),
    ("start_ns", "Q"), ("end_ns", "Q"), ("ret", "q"), ("err", "i"), ("fd", "i"),
    ("arg", "4Q"),
)
BLOCK = CStruct(
    "nvtrace_block",
    ("tag", "H"), ("flags", "H"), ("len", "I"), ("addr", "Q"), ("want", "I"), ("err", "i"),
)
LAYOUTS = (HEADER, META, RECORD, BLOCK)


class TraceError(ValueError):
    """A file that is not an nvtrace file, or one this reader cannot read."""


class Meta(IntEnum):
    DRIVER = 1
    GPU = 2
    COMM = 3
    CMDLINE = 4
    EXE = 5
    UNAME = 6
    PREFIXES = 7
    MODULE_VERSION = 8


class Kind(IntEnum):
    IOCTL = 1
    MMAP = 2
    OPEN = 3
    CLOSE = 4


class OpenHow(IntEnum):
    CALL = 0
    FOUND = 1
    DUP = 2


class Tag(IntEnum):
    ARG = 1
    XFER = 2
    PTR = 3
    PATH = 4


@dataclass(frozen=True, slots=True)
class Block:
    tag: int
    out: bool  # read after the call
    addr: int
    want: int  # bytes the call named
    data: bytes
    fault: bool = False  # unreadable past len(data)
    trunc: bool = False  # want exceeded the recorder's max_block
    err: int = 0

    @property
    def whole(self) -> bool:
        """All the bytes the call named were read."""
        return not self.fault and not self.trunc and len(self.data) == self.want


@dataclass(frozen=True, slots=True)
class Record:
    kind: int
    seq: int
    tid: int
    start_ns: int
    end_ns: int
    ret: int
    err: int
    fd: int
    args: tuple[int, int, int, int]
    blocks: tuple[Block, ...] = ()

    def block(self, tag: Tag, out: bool = False) -> Block | None:
        for b in self.blocks:
            if b.tag == tag and b.out == out:
                return b
        return None


@dataclass(frozen=True, slots=True)
class Header:
    pid: int
    ppid: int = 0
    realtime_ns: int = 0
    monotonic_ns: int = 0
    flags: int = 0
    max_block: int = 1 << 20
    window: int = 4096
    meta: tuple[tuple[int, str], ...] = ()
    version: int = VERSION

    def values(self, tag: Meta) -> list[str]:
        return [v for t, v in self.meta if t == tag]

    def value(self, tag: Meta) -> str:
        vals = self.values(tag)
        return vals[0] if vals else ""

    @property
    def cmdline(self) -> list[str]:
        return self.value(Meta.CMDLINE).split("\0") if self.value(Meta.CMDLINE) else []


@dataclass(slots=True)
class Trace:
    path: str
    header: Header
    records: list[Record] = field(default_factory=list)
    tail: int = 0  # bytes of an incomplete last record (the process died mid-write)

    @property
    def name(self) -> str:
        return Path(self.path).name


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _read_header(buf: bytes) -> tuple[Header, int]:
    if len(buf) < HEADER.size or buf[:8] != MAGIC:
        raise TraceError("not an nvtrace file (bad magic)")
    (_magic, version, header_size, meta_size, pid, ppid, realtime, mono, flags, max_block,
     window, _reserved) = HEADER.unpack(buf)
    if version not in VERSIONS:
        raise TraceError(f"nvtrace format version {version}; this reader knows {VERSIONS}")
    if header_size != HEADER.size or meta_size % 8 or header_size + meta_size > len(buf):
        raise TraceError(f"bad header: header_size {header_size}, meta_size {meta_size}")
    meta, off, end = [], header_size, header_size + meta_size
    while off < end:
        tag, length = META.unpack(buf, off)
        if off + META.size + length > end:
            raise TraceError(f"metadata entry at {off} runs past the metadata")
        value = buf[off + META.size:off + META.size + length].decode(errors="replace")
        meta.append((tag, value))
        off += _pad8(META.size + length)
    header = Header(pid, ppid, realtime, mono, flags, max_block, window, tuple(meta), version)
    return header, end


def _read_block(buf: bytes, off: int, end: int) -> tuple[Block, int]:
    tag, flags, length, addr, want, err = BLOCK.unpack(buf, off)
    start = off + BLOCK.size
    if start + _pad8(length) > end:
        raise TraceError(f"block at {off} runs past its record")
    block = Block(tag, bool(flags & BF_OUT), addr, want, bytes(buf[start:start + length]),
                  bool(flags & BF_FAULT), bool(flags & BF_TRUNC), err)
    return block, start + _pad8(length)


def _read_records(buf: bytes, off: int) -> Iterator[Record | int]:
    """Records, then the size of an incomplete tail if there is one."""
    while off < len(buf):
        if len(buf) - off < RECORD.size:
            yield len(buf) - off
            return
        (size, kind, nblocks, seq, tid, start, end_ns, ret, err, fd,
         *args) = RECORD.unpack(buf, off)
        if size < RECORD.size or size % 8:
            raise TraceError(f"record at {off}: bad size {size}")
        if off + size > len(buf):
            yield len(buf) - off
            return
        blocks, b_off = [], off + RECORD.size
        for _ in range(nblocks):
            block, b_off = _read_block(buf, b_off, off + size)
            blocks.append(block)
        if b_off != off + size:
            raise TraceError(f"record at {off}: {off + size - b_off} bytes past its blocks")
        yield Record(kind, seq, tid, start, end_ns, ret, err, fd, tuple(args), tuple(blocks))
        off += size


def parse(buf: bytes, path: str = "<bytes>") -> Trace:
    header, off = _read_header(buf)
    trace = Trace(path, header)
    for item in _read_records(buf, off):
        if isinstance(item, int):
            trace.tail = item
        else:
            trace.records.append(item)
    return trace


def read_trace(path: str | Path) -> Trace:
    """Read one file (gzip-compressed when it ends in .gz); TraceError if malformed."""
    p = Path(path)
    data = p.read_bytes()
    if p.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise TraceError(f"{p}: bad gzip data: {exc}") from exc
    try:
        return parse(data, str(p))
    except TraceError as exc:
        raise TraceError(f"{p}: {exc}") from None


class TraceWriter:
    """Writes the format as libnvtrace.so does (synthetic traces)."""

    def __init__(self, out: BinaryIO, header: Header) -> None:
        self.out = out
        self._seq = 0
        meta = io.BytesIO()
        for tag, value in header.meta:
            raw = value.encode()
            entry = META.struct.pack(tag, len(raw)) + raw
            meta.write(entry.ljust(_pad8(len(entry)), b"\0"))
        out.write(HEADER.struct.pack(
            MAGIC, header.version, HEADER.size, meta.tell(), header.pid, header.ppid,
            header.realtime_ns, header.monotonic_ns, header.flags, header.max_block,
            header.window, 0))
        out.write(meta.getvalue())

    def write(self, kind: Kind, fd: int, *, ret: int = 0, err: int = 0,
              args: Iterable[int] = (), blocks: Iterable[Block] = (), tid: int = 1,
              start_ns: int | None = None, end_ns: int | None = None) -> int:
        """Append a record; returns its seq."""
        seq = self._seq
        self._seq += 1
        start = seq * 1000 if start_ns is None else start_ns
        a = [*args, 0, 0, 0, 0][:4]
        body = io.BytesIO()
        blocks = tuple(blocks)
        for b in blocks:
            flags = ((BF_OUT if b.out else 0) | (BF_FAULT if b.fault else 0)
                     | (BF_TRUNC if b.trunc else 0))
            body.write(BLOCK.struct.pack(b.tag, flags, len(b.data), b.addr, b.want, b.err))
            body.write(b.data.ljust(_pad8(len(b.data)), b"\0"))
        size = RECORD.size + body.tell()
        self.out.write(RECORD.struct.pack(
            size, kind, len(blocks), seq, tid, start, start + 500 if end_ns is None else end_ns,
            ret, err, fd, *a))
        self.out.write(body.getvalue())
        return seq
