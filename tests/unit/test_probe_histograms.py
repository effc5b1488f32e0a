"""vgpud.probes.histograms: log2 buckets, call names, the per-tenant book."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpud.nvidia.escapes import Ctrl, Escape, NvClass, UvmCmd
from vgpud.probes.histograms import (
    SLOTS,
    UNATTRIBUTED,
    UNKNOWN_READS,
    Histogram,
    LatencyBook,
    call_name,
    matches,
    slot_bounds,
)
from vgpud.probes.layout import (
    CALL_UPCALL,
    LAT_DRIVER,
    LAT_NR_OTHER,
    LAT_SLOT,
    LAT_SWITCH,
    LAT_TOTAL,
    LAT_UPCALL,
    LAT_UVM,
    lat_call,
)

ALLOC_40 = lat_call(Escape.RM_ALLOC, NvClass.MEMORY_LOCAL_USER)


def val(buckets: dict[int, int], sum_ns: int = 0) -> list[int]:
    """struct vgpu_lat_val as read: counts by bucket, then the sum."""
    return [buckets.get(i, 0) for i in range(SLOTS)] + [sum_ns]


def bpf_log2l(v: int) -> int:
    """bcc's bpf_log2l, as helpers.h computes it."""
    return (v or 1).bit_length()


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_a_duration_is_in_the_bucket_bcc_puts_it(ns: int) -> None:
    low, high = slot_bounds(bpf_log2l(ns))
    assert low <= ns <= high


def test_slot_bounds_are_bccs() -> None:
    assert [slot_bounds(k) for k in range(4)] == [(0, 0), (0, 1), (2, 3), (4, 7)]
    assert slot_bounds(64) == (2**63, 2**64 - 1)
    for bad in (-1, SLOTS):
        with pytest.raises(ValueError, match="bucket"):
            slot_bounds(bad)


counts = st.lists(st.integers(min_value=0, max_value=10**6), max_size=SLOTS)


@given(counts, counts, counts)
def test_sums_are_associative_and_keep_totals(a: list[int], b: list[int], c: list[int]) -> None:
    x, y, z = Histogram.of(a, sum(a)), Histogram.of(b, 2 * sum(b)), Histogram.of(c)
    assert (x + y) + z == x + (y + z)
    assert (x + y).total == x.total + y.total
    assert (x + y).sum_ns == x.sum_ns + y.sum_ns
    assert x + Histogram() == x


@given(counts.filter(any), st.floats(min_value=0.01, max_value=1.0))
def test_percentile_is_a_bucket_bound_and_monotone(c: list[int], q: float) -> None:
    h = Histogram.of(c)
    p = h.percentile(q)
    assert p is not None
    assert p == slot_bounds(p.bit_length())[1]
    below = sum(n for slot, n in enumerate(h.counts) if slot_bounds(slot)[1] <= p)
    assert below >= q * h.total
    assert h.percentile(min(1.0, q + 0.2)) >= p  # type: ignore[operator]


def test_percentile_of_nothing() -> None:
    assert Histogram().percentile(0.5) is None
    with pytest.raises(ValueError):
        Histogram.of([1]).percentile(0)


def test_call_names() -> None:
    assert call_name(LAT_TOTAL, ALLOC_40) == "RM_ALLOC:0x40"
    assert call_name(LAT_TOTAL, lat_call(Escape.RM_CONTROL, Ctrl.FB_GET_INFO_V2)) == \
        "RM_CONTROL:0x20801303"
    assert call_name(LAT_TOTAL, lat_call(Escape.RM_FREE, 0)) == "RM_FREE"
    assert call_name(LAT_TOTAL, lat_call(0x99, 0)) == "0x99"
    # UVM commands and escapes share numbers: the UVM bit tells them apart.
    assert call_name(LAT_TOTAL, lat_call(UvmCmd.SET_PREFERRED_LOCATION | LAT_UVM, 0)) == \
        "UVM_SET_PREFERRED_LOCATION"
    assert call_name(LAT_TOTAL, lat_call(Escape.RM_CONTROL, 0)) == "RM_CONTROL"
    assert call_name(LAT_TOTAL, lat_call(7 | LAT_UVM, 0)) == "UVM_0x7"
    assert call_name(LAT_TOTAL, lat_call(UvmCmd.INITIALIZE | LAT_UVM, 0)) == "UVM_INITIALIZE"
    assert call_name(LAT_TOTAL, lat_call(LAT_NR_OTHER | LAT_UVM, 0)) == "UVM_OTHER"
    assert call_name(LAT_TOTAL, lat_call(LAT_NR_OTHER, 0)) == "OTHER"
    assert call_name(LAT_UPCALL, CALL_UPCALL | 1) == "upcall:OPEN"
    assert call_name(LAT_UPCALL, CALL_UPCALL | 4) == "upcall:MMAP"
    assert call_name(LAT_SWITCH, 0) == "SCHEDULE"
    assert call_name(LAT_SLOT, 0) == "SCHEDULE"


def test_kind_selection() -> None:
    assert matches("", "RM_ALLOC:0x40")
    assert matches("RM_ALLOC", "RM_ALLOC:0x40")
    assert matches("RM_ALLOC:0x40", "RM_ALLOC:0x40")
    assert not matches("RM_ALLOC:0x4", "RM_ALLOC:0x40")
    assert not matches("RM_ALLO", "RM_ALLOC")


def test_book_folds_contexts_into_tenants() -> None:
    book = LatencyBook()
    tenants = {1: "a", 2: "a", 3: "b"}
    read = {(1, LAT_TOTAL, ALLOC_40): val({10: 2}), (2, LAT_TOTAL, ALLOC_40): val({10: 3}),
            (2, LAT_DRIVER, ALLOC_40): val({9: 5}), (3, LAT_TOTAL, ALLOC_40): val({12: 1})}
    assert book.update(read, tenants.get) == []
    hists = book.histograms("a")
    assert hists[("RM_ALLOC:0x40", "total")].counts[10] == 5
    assert hists[("RM_ALLOC:0x40", "driver")].total == 5
    assert book.histograms("b")[("RM_ALLOC:0x40", "total")].total == 1
    assert book.histograms("a", "RM_FREE") == {}
    # Cumulative reads: the live part is replaced, not added.
    read[(1, LAT_TOTAL, ALLOC_40)] = val({10: 4})
    book.update(read, tenants.get)
    assert book.histograms("a")[("RM_ALLOC:0x40", "total")].total == 7


def test_closed_contexts_are_kept_once_and_trimmed() -> None:
    book = LatencyBook()
    tenants = {1: "a"}
    read = {(1, LAT_TOTAL, ALLOC_40): val({10: 2})}
    book.update(read, tenants.get)
    del tenants[1]  # closed
    gone = book.update(read, tenants.get)
    assert gone == [(1, LAT_TOTAL, ALLOC_40)]
    assert book.histograms("a")[("RM_ALLOC:0x40", "total")].total == 2
    # The map no longer has it: nothing is counted twice.
    assert book.update({}, tenants.get) == []
    assert book.histograms("a")[("RM_ALLOC:0x40", "total")].total == 2


def test_a_context_never_resolved_is_unattributed_after_a_few_reads() -> None:
    book = LatencyBook()
    read = {(9, LAT_TOTAL, ALLOC_40): val({3: 1})}
    for _ in range(UNKNOWN_READS - 1):
        assert book.update(read, lambda _: None) == []
    assert book.update(read, lambda _: None) == list(read)
    assert book.histograms(UNATTRIBUTED)[("RM_ALLOC:0x40", "total")].total == 1


def test_a_context_learned_late_keeps_its_counts() -> None:
    book = LatencyBook()
    read = {(9, LAT_TOTAL, ALLOC_40): val({3: 1})}
    assert book.update(read, lambda _: None) == []
    book.update(read, {9: "a"}.get)
    assert book.histograms("a")[("RM_ALLOC:0x40", "total")].total == 1


def test_sums_ride_beside_the_counts() -> None:
    book = LatencyBook()
    book.update({(1, LAT_TOTAL, ALLOC_40): val({10: 2}, 1500),
                 (1, LAT_SLOT, 0): val({27: 1}, 70_000_000)}, {1: "a"}.get)
    h = book.histograms("a")
    assert h[("RM_ALLOC:0x40", "total")] == Histogram.of([0] * 10 + [2], 1500)
    assert h[("RM_ALLOC:0x40", "total")].mean_ns == 750
    assert h[("SCHEDULE", "slot")].sum_ns == 70_000_000


def test_values_of_another_shape_are_ignored() -> None:
    book = LatencyBook()
    book.update({(1, LAT_TOTAL, ALLOC_40): [1] * SLOTS}, {1: "a"}.get)
    assert book.histograms("a") == {}


@given(st.lists(st.tuples(st.integers(1, 4), st.sampled_from(["a", "b"]),
                          st.integers(1, 5), st.integers(0, 6)), min_size=1, max_size=12))
def test_every_count_is_kept_once_whatever_the_read_times(
        contexts: list[tuple[int, str, int, int]]) -> None:
    """Contexts (events per read, tenant, reads while open, reads before it is
    learned): read after read the map grows and closed contexts are deleted,
    as the service does; the tenants' totals end as the events made."""
    book, kernel = LatencyBook(), {}
    made = {"a": 0, "b": 0}
    live = dict(enumerate(contexts, start=1))
    step = 0
    while live or kernel:
        step += 1
        for ctx, (per_read, tenant, reads, _) in list(live.items()):
            if step > reads:
                del live[ctx]  # closed: no more events
                continue
            made[tenant] += per_read
            old = kernel.get((ctx, LAT_TOTAL, ALLOC_40), val({}))
            kernel[(ctx, LAT_TOTAL, ALLOC_40)] = [n + (per_read if i == 5 else 0)
                                                  for i, n in enumerate(old)]

        def tenant_of(ctx: int, step: int = step) -> str | None:
            _, tenant, _, late = contexts[ctx - 1]
            return tenant if ctx in live and step > min(late, UNKNOWN_READS - 1) else None

        for key in book.update(dict(kernel), tenant_of):
            del kernel[key]
    got = {t: sum(h.total for h in book.histograms(t).values()) for t in ("a", "b", UNATTRIBUTED)}
    assert got["a"] + got["b"] + got[UNATTRIBUTED] == made["a"] + made["b"]
    for tenant in ("a", "b"):
        assert got[tenant] <= made[tenant]


def test_a_context_closed_between_reads_keeps_its_tenant() -> None:
    """Opened, used and closed within one interval: never seen live, its tenant
    comes from the closed contexts the quota policy remembers."""
    book = LatencyBook()
    read = {(9, LAT_TOTAL, ALLOC_40): val({3: 5})}
    assert book.update(read, lambda _: None, {9: "a"}.get) == list(read)
    assert book.histograms("a")[("RM_ALLOC:0x40", "total")].total == 5
    assert book.histograms(UNATTRIBUTED) == {}
