"""Device memory a traced process holds, by the driver's own answers.

Independent of vgpud's ledger on purpose: it follows the driver's semantics
(handles per client, a free takes the subtree, a dup shares the memory, a
closed control file frees its clients) with the sizes the driver wrote back,
so the replay can compare the ledger with it after every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tools.nvtrace.calls import Ioctl, NodeKind
from vgpud.nvidia.escapes import DEVICE_MEMORY_CLASSES, NVOS32_ALLOC_FLAGS_VIRTUAL, NvClass
from vgpud.nvidia.escapes import VidHeapFunction as Fn
from vgpud.nvidia.layouts import (
    DecodeError,
    MemoryAllocParams,
    RmAlloc,
    RmAllocMemory,
    RmDupObject,
    RmFree,
    VidHeapControl,
    decode_call,
)
from vgpud.nvidia.pages import page_round

__all__ = ["HeldMemory"]

# NV01_ROOT, NV01_ROOT_NON_PRIV and NV01_ROOT_CLIENT all make a client.
ROOT_CLASSES = frozenset({0x0, 0x1, NvClass.ROOT_CLIENT})

Key = tuple[int, int]  # (client, handle); a client is (h, h)


@dataclass(slots=True)
class _Obj:
    parent: Key | None
    alloc: int | None  # id of the memory it names
    children: set[Key] = field(default_factory=set)


class HeldMemory:
    """Objects and memory of one process's trace; ``held()`` in bytes."""

    def __init__(self) -> None:
        self._objs: dict[Key, _Obj] = {}
        self._allocs: dict[int, list[int]] = {}  # id -> [bytes, handles naming it]
        self._clients: dict[int, set[int]] = {}  # ctx -> clients made through it
        self._next = 0

    def held(self) -> int:
        return sum(size for size, _refs in self._allocs.values())

    def apply(self, call: Ioctl, ctx: int) -> None:
        """A call the driver completed (its results as written back)."""
        if (not call.ok or not call.nvidia or call.params_out is None
                or call.node.kind not in (NodeKind.CTL, NodeKind.GPU)):
            return
        data = call.data_out.data if call.data_out and call.data_out.whole else None
        try:
            c = decode_call(call.nr, call.params_out, data)
        except DecodeError:
            return  # reported by the decode check
        if isinstance(c, RmAlloc):
            self._rm_alloc(c, ctx)
        elif isinstance(c, RmAllocMemory) and c.h_class in DEVICE_MEMORY_CLASSES:
            self._add((c.h_root, c.h_new), (c.h_root, c.h_parent), page_round(c.limit + 1))
        elif isinstance(c, VidHeapControl):
            self._vid_heap(c)
        elif isinstance(c, RmFree):
            self._free((c.h_root, c.h_object))
        elif isinstance(c, RmDupObject):
            self._dup(c)

    def close(self, ctx: int) -> None:
        """The control file ``ctx`` closed: its clients are freed."""
        for client in self._clients.pop(ctx, set()):
            self._free((client, client))

    def _rm_alloc(self, c: RmAlloc, ctx: int) -> None:
        if c.h_class in ROOT_CLASSES:
            self._add((c.h_new, c.h_new), None, None)
            self._clients.setdefault(ctx, set()).add(c.h_new)
            return
        size = None
        if c.h_class in DEVICE_MEMORY_CLASSES and isinstance(c.alloc, MemoryAllocParams):
            size = page_round(c.alloc.size)
        self._add((c.h_root, c.h_new), (c.h_root, c.h_parent), size)

    def _vid_heap(self, c: VidHeapControl) -> None:
        if c.function == Fn.FREE:
            self._free((c.h_root, c.h_memory))
        elif (c.function == Fn.ALLOC_SIZE and c.alloc is not None
              and not c.alloc.flags & NVOS32_ALLOC_FLAGS_VIRTUAL):
            self._add((c.h_root, c.alloc.h_memory), (c.h_root, c.h_parent),
                      page_round(c.alloc.size))

    def _dup(self, c: RmDupObject) -> None:
        src = self._objs.get((c.h_client_src, c.h_object_src))
        key = (c.h_client, c.h_object)
        if src is None or key in self._objs:
            return
        self._link(key, (c.h_client, c.h_parent), src.alloc)
        if src.alloc is not None:
            self._allocs[src.alloc][1] += 1

    def _add(self, key: Key, parent: Key | None, size: int | None) -> None:
        if key in self._objs:
            return  # the driver refuses a duplicate handle; it did not here
        alloc = None
        if size is not None:
            alloc = self._next
            self._next += 1
            self._allocs[alloc] = [size, 1]
        self._link(key, parent, alloc)

    def _link(self, key: Key, parent: Key | None, alloc: int | None) -> None:
        if parent not in self._objs:
            parent = None
        self._objs[key] = _Obj(parent, alloc)
        if parent is not None:
            self._objs[parent].children.add(key)

    def _free(self, key: Key) -> None:
        obj = self._objs.pop(key, None)
        if obj is None:
            return
        if obj.parent is not None and obj.parent in self._objs:
            self._objs[obj.parent].children.discard(key)
        for child in list(obj.children):
            self._free(child)
        if obj.alloc is not None:
            entry = self._allocs[obj.alloc]
            entry[1] -= 1
            if entry[1] == 0:
                del self._allocs[obj.alloc]
