"""The objects held under tenants' object limits (ObjectLimits), by kind.

Pure bookkeeping for the quota policy: an object is counted once the driver
made it and uncounted when it goes (freed itself, with its parent, its
client or its file)."""

from __future__ import annotations

from collections.abc import Iterable

from vgpud.core.ledger import Key
from vgpud.policy.pending import Counted

__all__ = ["ObjectCounts"]


class ObjectCounts:
    """Counted objects by key, and how many each tenant holds of each kind."""

    def __init__(self) -> None:
        self._objects: dict[Key, Counted] = {}
        self._held: dict[tuple[str, str], int] = {}

    def held(self, tenant: str, kind: str) -> int:
        """How many objects of ``kind`` ``tenant`` holds."""
        return self._held.get((tenant, kind), 0)

    def get(self, key: Key) -> Counted | None:
        return self._objects.get(key)

    def of_context(self, ctx: int) -> list[Key]:
        return [k for k, o in self._objects.items() if o.ctx == ctx]

    def add(self, key: Key, obj: Counted) -> None:
        """``obj`` exists under ``key`` (replacing what was counted there)."""
        self.discard((key,))
        self._objects[key] = obj
        slot = (obj.tenant, obj.kind)
        self._held[slot] = self._held.get(slot, 0) + 1

    def discard(self, keys: Iterable[Key]) -> None:
        """The objects under ``keys`` are gone (keys never counted are ignored)."""
        for key in keys:
            obj = self._objects.pop(key, None)
            if obj is None:
                continue
            slot = (obj.tenant, obj.kind)
            left = self._held[slot] - 1
            if left:
                self._held[slot] = left
            else:
                del self._held[slot]
