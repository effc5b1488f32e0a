"""Immutable views of the daemon's state, as the file view shows them.

The event loop builds a Snapshot and publishes it with one reference
assignment; the FUSE thread only reads the latest reference, so a read never
waits for the loop and never sees half an update.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class GpuView:
    """``device``: nvidia/<pci-bus-id>, or nvidia/gpu<N> where the inventory
    has no bus id (nvsim)."""

    index: int
    name: str
    total: int
    device: str

    @property
    def region(self) -> str:
        """The dmem controller's region name."""
        return f"{self.device}/vidmem"


@dataclass(frozen=True, slots=True)
class ContextView:
    ctx: int
    pid: int | None  # None: not (yet) listed by the module
    tgid: int | None
    uid: int | None
    gpu: int | None  # the GPU node it opened; None for a control node
    bytes: int


@dataclass(frozen=True, slots=True)
class TenantView:
    """Per-GPU tuples follow Snapshot.gpus. ``limits``: bytes, None where the
    limit is the whole device (dmem's ``max``), 0 on a GPU it may not use."""

    name: str
    limits: tuple[int | None, ...]
    current: tuple[int, ...]
    peak: tuple[int, ...]
    weight: int
    cap: int | None
    priority: str
    share: Mapping[int, float] = field(default_factory=dict)
    measured: Mapping[int, float] = field(default_factory=dict)
    contexts: tuple[ContextView, ...] = ()


@dataclass(frozen=True, slots=True)
class Snapshot:
    gpus: tuple[GpuView, ...] = ()
    tenants: Mapping[str, TenantView] = field(default_factory=lambda: MappingProxyType({}))
    admin_group: str = ""  # daemon.admin_group: who may write, besides root
    admin_gid: int = 0  # group of the writable files (root's when the admin group is missing)

    @staticmethod
    def of(gpus: tuple[GpuView, ...], tenants: list[TenantView], admin_group: str = "",
           admin_gid: int = 0) -> Snapshot:
        return Snapshot(gpus, MappingProxyType({t.name: t for t in tenants}), admin_group,
                        admin_gid)

    @property
    def regions(self) -> frozenset[str]:
        return frozenset(gpu.region for gpu in self.gpus)


def device_name(index: int, bus_id: str | None = None) -> str:
    """nvidia/<bus id> (lower case, as the kernel writes PCI names), else nvidia/gpu<N>."""
    return f"nvidia/{bus_id.lower()}" if bus_id else f"nvidia/gpu{index}"
