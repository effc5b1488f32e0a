"""The memory ledger: unit tests, then a stateful model check with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from tests.support.ledger_model import LedgerMachine
from vgpud.core.ledger import (
    Change,
    Charged,
    Closed,
    Denied,
    Duped,
    DuplicateContext,
    DuplicateKey,
    Freed,
    Key,
    Ledger,
    Opened,
    Release,
    Removed,
    Reservation,
    TenantInUse,
    Tracked,
    UnknownContext,
    UnknownKey,
    UnknownReservation,
    UnknownTenant,
    Usage,
)

MiB = 2**20
CLIENT = Key(0xC1D00001, 0xC1D00001)
DEVICE = Key(0xC1D00001, 0xBEEF0080)


def ledger_with_device(limit: int = 100 * MiB, tenant: str = "a", ctx: int = 1) -> Ledger:
    ledger = Ledger()
    ledger.set_limit(tenant, 0, limit)
    ledger.open(ctx, tenant)
    ledger.track(ctx, CLIENT)
    ledger.track(ctx, DEVICE, CLIENT)
    return ledger


def mem(n: int, client: int = CLIENT.client) -> Key:
    return Key(client, 0xA0000000 + n)


def alloc(ledger: Ledger, ctx: int, key: Key, size: int, parent: Key = DEVICE) -> Reservation:
    r = ledger.reserve(ctx, 0, size, parent, key)
    assert isinstance(r, Reservation)
    ledger.commit(r)
    return r


# --- admission ---


def test_reserve_commit_free() -> None:
    ledger = ledger_with_device()
    r = ledger.reserve(1, 0, 30 * MiB, DEVICE, mem(1))
    assert r == Reservation(r.id, 1, "a", 0, 30 * MiB)  # type: ignore[union-attr]
    assert ledger.usage("a", 0) == Usage("a", 0, 100 * MiB, 0, 30 * MiB)
    ledger.commit(r)  # type: ignore[arg-type]
    assert ledger.usage("a", 0) == Usage("a", 0, 100 * MiB, 30 * MiB, 0)
    assert mem(1) in ledger
    freed = ledger.free(mem(1))
    assert freed == Freed((mem(1),), (Release("a", 0, 30 * MiB),))
    assert ledger.usage("a", 0).used == 0
    assert mem(1) not in ledger


def test_exactly_at_limit_passes_one_byte_more_is_denied() -> None:
    ledger = ledger_with_device(limit=10 * MiB)
    alloc(ledger, 1, mem(1), 6 * MiB)
    denied = ledger.reserve(1, 0, 4 * MiB + 1, DEVICE)
    assert denied == Denied("a", 0, 4 * MiB + 1, 6 * MiB, 10 * MiB)
    assert isinstance(ledger.reserve(1, 0, 4 * MiB, DEVICE), Reservation)


def test_concurrent_reservations_cannot_both_pass() -> None:
    ledger = ledger_with_device(limit=10 * MiB)
    first = ledger.reserve(1, 0, 6 * MiB, DEVICE)
    second = ledger.reserve(1, 0, 6 * MiB, DEVICE)
    assert isinstance(first, Reservation)
    assert isinstance(second, Denied)
    assert second.used == 6 * MiB


def test_release_returns_reserved_bytes() -> None:
    ledger = ledger_with_device(limit=10 * MiB)
    r = ledger.reserve(1, 0, 10 * MiB, DEVICE)
    assert isinstance(r, Reservation)
    ledger.release(r)
    assert ledger.usage("a", 0).used == 0
    with pytest.raises(UnknownReservation):
        ledger.release(r)
    with pytest.raises(UnknownReservation):
        ledger.commit(r, mem(1))


def test_commit_key_given_late() -> None:
    ledger = ledger_with_device()
    r = ledger.reserve(1, 0, MiB, DEVICE)  # the driver picks the handle
    assert isinstance(r, Reservation)
    with pytest.raises(UnknownKey):
        ledger.commit(r)
    ledger.commit(r, mem(7))
    assert mem(7) in ledger
    assert ledger.usage("a", 0).charged == MiB


def test_commit_duplicate_key_leaves_reservation() -> None:
    ledger = ledger_with_device()
    alloc(ledger, 1, mem(1), MiB)
    r = ledger.reserve(1, 0, MiB, DEVICE)
    assert isinstance(r, Reservation)
    with pytest.raises(DuplicateKey):
        ledger.commit(r, mem(1))
    assert ledger.usage("a", 0) == Usage("a", 0, 100 * MiB, MiB, MiB)
    ledger.release(r)


def test_commit_after_parent_freed_hangs_on_context() -> None:
    ledger = ledger_with_device()
    r = ledger.reserve(1, 0, MiB, DEVICE, mem(1))
    assert isinstance(r, Reservation)
    ledger.free(DEVICE)
    ledger.commit(r)
    assert ledger.usage("a", 0).charged == MiB
    assert ledger.close(1).released == (Release("a", 0, MiB),)


def test_zero_size_reservation() -> None:
    ledger = ledger_with_device(limit=0)
    r = ledger.reserve(1, 0, 0, DEVICE)
    assert isinstance(r, Reservation)
    assert isinstance(ledger.reserve(1, 0, 1, DEVICE), Denied)


# --- the tree ---


def test_free_device_frees_descendants() -> None:
    ledger = ledger_with_device()
    alloc(ledger, 1, mem(1), MiB)
    alloc(ledger, 1, mem(2), 2 * MiB)
    subdevice = Key(CLIENT.client, 0x2080)
    ledger.track(1, subdevice, DEVICE)
    alloc(ledger, 1, mem(3), 4 * MiB, parent=subdevice)
    freed = ledger.free(DEVICE)
    assert set(freed.keys) == {DEVICE, subdevice, mem(1), mem(2), mem(3)}
    assert sum(r.size for r in freed.released) == 7 * MiB
    assert ledger.usage("a", 0).used == 0
    assert CLIENT in ledger
    ledger.track(1, DEVICE, CLIENT)  # the handle can be reused


def test_free_client_frees_everything_below() -> None:
    ledger = ledger_with_device()
    alloc(ledger, 1, mem(1), MiB)
    assert len(ledger.free(CLIENT).keys) == 3
    assert ledger.usage("a", 0).used == 0


def test_free_leaf_keeps_parent() -> None:
    ledger = ledger_with_device()
    alloc(ledger, 1, mem(1), MiB)
    ledger.free(mem(1))
    assert ledger.free(DEVICE).keys == (DEVICE,)


def test_same_handle_in_different_clients_does_not_collide() -> None:
    ledger = ledger_with_device()
    other_client = Key(0xC1D00002, 0xC1D00002)
    other_device = Key(0xC1D00002, DEVICE.handle)
    ledger.open(2, "a")
    ledger.track(2, other_client)
    ledger.track(2, other_device, other_client)
    alloc(ledger, 1, mem(1), MiB)
    alloc(ledger, 2, mem(1, other_client.client), 2 * MiB, parent=other_device)
    assert ledger.free(mem(1)).released == (Release("a", 0, MiB),)
    assert mem(1, other_client.client) in ledger


# --- dup ---


def test_dup_counts_once_and_frees_with_last_handle() -> None:
    ledger = ledger_with_device()
    alloc(ledger, 1, mem(1), 8 * MiB)
    ledger.dup(1, mem(2), mem(1), DEVICE)
    assert ledger.usage("a", 0).charged == 8 * MiB
    assert ledger.free(mem(1)).released == ()
    assert ledger.usage("a", 0).charged == 8 * MiB
    assert ledger.free(mem(2)).released == (Release("a", 0, 8 * MiB),)
    assert ledger.usage("a", 0).charged == 0


def test_dup_into_another_tenant_stays_charged_to_the_owner() -> None:
    ledger = ledger_with_device()
    ledger.set_limit("b", 0, MiB)
    ledger.open(2, "b")
    b_client = Key(0xC1D00002, 0xC1D00002)
    ledger.track(2, b_client)
    alloc(ledger, 1, mem(1), 8 * MiB)
    ledger.dup(2, Key(b_client.client, 5), mem(1), b_client)
    assert ledger.close(1).released == ()
    assert ledger.usage("a", 0).charged == 8 * MiB
    assert ledger.usage("b", 0).charged == 0
    assert ledger.close(2).released == (Release("a", 0, 8 * MiB),)


def test_dup_of_uncharged_object() -> None:
    ledger = ledger_with_device()
    ledger.dup(1, Key(CLIENT.client, 0x99), DEVICE, CLIENT)
    assert ledger.free(DEVICE).released == ()
    assert Key(CLIENT.client, 0x99) in ledger


def test_dup_errors() -> None:
    ledger = ledger_with_device()
    with pytest.raises(UnknownKey):
        ledger.dup(1, mem(2), mem(1), DEVICE)
    alloc(ledger, 1, mem(1), MiB)
    with pytest.raises(DuplicateKey):
        ledger.dup(1, DEVICE, mem(1), CLIENT)
    with pytest.raises(UnknownKey):
        ledger.dup(1, mem(2), mem(1), mem(9))
    with pytest.raises(UnknownContext):
        ledger.dup(9, mem(2), mem(1), DEVICE)
    assert ledger.free(mem(1)).released == (Release("a", 0, MiB),)


# --- close ---


def test_close_releases_objects_and_reservations() -> None:
    ledger = ledger_with_device()
    alloc(ledger, 1, mem(1), MiB)
    r = ledger.reserve(1, 0, 2 * MiB, DEVICE)
    assert isinstance(r, Reservation)
    freed = ledger.close(1)
    assert set(freed.keys) == {CLIENT, DEVICE, mem(1)}
    assert freed.released == (Release("a", 0, MiB),)
    assert freed.reservations == (r.id,)
    assert ledger.usage("a", 0) == Usage("a", 0, 100 * MiB, 0, 0)
    with pytest.raises(UnknownReservation):
        ledger.commit(r, mem(2))
    with pytest.raises(UnknownContext):
        ledger.close(1)
    ledger.open(1, "a")  # the context id can be reused


def test_close_leaves_other_contexts() -> None:
    ledger = ledger_with_device()
    ledger.open(2, "a")
    ledger.track(2, Key(7, 7))
    alloc(ledger, 2, Key(7, 8), MiB, parent=Key(7, 7))
    ledger.close(1)
    assert Key(7, 8) in ledger
    assert ledger.usage("a", 0).charged == MiB


# --- limits ---


def test_raise_limit_applies_at_once() -> None:
    ledger = ledger_with_device(limit=MiB)
    assert isinstance(ledger.reserve(1, 0, 2 * MiB, DEVICE), Denied)
    ledger.set_limit("a", 0, 2 * MiB)
    assert isinstance(ledger.reserve(1, 0, 2 * MiB, DEVICE), Reservation)


def test_lower_limit_below_usage_blocks_but_frees_nothing() -> None:
    ledger = ledger_with_device(limit=10 * MiB)
    alloc(ledger, 1, mem(1), 8 * MiB)
    ledger.set_limit("a", 0, 4 * MiB)
    usage = ledger.usage("a", 0)
    assert (usage.charged, usage.limit, usage.free) == (8 * MiB, 4 * MiB, 0)
    assert isinstance(ledger.reserve(1, 0, 0, DEVICE), Denied)  # over the limit already
    assert mem(1) in ledger
    ledger.free(mem(1))
    assert isinstance(ledger.reserve(1, 0, 4 * MiB, DEVICE), Reservation)


def test_limits_are_per_tenant_and_gpu() -> None:
    ledger = ledger_with_device(limit=MiB)
    ledger.set_limit("a", 1, 4 * MiB)
    alloc(ledger, 1, mem(1), MiB)
    assert isinstance(ledger.reserve(1, 1, 4 * MiB, DEVICE), Reservation)
    with pytest.raises(UnknownTenant):
        ledger.reserve(1, 2, 1, DEVICE)


def test_snapshot_view() -> None:
    ledger = ledger_with_device(limit=10 * MiB)
    ledger.set_limit("b", 1, 5 * MiB)
    alloc(ledger, 1, mem(1), 3 * MiB)
    assert ledger.snapshot() == (
        Usage("a", 0, 10 * MiB, 3 * MiB, 0),
        Usage("b", 1, 5 * MiB, 0, 0),
    )
    assert ledger.snapshot()[0].free == 7 * MiB


def test_set_limit_negative() -> None:
    with pytest.raises(ValueError):
        Ledger().set_limit("a", 0, -1)


def test_remove_tenant() -> None:
    ledger = ledger_with_device()
    ledger.set_limit("a", 1, MiB)
    with pytest.raises(TenantInUse):
        ledger.remove_tenant("a")  # a context is open
    ledger.close(1)
    ledger.remove_tenant("a")
    assert ledger.snapshot() == ()
    with pytest.raises(UnknownTenant):
        ledger.remove_tenant("a")
    with pytest.raises(UnknownTenant):
        ledger.open(2, "a")


def test_remove_tenant_with_charge_held_by_a_dup() -> None:
    ledger = ledger_with_device()
    ledger.set_limit("b", 0, MiB)
    ledger.open(2, "b")
    ledger.track(2, Key(9, 9))
    alloc(ledger, 1, mem(1), MiB)
    ledger.dup(2, Key(9, 1), mem(1), Key(9, 9))
    ledger.close(1)
    with pytest.raises(TenantInUse):
        ledger.remove_tenant("a")


# --- errors leave the state unchanged ---


def test_errors() -> None:
    ledger = ledger_with_device()
    alloc(ledger, 1, mem(1), MiB)
    before = ledger.snapshot()
    with pytest.raises(UnknownTenant):
        ledger.open(2, "nobody")
    with pytest.raises(DuplicateContext):
        ledger.open(1, "a")
    with pytest.raises(UnknownContext):
        ledger.reserve(2, 0, MiB)
    with pytest.raises(UnknownKey):
        ledger.reserve(1, 0, MiB, mem(99))
    with pytest.raises(ValueError):
        ledger.reserve(1, 0, -1, DEVICE)
    with pytest.raises(UnknownKey):
        ledger.free(mem(99))
    with pytest.raises(DuplicateKey):
        ledger.track(1, mem(1), DEVICE)
    with pytest.raises(UnknownKey):
        ledger.track(1, mem(2), mem(99))
    with pytest.raises(UnknownContext):
        ledger.track(2, mem(2))
    with pytest.raises(UnknownTenant):
        ledger.usage("a", 5)
    with pytest.raises(UnknownReservation):
        ledger.release(Reservation(999, 1, "a", 0, MiB))
    assert ledger.snapshot() == before
    assert mem(2) not in ledger


# --- GPUs of the tree ---


def test_gpu_of_devices_and_their_dups() -> None:
    ledger = ledger_with_device()
    subdevice = Key(CLIENT.client, 0x2080)
    ledger.track(1, subdevice, DEVICE, gpu=1)
    ledger.dup(1, Key(CLIENT.client, 0x2081), subdevice, CLIENT)
    assert ledger.gpu_of(subdevice) == ledger.gpu_of(Key(CLIENT.client, 0x2081)) == 1
    assert ledger.gpu_of(DEVICE) is None  # tracked without one
    assert ledger.gpu_of(mem(9)) is None  # unknown
    ledger.free(subdevice)
    assert ledger.gpu_of(subdevice) is None


# --- durable changes, replay ---


class Recorder(list[Change]):
    """An observer that keeps what it hears."""

    def notify(self, change: Change) -> None:
        self.append(change)


def recording(ledger: Ledger) -> list[Change]:
    seen = Recorder()
    ledger.observers.subscribe(seen)
    return seen


def test_changes_are_reported_after_they_happen() -> None:
    ledger = Ledger()
    ledger.set_limit("a", 0, 100 * MiB)
    seen = recording(ledger)
    ledger.open(1, "a")
    ledger.track(1, CLIENT)
    ledger.track(1, DEVICE, CLIENT, gpu=0)
    r = ledger.reserve(1, 0, MiB, DEVICE, mem(1))
    assert isinstance(r, Reservation)
    ledger.release(ledger.reserve(1, 0, MiB, DEVICE))  # type: ignore[arg-type]
    ledger.commit(r)
    ledger.dup(1, mem(2), mem(1), None)
    ledger.free(DEVICE)
    ledger.close(1)
    assert seen == [
        Opened(1, "a"),
        Tracked(1, CLIENT, None, None),
        Tracked(1, DEVICE, CLIENT, 0),
        Charged(1, mem(1), DEVICE, "a", 0, MiB),  # reservations are not durable
        Duped(1, mem(2), mem(1), None),
        Removed(DEVICE),
        Closed(1),
    ]


def test_commit_reports_the_parent_it_kept() -> None:
    ledger = ledger_with_device()
    r = ledger.reserve(1, 0, MiB, DEVICE, mem(1))
    ledger.free(DEVICE)
    seen = recording(ledger)
    ledger.commit(r)  # type: ignore[arg-type]
    assert seen == [Charged(1, mem(1), None, "a", 0, MiB)]


def test_failed_calls_report_nothing() -> None:
    ledger = ledger_with_device()
    seen = recording(ledger)
    with pytest.raises(DuplicateKey):
        ledger.track(1, DEVICE)
    with pytest.raises(UnknownKey):
        ledger.free(mem(1))
    assert seen == []


def test_apply_rebuilds_and_restores_charges_over_the_limit() -> None:
    ledger = ledger_with_device(limit=MiB)
    ledger.apply(Charged(1, mem(1), DEVICE, "a", 0, 8 * MiB))
    ledger.apply(Duped(1, mem(2), mem(1), DEVICE))
    assert ledger.usage("a", 0).charged == 8 * MiB  # a lowered limit frees nothing
    assert isinstance(ledger.reserve(1, 0, 0, DEVICE), Denied)
    ledger.apply(Removed(mem(1)))
    assert ledger.usage("a", 0).charged == 8 * MiB
    ledger.apply(Closed(1))
    assert ledger.usage("a", 0).charged == 0
    assert ledger.contexts() == {}


@pytest.mark.parametrize("change, error", [
    (Opened(1, "a"), DuplicateContext),
    (Opened(2, "nobody"), UnknownTenant),
    (Tracked(2, mem(1), None, None), UnknownContext),
    (Tracked(1, DEVICE, None, None), DuplicateKey),
    (Charged(1, mem(1), mem(9), "a", 0, MiB), UnknownKey),
    (Charged(1, mem(1), DEVICE, "a", 7, MiB), UnknownTenant),
    (Charged(1, DEVICE, None, "a", 0, MiB), DuplicateKey),
    (Duped(1, mem(2), mem(1), None), UnknownKey),
    (Removed(mem(1)), UnknownKey),
    (Closed(2), UnknownContext),
])
def test_apply_refuses_what_does_not_fit(change: Change, error: type[Exception]) -> None:
    ledger = ledger_with_device()
    before = (ledger.snapshot(), list(ledger.changes()))
    with pytest.raises(error):
        ledger.apply(change)
    assert (ledger.snapshot(), list(ledger.changes())) == before


def test_apply_refuses_a_negative_size_and_other_values() -> None:
    ledger = ledger_with_device()
    with pytest.raises(ValueError):
        ledger.apply(Charged(1, mem(1), DEVICE, "a", 0, -1))
    with pytest.raises(TypeError):
        ledger.apply(("O", 1, "a"))  # type: ignore[arg-type]
    assert mem(1) not in ledger


def test_changes_list_parents_first_and_shared_charges_once() -> None:
    ledger = ledger_with_device()
    ledger.set_limit("b", 0, 100 * MiB)
    ledger.open(2, "b")
    other = Key(9, 9)
    ledger.track(2, other)
    alloc(ledger, 1, mem(1), MiB)
    ledger.dup(2, Key(9, 1), mem(1), other)
    ledger.free(mem(1))  # the dup now carries the charge
    alloc(ledger, 1, mem(2), 2 * MiB)
    assert list(ledger.changes()) == [
        Opened(1, "a"),
        Opened(2, "b"),
        Tracked(2, other, None, None),
        Charged(2, Key(9, 1), other, "a", 0, MiB),  # still the owner's charge
        Tracked(1, CLIENT, None, None),
        Tracked(1, DEVICE, CLIENT, None),
        Charged(1, mem(2), DEVICE, "a", 0, 2 * MiB),
    ]
    copy = Ledger()
    copy.set_limit("a", 0, 100 * MiB)
    copy.set_limit("b", 0, 100 * MiB)
    for change in ledger.changes():
        copy.apply(change)
    assert copy.snapshot() == ledger.snapshot()
    assert list(copy.changes()) == list(ledger.changes())


def test_tenant_of_and_contexts() -> None:
    ledger = ledger_with_device()
    assert ledger.tenant_of(1) == "a"
    assert ledger.contexts() == {1: "a"}
    with pytest.raises(UnknownContext):
        ledger.tenant_of(2)


# --- stateful model check (tests/support/ledger_model.py) ---

LedgerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLedgerMachine = LedgerMachine.TestCase
