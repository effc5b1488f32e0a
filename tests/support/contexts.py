"""What the quota policy does to the ledger as contexts open and close, and
tells its observers (vgpud.policy.events): for tests of the admin side (the
Manager and what observes it) without a policy in front of it."""

from __future__ import annotations

from vgpud.core.ledger import Ledger
from vgpud.core.observers import Observer
from vgpud.policy.events import ContextClosed, ContextOpened, QuotaEvent, UsageChanged


def open_context(told: Observer[QuotaEvent], ledger: Ledger, ctx: int, tenant: str) -> None:
    ledger.open(ctx, tenant)
    told.notify(ContextOpened(ctx, tenant))


def close_context(told: Observer[QuotaEvent], ledger: Ledger, ctx: int) -> None:
    tenant = ledger.tenant_of(ctx)
    ledger.close(ctx)
    told.notify(ContextClosed(ctx, tenant))


def usage_changed(told: Observer[QuotaEvent], tenant: str) -> None:
    told.notify(UsageChanged(tenant))
