"""The GPU memory ledger: per (tenant, GPU) limits and the bytes charged to them.

Pure (sans-I/O): the daemon feeds it what the kernel module reports and acts on
the decisions it returns. The upcall protocol maps onto it like this:

    open of a node            open(ctx, tenant)
    pre-call of a memory alloc reserve(...) -> Reservation | Denied (answer NV_ERR_NO_MEMORY)
    POST, status 0            commit(reservation, key)
    POST, failure             release(reservation)
    POST of another alloc     track(ctx, key, parent)   (clients, devices: the object tree)
    RM_DUP_OBJECT             dup(ctx, new_key, existing_key, parent)
    RM_FREE                   free(key)                 (frees the whole subtree)
    fd closed                 close(ctx)                (objects and reservations)

Objects are named by Key(client, handle): RM object handles are unique within
their client, client handles are unique in the driver, so keys of different
clients never collide (a root client is Key(h, h)). The ledger charges what it
is told; which classes hold device memory is the policy's business.

Reservations make admission atomic: a reservation counts against the limit
from the pre-call until its POST, so two concurrent allocations cannot both
pass on the same free bytes.

Durable changes (contexts, objects, charges; not limits, which come from the
config, nor reservations, which live for one call) are told to ``observers``
as Change values: the daemon's journal (vgpud.store.journal) appends them,
and ``apply`` replays them into a new ledger after a restart. ``changes()``
lists the changes that rebuild the current state, for compacting that
journal.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from vgpud.core.observers import Topic


class Key(NamedTuple):
    """An RM object: its client handle and its own handle."""

    client: int
    handle: int


# --- decisions -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reservation:
    """Admission granted: `size` bytes held for `tenant` on `gpu` until commit/release."""

    id: int
    ctx: int
    tenant: str
    gpu: int
    size: int


@dataclass(frozen=True, slots=True)
class Denied:
    """Admission refused: `used` + `size` would exceed `limit`."""

    tenant: str
    gpu: int
    size: int
    used: int
    limit: int


@dataclass(frozen=True, slots=True)
class Release:
    """Bytes returned to a tenant on a GPU."""

    tenant: str
    gpu: int
    size: int


@dataclass(frozen=True, slots=True)
class Freed:
    """What a free or close removed: object keys, charges dropped, reservations cancelled."""

    keys: tuple[Key, ...]
    released: tuple[Release, ...]
    reservations: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    """A tenant's account on one GPU."""

    tenant: str
    gpu: int
    limit: int
    charged: int
    reserved: int

    @property
    def used(self) -> int:
        return self.charged + self.reserved

    @property
    def free(self) -> int:
        return max(0, self.limit - self.used)


# --- durable changes ---------------------------------------------------------


class Opened(NamedTuple):
    ctx: int
    tenant: str


class Tracked(NamedTuple):
    """An uncharged object; ``gpu``: the GPU a device or subdevice names."""

    ctx: int
    key: Key
    parent: Key | None
    gpu: int | None


class Charged(NamedTuple):
    """A committed allocation: ``size`` bytes charged to ``tenant`` on ``gpu``."""

    ctx: int
    key: Key
    parent: Key | None
    tenant: str
    gpu: int
    size: int


class Duped(NamedTuple):
    """A second handle to ``source``'s object (one more reference to its charge)."""

    ctx: int
    key: Key
    source: Key
    parent: Key | None


class Removed(NamedTuple):
    """RM_FREE: the object and its subtree are gone."""

    key: Key


class Closed(NamedTuple):
    ctx: int


Change = Opened | Tracked | Charged | Duped | Removed | Closed


# --- errors ------------------------------------------------------------------


class LedgerError(Exception):
    """A call the ledger cannot apply; the ledger is left unchanged."""


class UnknownTenant(LedgerError):
    """No account for this tenant (on this GPU)."""


class UnknownContext(LedgerError):
    pass


class UnknownKey(LedgerError):
    pass


class UnknownReservation(LedgerError):
    pass


class DuplicateKey(LedgerError):
    pass


class DuplicateContext(LedgerError):
    pass


class TenantInUse(LedgerError):
    """The tenant still has contexts, charges or reservations."""


# --- internal state --------------------------------------------------------


@dataclass(slots=True)
class _Account:
    limit: int
    charged: int = 0
    reserved: int = 0


@dataclass(slots=True)
class _Charge:
    """Device memory; shared by every handle that dup() made to it."""

    tenant: str
    gpu: int
    size: int
    refs: int = 1


@dataclass(slots=True)
class _Node:
    ctx: int
    parent: Key | None
    charge: _Charge | None
    gpu: int | None
    children: set[Key] = field(default_factory=set)


@dataclass(slots=True)
class _Context:
    tenant: str
    keys: set[Key] = field(default_factory=set)
    reservations: dict[int, _Pending] = field(default_factory=dict)


@dataclass(slots=True)
class _Pending:
    reservation: Reservation
    key: Key | None
    parent: Key | None


class Ledger:
    """Per (tenant, GPU) accounts, open contexts, live objects and reservations."""

    def __init__(self) -> None:
        self.observers: Topic[Change] = Topic()  # hear each durable change
        self._accounts: dict[tuple[str, int], _Account] = {}
        self._tenant_accounts: dict[str, int] = {}  # tenant -> number of accounts
        self._contexts: dict[int, _Context] = {}
        self._nodes: dict[Key, _Node] = {}
        self._pending: dict[int, _Pending] = {}
        self._next_id = 1

    # --- accounts ---

    def set_limit(self, tenant: str, gpu: int, limit: int) -> None:
        """Create or change an account. Lowering below usage frees nothing:
        it only refuses new reservations until usage drops."""
        if limit < 0:
            raise ValueError(f"negative limit {limit}")
        account = self._accounts.get((tenant, gpu))
        if account is None:
            self._accounts[tenant, gpu] = _Account(limit)
            self._tenant_accounts[tenant] = self._tenant_accounts.get(tenant, 0) + 1
        else:
            account.limit = limit

    def remove_tenant(self, tenant: str) -> None:
        """Drop all accounts of an idle tenant (no contexts, charges, reservations)."""
        if tenant not in self._tenant_accounts:
            raise UnknownTenant(tenant)
        if any(c.tenant == tenant for c in self._contexts.values()) or any(
            a.charged or a.reserved for (t, _), a in self._accounts.items() if t == tenant
        ):
            raise TenantInUse(tenant)
        for key in [k for k in self._accounts if k[0] == tenant]:
            del self._accounts[key]
        del self._tenant_accounts[tenant]

    def usage(self, tenant: str, gpu: int) -> Usage:
        account = self._account(tenant, gpu)
        return Usage(tenant, gpu, account.limit, account.charged, account.reserved)

    def snapshot(self) -> tuple[Usage, ...]:
        """Every account, ordered by (tenant, gpu)."""
        return tuple(
            Usage(t, g, a.limit, a.charged, a.reserved)
            for (t, g), a in sorted(self._accounts.items())
        )

    # --- contexts ---

    def open(self, ctx: int, tenant: str) -> None:
        """A node was opened by a process of `tenant`; `ctx` names that open file."""
        if tenant not in self._tenant_accounts:
            raise UnknownTenant(tenant)
        if ctx in self._contexts:
            raise DuplicateContext(ctx)
        self._contexts[ctx] = _Context(tenant)
        if self.observers:
            self.observers.notify(Opened(ctx, tenant))

    def close(self, ctx: int) -> Freed:
        """The file was closed: cancel its reservations and free all its objects."""
        context = self._context(ctx)
        cancelled = tuple(context.reservations)
        for pending in list(context.reservations.values()):
            self._unreserve(pending)
        keys: list[Key] = []
        released: list[Release] = []
        for key in list(context.keys):
            if key in self._nodes:
                self._free_subtree(key, keys, released)
        del self._contexts[ctx]
        if self.observers:
            self.observers.notify(Closed(ctx))
        return Freed(tuple(keys), tuple(released), cancelled)

    def tenant_of(self, ctx: int) -> str:
        return self._context(ctx).tenant

    def contexts(self) -> dict[int, str]:
        """Open contexts and their tenants."""
        return {ctx: context.tenant for ctx, context in self._contexts.items()}

    # --- admission ---

    def reserve(
        self, ctx: int, gpu: int, size: int, parent: Key | None = None, key: Key | None = None
    ) -> Reservation | Denied:
        """Admit `size` bytes on `gpu` for the context's tenant, or deny.

        `key` (the handle requested, if the caller chose one) and `parent` are
        kept for commit. Denied when charged + reserved + size > limit.
        """
        context = self._context(ctx)
        account = self._account(context.tenant, gpu)
        if size < 0:
            raise ValueError(f"negative allocation size {size}")
        if parent is not None and parent not in self._nodes:
            raise UnknownKey(parent)
        used = account.charged + account.reserved
        if used + size > account.limit:
            return Denied(context.tenant, gpu, size, used, account.limit)
        account.reserved += size
        reservation = Reservation(self._next_id, ctx, context.tenant, gpu, size)
        self._next_id += 1
        pending = _Pending(reservation, key, parent)
        self._pending[reservation.id] = pending
        context.reservations[reservation.id] = pending
        return reservation

    def commit(self, reservation: Reservation, key: Key | None = None, size: int | None = None,
               *, force: bool = False) -> Denied | None:
        """The allocation succeeded: the object `key` (default: the key given at
        reserve) now holds the bytes. If its parent was freed meanwhile, the
        object hangs on its context alone until freed or closed.

        `size`: what the object really holds (the driver's truth), charged
        instead of the reserved size. When it is larger and the account then
        exceeds its limit, nothing changes and Denied is returned (the caller
        undoes the allocation, then releases), unless `force` (the allocation
        could not be undone: the truth is charged, over the limit)."""
        pending = self._pending_for(reservation)
        key = key if key is not None else pending.key
        if key is None:
            raise UnknownKey("commit needs the new object's key")
        if key in self._nodes:
            raise DuplicateKey(key)
        r = pending.reservation
        charge = r.size if size is None else size
        if charge < 0:
            raise ValueError(f"negative allocation size {charge}")
        account = self._account(r.tenant, r.gpu)
        used = account.charged + account.reserved - r.size
        if charge > r.size and used + charge > account.limit and not force:
            return Denied(r.tenant, r.gpu, charge, used, account.limit)
        self._unreserve(pending)
        account.charged += charge
        parent = pending.parent if pending.parent in self._nodes else None
        self._insert(r.ctx, key, parent, _Charge(r.tenant, r.gpu, charge), None)
        if self.observers:
            self.observers.notify(Charged(r.ctx, key, parent, r.tenant, r.gpu, charge))
        return None

    def release(self, reservation: Reservation) -> None:
        """The allocation failed: return the reserved bytes."""
        self._unreserve(self._pending_for(reservation))

    # --- the object tree ---

    def track(self, ctx: int, key: Key, parent: Key | None = None,
              gpu: int | None = None) -> None:
        """Record an uncharged object (client, device, subdevice...) so that
        freeing it frees the charged objects below it; ``gpu``: the GPU it
        names (a device or subdevice), for the allocations made under it."""
        self._check_new(ctx, key, parent)
        self._insert(ctx, key, parent, None, gpu)
        if self.observers:
            self.observers.notify(Tracked(ctx, key, parent, gpu))

    def dup(self, ctx: int, new_key: Key, existing_key: Key, parent: Key | None) -> None:
        """RM_DUP_OBJECT: `new_key` is a second handle to `existing_key`'s memory
        (or device: it names the same GPU). One charge, counted once; it is
        released when its last handle is freed."""
        existing = self._nodes.get(existing_key)
        if existing is None:
            raise UnknownKey(existing_key)
        self._check_new(ctx, new_key, parent)
        if existing.charge is not None:
            existing.charge.refs += 1
        self._insert(ctx, new_key, parent, existing.charge, existing.gpu)
        if self.observers:
            self.observers.notify(Duped(ctx, new_key, existing_key, parent))

    def free(self, key: Key) -> Freed:
        """RM_FREE of `key`: it and everything below it are gone."""
        if key not in self._nodes:
            raise UnknownKey(key)
        keys: list[Key] = []
        released: list[Release] = []
        self._free_subtree(key, keys, released)
        if self.observers:
            self.observers.notify(Removed(key))
        return Freed(tuple(keys), tuple(released))

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def gpu_of(self, key: Key) -> int | None:
        """The GPU a tracked device or subdevice (or a dup of one) names."""
        node = self._nodes.get(key)
        return None if node is None else node.gpu

    # --- replay ---

    def apply(self, change: Change) -> None:
        """Replay a change recorded by another ledger (LedgerError if it does
        not fit this one; nothing changes then). A charge is restored as it
        was, even over a limit lowered since: limits never free memory."""
        match change:
            case Opened(ctx, tenant):
                self.open(ctx, tenant)
            case Tracked(ctx, key, parent, gpu):
                self.track(ctx, key, parent, gpu)
            case Charged():
                self._restore(change)
            case Duped(ctx, key, source, parent):
                self.dup(ctx, key, source, parent)
            case Removed(key):
                self.free(key)
            case Closed(ctx):
                self.close(ctx)
            case _:
                raise TypeError(f"not a ledger change: {change!r}")

    def _restore(self, c: Charged) -> None:
        account = self._account(c.tenant, c.gpu)
        if c.size < 0:
            raise ValueError(f"negative allocation size {c.size}")
        self._check_new(c.ctx, c.key, c.parent)
        account.charged += c.size
        self._insert(c.ctx, c.key, c.parent, _Charge(c.tenant, c.gpu, c.size), None)
        if self.observers:
            self.observers.notify(c)

    def changes(self) -> Iterator[Change]:
        """Changes that rebuild this ledger's contexts, objects and charges
        (not its reservations): contexts first, then each object after its
        parent; the first handle of a shared charge carries it, the others
        are dups of that one."""
        for ctx, context in sorted(self._contexts.items()):
            yield Opened(ctx, context.tenant)
        holders: dict[int, Key] = {}  # id(charge) -> the handle that carries it
        nodes = self._nodes
        stack = sorted((k for k, n in nodes.items() if n.parent is None), reverse=True)
        while stack:
            key = stack.pop()
            node = nodes[key]
            charge = node.charge
            if charge is None:
                yield Tracked(node.ctx, key, node.parent, node.gpu)
            elif (holder := holders.get(id(charge))) is not None:
                yield Duped(node.ctx, key, holder, node.parent)
            else:
                holders[id(charge)] = key
                yield Charged(node.ctx, key, node.parent, charge.tenant, charge.gpu,
                              charge.size)
            stack.extend(sorted(node.children, reverse=True))

    # --- helpers ---

    def _account(self, tenant: str, gpu: int) -> _Account:
        account = self._accounts.get((tenant, gpu))
        if account is None:
            raise UnknownTenant(f"{tenant} has no limit on GPU {gpu}")
        return account

    def _context(self, ctx: int) -> _Context:
        context = self._contexts.get(ctx)
        if context is None:
            raise UnknownContext(ctx)
        return context

    def _pending_for(self, reservation: Reservation) -> _Pending:
        pending = self._pending.get(reservation.id)
        if pending is None:
            raise UnknownReservation(reservation.id)
        return pending

    def _check_new(self, ctx: int, key: Key, parent: Key | None) -> None:
        self._context(ctx)
        if key in self._nodes:
            raise DuplicateKey(key)
        if parent is not None and parent not in self._nodes:
            raise UnknownKey(parent)

    def _unreserve(self, pending: _Pending) -> None:
        r = pending.reservation
        self._accounts[r.tenant, r.gpu].reserved -= r.size
        del self._pending[r.id]
        self._contexts[r.ctx].reservations.pop(r.id, None)

    def _insert(self, ctx: int, key: Key, parent: Key | None, charge: _Charge | None,
                gpu: int | None) -> None:
        self._nodes[key] = _Node(ctx, parent, charge, gpu)
        self._contexts[ctx].keys.add(key)
        if parent is not None:
            self._nodes[parent].children.add(key)

    def _free_subtree(self, root: Key, keys: list[Key], released: list[Release]) -> None:
        root_node = self._nodes[root]
        if root_node.parent is not None:
            self._nodes[root_node.parent].children.discard(root)
        stack = [root]
        while stack:
            key = stack.pop()
            node = self._nodes.pop(key)
            self._contexts[node.ctx].keys.discard(key)
            keys.append(key)
            stack.extend(node.children)
            charge = node.charge
            if charge is not None:
                charge.refs -= 1
                if charge.refs == 0:
                    self._accounts[charge.tenant, charge.gpu].charged -= charge.size
                    released.append(Release(charge.tenant, charge.gpu, charge.size))
