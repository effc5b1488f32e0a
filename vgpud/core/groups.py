"""The live channel groups (TSGs) of every context (pure).

A group is named by its client and handle (RM handles are unique within a
client, clients are unique in the driver). Its parent is a device (NV01_DEVICE_0:
the driver allows no other parent for KEPLER_CHANNEL_GROUP_A), so a group goes
away with its own free, its device's, its client's, or its context's close.

A group its owner turned off (GPFIFO_SCHEDULE off) is paused: it stays known,
but is not the scheduler's to turn on until its owner turns it on again.
The tracker tells its observers each group it learns (GroupLearned), forgets
(GroupForgotten) or whose owner pauses or resumes it (GroupPauseChanged).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from vgpud.core.observers import Topic

__all__ = [
    "Group",
    "GroupEvent",
    "GroupForgotten",
    "GroupLearned",
    "GroupPauseChanged",
    "GroupTracker",
    "group_id",
]


def group_id(client: int, handle: int) -> int:
    """The scheduler core's integer id of a group: client and handle, 32 bits each."""
    return client << 32 | handle


@dataclass(frozen=True, slots=True)
class Group:
    ctx: int  # the nvidiactl context whose client owns it (where GPFIFO_SCHEDULE goes)
    tenant: str
    gpu: int
    client: int
    handle: int
    parent: int  # its device
    tgid: int  # the process that opened the context

    @property
    def id(self) -> int:
        return group_id(self.client, self.handle)


@dataclass(frozen=True, slots=True)
class GroupLearned:
    group: Group


@dataclass(frozen=True, slots=True)
class GroupForgotten:
    """Freed, or its context closed."""

    group: Group


@dataclass(frozen=True, slots=True)
class GroupPauseChanged:
    """Its owner turned it off (paused) or on again (not paused)."""

    group: Group
    paused: bool


GroupEvent = GroupLearned | GroupForgotten | GroupPauseChanged


class GroupTracker:
    def __init__(self) -> None:
        self._groups: dict[int, Group] = {}  # by group_id
        self._view = MappingProxyType(self._groups)
        self._by_client: dict[int, set[int]] = {}  # client -> group ids
        self._paused: set[int] = set()  # group ids
        self.observers: Topic[GroupEvent] = Topic()

    def __len__(self) -> int:
        return len(self._groups)

    def __iter__(self) -> Iterator[Group]:
        return iter(tuple(self._groups.values()))

    @property
    def by_id(self) -> Mapping[int, Group]:
        """The live groups by group_id (a read-only view)."""
        return self._view

    def get(self, client: int, handle: int) -> Group | None:
        return self._groups.get(group_id(client, handle))

    def has_client(self, client: int) -> bool:
        return client in self._by_client

    def add(self, group: Group) -> None:
        """A new group; a handle still known (a missed free) is replaced."""
        old = self._groups.get(group.id)
        if old is not None:
            self._drop(old)
        self._groups[group.id] = group
        self._by_client.setdefault(group.client, set()).add(group.id)
        self.observers.notify(GroupLearned(group))

    def paused(self, group: Group) -> bool:
        return group.id in self._paused

    def set_paused(self, group: Group, paused: bool) -> None:
        """The owner turned a known group off (paused) or on; a repeat is no change."""
        if group.id not in self._groups or paused == (group.id in self._paused):
            return
        if paused:
            self._paused.add(group.id)
        else:
            self._paused.discard(group.id)
        self.observers.notify(GroupPauseChanged(group, paused))

    def freed(self, client: int, handle: int) -> list[Group]:
        """RM_FREE of (client, handle) succeeded: the groups it took with it."""
        ids = self._by_client.get(client, ())
        gone = [g for i in ids if (g := self._groups[i]).handle == handle
                or g.parent == handle or handle == client]
        for group in gone:
            self._drop(group)
        return gone

    def closed(self, ctx: int) -> list[Group]:
        """The context was closed: the driver freed its clients and their groups."""
        gone = [g for g in self._groups.values() if g.ctx == ctx]
        for group in gone:
            self._drop(group)
        return gone

    def _drop(self, group: Group) -> None:
        del self._groups[group.id]
        self._paused.discard(group.id)
        ids = self._by_client[group.client]
        ids.discard(group.id)
        if not ids:
            del self._by_client[group.client]
        self.observers.notify(GroupForgotten(group))
