"""What the quota policy publishes as it decides, on its ``observers`` topic.

The policy owns the ledger's contexts and charges; the admin side (the
Manager, the D-Bus service, the metrics' refusal counts) hears of them here,
subscribed in vgpud.app, and is never called from the decision path.
"""

from __future__ import annotations

from dataclasses import dataclass

from vgpud.core.ledger import Denied

__all__ = ["ContextClosed", "ContextOpened", "QuotaEvent", "QuotaExceeded", "UsageChanged"]


@dataclass(frozen=True, slots=True)
class ContextOpened:
    """A node was opened by a process resolved to ``tenant`` (in the ledger now)."""

    ctx: int
    tenant: str


@dataclass(frozen=True, slots=True)
class ContextClosed:
    """The file was closed: the context and its memory left the ledger."""

    ctx: int
    tenant: str


@dataclass(frozen=True, slots=True)
class UsageChanged:
    """A reservation, charge, release or free moved the tenant's bytes."""

    tenant: str


@dataclass(frozen=True, slots=True)
class QuotaExceeded:
    """An allocation was refused over quota (Ledger.reserve or commit answered so)."""

    denied: Denied


QuotaEvent = ContextOpened | ContextClosed | UsageChanged | QuotaExceeded
