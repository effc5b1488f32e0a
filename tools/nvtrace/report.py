"""What a replay check found: findings, the inventory of calls, and their text form."""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum

from tools.nvtrace.calls import Ioctl, NodeKind
from tools.nvtrace.nvsim_src import NvsimModel
from vgpud.nvidia.escapes import Ctrl, Escape, NvClass, UvmCmd

__all__ = ["Finding", "Row", "inventory_keys", "row_name"]

_U32 = struct.Struct("=I")
# Where the class (RM_ALLOC, RM_ALLOC_MEMORY) and the command (RM_CONTROL) lie.
_CLASS_OFF, _CMD_OFF = 12, 8


@dataclass(frozen=True, slots=True)
class Finding:
    """Something the check fails on: where (trace, seq; -1 for the whole trace) and what."""

    trace: str
    seq: int
    what: str

    def __str__(self) -> str:
        where = self.trace if self.seq < 0 else f"{self.trace}#{self.seq}"
        return f"{where}: {self.what}"


@dataclass(slots=True)
class Row:
    """One escape, class, control or command of the inventory."""

    kind: str  # escape | class | memclass | control | uvm | request | node:NAME
    key: int
    calls: int = 0
    failed: int = 0  # errno, or a status other than NV_OK
    statuses: Counter[int] = field(default_factory=Counter)
    decoded: bool = False  # vgpud.nvidia decoded it
    up: int = 0  # calls the quota policy's filter sends up


def inventory_keys(ev: Ioctl, params: bytes | None) -> list[tuple[str, int]]:
    """The rows a call counts in: its escape, and its class or control."""
    if ev.node.kind is NodeKind.OTHER:
        return [(f"node:{ev.node.name}", ev.request)]
    if ev.node.kind is NodeKind.UVM:
        return [("uvm", ev.nr)]
    if not ev.nvidia:
        return [("request", ev.request)]
    keys = [("escape", ev.nr)]
    if params is not None and len(params) >= 16:
        if ev.nr == Escape.RM_ALLOC:
            keys.append(("class", _U32.unpack_from(params, _CLASS_OFF)[0]))
        elif ev.nr == Escape.RM_ALLOC_MEMORY:
            keys.append(("memclass", _U32.unpack_from(params, _CLASS_OFF)[0]))
        elif ev.nr == Escape.RM_CONTROL:
            keys.append(("control", _U32.unpack_from(params, _CMD_OFF)[0]))
    return keys


def _enum_name(enum: type[IntEnum], value: int) -> str:
    try:
        return enum(value).name
    except ValueError:
        return "?"


def row_name(kind: str, key: int) -> str:
    if kind == "escape":
        return _enum_name(Escape, key)
    if kind in ("class", "memclass"):
        return _enum_name(NvClass, key)
    if kind == "control":
        return _enum_name(Ctrl, key)
    if kind == "uvm":
        return _enum_name(UvmCmd, key)
    return "?"


def known_to_vgpud(row: Row) -> bool:
    """vgpud decodes the escape, or names the class, control or command."""
    if row.kind == "escape":
        return row.decoded
    return row_name(row.kind, row.key) != "?"


def known_to_nvsim(row: Row, nvsim: NvsimModel) -> bool:
    sets = {"escape": nvsim.escapes, "class": nvsim.alloc_classes,
            "memclass": nvsim.alloc_memory_classes, "control": nvsim.controls,
            "uvm": nvsim.uvm}
    return row.key in sets.get(row.kind, frozenset())


def format_rows(rows: list[Row], nvsim: NvsimModel | None) -> list[str]:
    """The inventory as a table: each row's calls, failures, statuses and marks."""
    lines = [f"  {'kind':<10} {'number':>10}  {'name':<28} {'calls':>6} {'failed':>6} "
             f"{'up':>5}  vgpud nvsim  statuses"]
    for row in sorted(rows, key=lambda r: (r.kind, r.key)):
        mark = "yes" if known_to_vgpud(row) else "NO"
        sim = "?" if nvsim is None else "yes" if known_to_nvsim(row, nvsim) else "NO"
        statuses = " ".join(f"{s:#x}x{n}" for s, n in sorted(row.statuses.items()))
        lines.append(f"  {row.kind:<10} {row.key:>#10x}  {row_name(row.kind, row.key):<28} "
                     f"{row.calls:>6} {row.failed:>6} {row.up:>5}  {mark:<5} {sim:<5}  "
                     f"{statuses}".rstrip())
    return lines
