"""What an allowed call waits for: one record per upcall id, completed by
its POST upcall or POST event (vgpud.policy.quota's completion tables)."""

from __future__ import annotations

from dataclasses import dataclass

from vgpud.core.ledger import Key, Reservation

__all__ = ["Charge", "Counted", "Dup", "FbView", "Free", "HeapInfo", "Pending", "Track"]


@dataclass(slots=True)
class Charge:
    """A reserved allocation: commit to the new handle, or release.

    ``handle`` is the one decided on from the checked IOCTL upcall, or the one
    the daemon named (0: the driver generates it, only without the truth
    check); ``parent``, ``classes`` and ``status_off`` are what
    the driver's truth is checked against and where a refusal is written."""

    ctx: int
    reservation: Reservation
    client: int
    handle: int = 0
    parent: int = 0
    classes: frozenset[int] = frozenset()
    status_off: int = 0


@dataclass(slots=True)
class Track:
    """A client / device / subdevice alloc: track its handle in the tree."""

    ctx: int
    h_class: int
    client: int
    parent: int
    gpu: int | None  # a device's GPU (deviceId)


@dataclass(slots=True)
class Free:
    ctx: int
    key: Key


@dataclass(slots=True)
class Dup:
    ctx: int
    client: int
    parent: int
    source: Key


@dataclass(slots=True)
class FbView:
    """FB_GET_INFO(_V2): rewrite the sizes the driver reports."""

    ctx: int
    tenant: str
    gpu: int


@dataclass(slots=True)
class HeapInfo:
    """VID_HEAP_CONTROL INFO: rewrite total and free."""

    ctx: int
    tenant: str
    gpu: int


@dataclass(slots=True)
class Counted:
    """An object under a tenant object limit (ObjectLimits): counted once the
    driver made it. Also what a counted object is once made."""

    ctx: int
    tenant: str
    kind: str
    client: int
    parent: int
    handle: int = 0  # decided on or named (0: the driver's, only without the truth check)


Pending = Charge | Track | Free | Dup | FbView | HeapInfo | Counted
