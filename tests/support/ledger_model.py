"""A slow, obvious model of the memory ledger and a hypothesis state machine that
drives the ledger and the model with the same random operations.

tests/unit/test_ledger.py runs the machine; tests/unit/test_journal.py runs a
subclass that also journals every change and replays it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vgpud.core.ledger import (
    Denied,
    DuplicateKey,
    Freed,
    Key,
    Ledger,
    Reservation,
    UnknownContext,
    UnknownTenant,
)

TENANTS = ("t0", "t1", "t2")
ACCOUNTS = [(t, g) for t in TENANTS for g in (0, 1) if (t, g) != ("t2", 1)]  # t2: GPU 0 only
sizes = st.integers(0, 64)
limits = st.integers(0, 256)


@dataclass
class ModelCharge:
    tenant: str
    gpu: int
    size: int


@dataclass
class ModelNode:
    ctx: int
    parent: Key | None
    charge: ModelCharge | None


@dataclass
class ModelReservation:
    reservation: Reservation
    key: Key
    parent: Key | None


@dataclass
class Model:
    limits: dict[tuple[str, int], int] = field(default_factory=dict)
    contexts: dict[int, str] = field(default_factory=dict)
    nodes: dict[Key, ModelNode] = field(default_factory=dict)
    pending: list[ModelReservation] = field(default_factory=list)

    def charged(self, account: tuple[str, int]) -> int:
        charges = {id(n.charge): n.charge for n in self.nodes.values() if n.charge}
        return sum(c.size for c in charges.values() if (c.tenant, c.gpu) == account)

    def reserved(self, account: tuple[str, int]) -> int:
        return sum(
            p.reservation.size
            for p in self.pending
            if (p.reservation.tenant, p.reservation.gpu) == account
        )

    def subtree(self, root: Key) -> set[Key]:
        out = {root}
        grew = True
        while grew:
            below = {k for k, n in self.nodes.items() if n.parent in out}
            grew = not below <= out
            out |= below
        return out


class LedgerMachine(RuleBasedStateMachine):
    """Random interleavings of every operation against a slow, obvious model."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger()
        self.model = Model()
        self.next_ctx = 1
        self.next_handle = 1
        for account in ACCOUNTS:
            self.ledger.set_limit(*account, 128)
            self.model.limits[account] = 128

    def fresh(self) -> int:
        self.next_handle += 1
        return self.next_handle

    def ctx_nodes(self, ctx: int) -> list[Key]:
        return sorted(k for k, n in self.model.nodes.items() if n.ctx == ctx)

    def child_key(self, data: st.DataObject, ctx: int) -> tuple[Key | None, Key]:
        """A parent in `ctx` (or none: a root client) and a fresh key under it."""
        parent = data.draw(st.sampled_from([None, *self.ctx_nodes(ctx)]))
        if parent is None:
            client = self.fresh()
            return None, Key(client, client)
        return parent, Key(parent.client, self.fresh())

    def expect_unchanged(self, error: type[Exception], call: object) -> None:
        before = (self.ledger.snapshot(), set(self.model.nodes))
        with pytest.raises(error):
            call()  # type: ignore[operator]
        assert self.ledger.snapshot() == before[0]
        assert all(k in self.ledger for k in before[1])

    @rule(tenant=st.sampled_from(TENANTS))
    def open(self, tenant: str) -> None:
        self.ledger.open(self.next_ctx, tenant)
        self.model.contexts[self.next_ctx] = tenant
        self.next_ctx += 1

    @precondition(lambda self: self.model.contexts)
    @rule(data=st.data())
    def track(self, data: st.DataObject) -> None:
        ctx = data.draw(st.sampled_from(sorted(self.model.contexts)))
        parent, key = self.child_key(data, ctx)
        self.ledger.track(ctx, key, parent)
        self.model.nodes[key] = ModelNode(ctx, parent, None)

    @precondition(lambda self: self.model.contexts)
    @rule(data=st.data(), gpu=st.sampled_from((0, 1)))
    def reserve(self, data: st.DataObject, gpu: int) -> None:
        ctx = data.draw(st.sampled_from(sorted(self.model.contexts)))
        tenant = self.model.contexts[ctx]
        parent, key = self.child_key(data, ctx)
        if (tenant, gpu) not in self.model.limits:
            self.expect_unchanged(UnknownTenant, lambda: self.ledger.reserve(ctx, gpu, 1))
            return
        account = (tenant, gpu)
        used = self.model.charged(account) + self.model.reserved(account)
        limit = self.model.limits[account]
        room = max(0, limit - used)  # sizes at the boundary are drawn often
        size = data.draw(st.one_of(sizes, st.sampled_from([room, room + 1])))
        decision = self.ledger.reserve(ctx, gpu, size, parent, key)
        if used + size > limit:
            assert decision == Denied(tenant, gpu, size, used, limit)
        else:
            assert isinstance(decision, Reservation)
            assert (decision.tenant, decision.gpu, decision.size) == (tenant, gpu, size)
            self.model.pending.append(ModelReservation(decision, key, parent))
            # admission never passes the limit in force when it is decided
            assert self.ledger.usage(tenant, gpu).used <= limit

    @precondition(lambda self: self.model.pending)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        p = data.draw(st.sampled_from(self.model.pending))
        self.ledger.commit(p.reservation)
        self.model.pending.remove(p)
        r = p.reservation
        parent = p.parent if p.parent in self.model.nodes else None
        self.model.nodes[p.key] = ModelNode(r.ctx, parent, ModelCharge(r.tenant, r.gpu, r.size))

    @precondition(lambda self: self.model.pending)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        p = data.draw(st.sampled_from(self.model.pending))
        self.ledger.release(p.reservation)
        self.model.pending.remove(p)

    @precondition(lambda self: self.model.nodes)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model.nodes)))
        self.check_freed(self.ledger.free(key), self.model.subtree(key))

    @precondition(lambda self: self.model.contexts)
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        ctx = data.draw(st.sampled_from(sorted(self.model.contexts)))
        gone = set().union(*(self.model.subtree(k) for k in self.ctx_nodes(ctx)))
        cancelled = {p.reservation.id for p in self.model.pending if p.reservation.ctx == ctx}
        freed = self.ledger.close(ctx)
        assert set(freed.reservations) == cancelled
        self.model.pending = [p for p in self.model.pending if p.reservation.ctx != ctx]
        self.check_freed(freed, gone)
        del self.model.contexts[ctx]
        self.expect_unchanged(UnknownContext, lambda: self.ledger.close(ctx))

    def check_freed(self, freed: Freed, gone: set[Key]) -> None:
        assert set(freed.keys) == gone
        before = {a: self.model.charged(a) for a in self.model.limits}
        for key in gone:
            del self.model.nodes[key]
        for account in self.model.limits:
            released = sum(r.size for r in freed.released if (r.tenant, r.gpu) == account)
            assert released == before[account] - self.model.charged(account)

    @precondition(lambda self: self.model.nodes and self.model.contexts)
    @rule(data=st.data())
    def dup(self, data: st.DataObject) -> None:
        existing = data.draw(st.sampled_from(sorted(self.model.nodes)))
        ctx = data.draw(st.sampled_from(sorted(self.model.contexts)))
        parent, key = self.child_key(data, ctx)
        self.ledger.dup(ctx, key, existing, parent)
        self.model.nodes[key] = ModelNode(ctx, parent, self.model.nodes[existing].charge)

    @precondition(lambda self: self.model.nodes)
    @rule(data=st.data())
    def duplicate_key_is_refused(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model.nodes)))
        ctx = self.model.nodes[key].ctx
        if ctx in self.model.contexts:
            self.expect_unchanged(DuplicateKey, lambda: self.ledger.track(ctx, key))

    @rule(account=st.sampled_from(ACCOUNTS), limit=limits)
    def set_limit(self, account: tuple[str, int], limit: int) -> None:
        self.ledger.set_limit(*account, limit)
        self.model.limits[account] = limit

    @invariant()
    def usage_matches_model(self) -> None:
        for (tenant, gpu), limit in self.model.limits.items():
            usage = self.ledger.usage(tenant, gpu)
            assert usage.charged >= 0
            assert usage.reserved >= 0
            assert usage.charged == self.model.charged((tenant, gpu))
            assert usage.reserved == self.model.reserved((tenant, gpu))
            assert usage.limit == limit
            assert usage.free == max(0, limit - usage.used)
        for key in self.model.nodes:
            assert key in self.ledger

    def teardown(self) -> None:
        for ctx in list(self.model.contexts):
            self.ledger.close(ctx)
        for tenant, gpu in self.model.limits:
            assert self.ledger.usage(tenant, gpu).used == 0
        for tenant in TENANTS:
            self.ledger.remove_tenant(tenant)
        assert self.ledger.snapshot() == ()
