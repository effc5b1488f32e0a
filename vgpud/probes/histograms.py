"""Log2 latency histograms per tenant, from the probes' per-context counts.

Pure: the probe service reads the BPF map (per context, histogram and call:
cumulative counts by bucket, then the sum of ns) and hands it to
``LatencyBook.update`` with a way to find a context's tenant. Counts of a
context that has closed are folded into its tenant's and their map entries
are returned for deletion, so the map holds live contexts only and nothing
is counted twice or lost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from vgpud.kernel.uapi import UpcallKind
from vgpud.nvidia.escapes import Escape, UvmCmd
from vgpud.probes.layout import (
    CALL_UPCALL,
    HISTOGRAMS,
    LAT_NR_OTHER,
    LAT_SLOT,
    LAT_SLOTS,
    LAT_SWITCH,
    LAT_UVM,
)

__all__ = ["UNATTRIBUTED", "Histogram", "LatencyBook", "call_name", "slot_bounds"]

SLOTS = LAT_SLOTS  # bcc's bpf_log2l of a u64: 0..64
# A context whose tenant is not known, live or among the recently closed.
UNATTRIBUTED = "-"
# Reads a context may stay without a tenant before it counts as unattributed.
UNKNOWN_READS = 3

CountKey = tuple[int, int, int]  # ctx_id, hist, call
# A histogram as read: counts by bucket (SLOTS of them), then the sum of ns.
Counts = Sequence[int]


def slot_bounds(slot: int) -> tuple[int, int]:
    """The ns a bucket holds, as bcc prints them: slot k is 2^(k-1) .. 2^k - 1,
    slot 1 also 0 (bpf_log2l(0) is 1; slot 0 stays empty)."""
    if not 0 <= slot < SLOTS:
        raise ValueError(f"bucket {slot} is not one of 0..{SLOTS - 1}")
    return 0 if slot == 1 else (1 << slot) >> 1, (1 << slot) - 1


@dataclass(frozen=True)
class Histogram:
    """Counts by log2 bucket (index = bcc slot), without trailing zeros, and
    the sum of the durations counted (ns)."""

    counts: tuple[int, ...] = ()
    sum_ns: int = 0

    @classmethod
    def of(cls, counts: Iterable[int], sum_ns: int = 0) -> Histogram:
        c = list(counts)
        while c and not c[-1]:
            c.pop()
        return cls(tuple(c), sum_ns)

    @property
    def total(self) -> int:
        return sum(self.counts)

    def __add__(self, other: Histogram) -> Histogram:
        n = max(len(self.counts), len(other.counts))
        a = self.counts + (0,) * (n - len(self.counts))
        b = other.counts + (0,) * (n - len(other.counts))
        return Histogram.of((x + y for x, y in zip(a, b, strict=True)),
                            self.sum_ns + other.sum_ns)

    @property
    def mean_ns(self) -> int | None:
        return self.sum_ns // self.total if self.total else None

    def percentile(self, q: float) -> int | None:
        """The upper bound (ns) of the bucket holding the q-quantile; None if empty."""
        if not 0 < q <= 1:
            raise ValueError(f"quantile {q} is not in (0, 1]")
        total = self.total
        if not total:
            return None
        rank, seen = q * total, 0
        for slot, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return slot_bounds(slot)[1]
        raise AssertionError("unreachable: the counts sum to the total")


def call_name(hist: int, call: int) -> str:
    """The kind of call a histogram is for: RM_ALLOC:0x3e, RM_CONTROL:0x20800a11,
    UVM_MIGRATE, upcall:OPEN (an upcall outside an ioctl), SCHEDULE (the
    switch and slot-wait histograms), OTHER (escapes a tenant numbers freely)."""
    if hist in (LAT_SWITCH, LAT_SLOT):
        return "SCHEDULE"
    nr, key = call & 0xFFFFFFFF, call >> 32
    if call & CALL_UPCALL == CALL_UPCALL:
        return f"upcall:{_name(UpcallKind, nr)}"
    if nr & LAT_UVM:
        nr &= ~LAT_UVM
        name = "UVM_" + ("OTHER" if nr == LAT_NR_OTHER else _name(UvmCmd, nr))
    else:
        name = "OTHER" if nr == LAT_NR_OTHER else _name(Escape, nr)
    return f"{name}:{key:#x}" if key else name


def _name(enum: type[Escape] | type[UpcallKind] | type[UvmCmd], value: int) -> str:
    return enum(value).name if value in set(enum) else f"{value:#x}"


def matches(kind: str, name: str) -> bool:
    """``kind`` selects ``name``: "" all, "RM_ALLOC" every class, "RM_ALLOC:0x3e" one."""
    return not kind or name == kind or name.startswith(kind + ":")


class LatencyBook:
    """Per-tenant histograms: those of closed contexts, folded, plus the live
    contexts' last read, folded when asked (reads are frequent, asks rare)."""

    def __init__(self) -> None:
        # tenant -> (hist, call) -> counts by slot, then the sum (index SLOTS)
        self._retired: dict[str, dict[tuple[int, int], list[int]]] = {}
        self._live: dict[CountKey, Counts] = {}  # the last read of live contexts
        self._tenants: dict[int, str] = {}  # contexts seen with a tenant
        self._unknown: dict[int, int] = {}  # contexts without one: reads so far

    def update(self, counts: Mapping[CountKey, Counts],
               tenant_of: Callable[[int], str | None],
               closed_tenant: Callable[[int], str | None] = lambda _: None) -> list[CountKey]:
        """Take a read of the map (cumulative counts); the keys to delete from it.
        ``tenant_of``: a live context's tenant; ``closed_tenant``: that of a
        context closed before this book saw it live."""
        verdicts: dict[int, str | None] = {}  # ctx -> its tenant, or None: keep it waiting
        retire: set[int] = set()
        live: dict[CountKey, Counts] = {}
        delete: list[CountKey] = []
        for key, c in counts.items():
            ctx = key[0]
            if ctx not in verdicts:
                verdicts[ctx] = self._classify(ctx, tenant_of, closed_tenant, retire)
            tenant = verdicts[ctx]
            if tenant is None:
                continue
            if ctx in retire:
                _add(self._retired.setdefault(tenant, {}), key, c)
                delete.append(key)
            else:
                live[key] = c
        # Contexts gone from the map (deleted elsewhere) are forgotten.
        for ctx in set(self._tenants) - verdicts.keys():
            del self._tenants[ctx]
        for ctx in set(self._unknown) - verdicts.keys():
            del self._unknown[ctx]
        self._live = live
        return delete

    def new_map(self) -> None:
        """The map was made anew (a lost helper's replaced): what the live
        contexts counted in the old one is kept as if they had closed, and the
        new map's counts add to it."""
        for key, c in self._live.items():
            tenant = self._tenants.get(key[0])
            if tenant is not None:
                _add(self._retired.setdefault(tenant, {}), key, c)
        self._live = {}

    def _classify(self, ctx: int, tenant_of: Callable[[int], str | None],
                  closed_tenant: Callable[[int], str | None], retire: set[int]) -> str | None:
        """The context's tenant (its counts retire if it has closed), or None while
        it has none yet."""
        tenant = tenant_of(ctx)
        if tenant is not None:
            self._tenants[ctx] = tenant
            self._unknown.pop(ctx, None)
            return tenant
        retire.add(ctx)
        retired_as = self._tenants.pop(ctx, None) or closed_tenant(ctx)
        if retired_as is None:
            reads = self._unknown[ctx] = self._unknown.get(ctx, 0) + 1
            if reads < UNKNOWN_READS:
                retire.discard(ctx)
                return None  # perhaps not learned yet: counted once it is
            retired_as = UNATTRIBUTED
            del self._unknown[ctx]
        return retired_as

    def histograms(self, tenant: str, kind: str = "") -> dict[tuple[str, str], Histogram]:
        """(call name, histogram name) -> the tenant's histogram, of calls ``kind`` selects."""
        book = {k: list(v) for k, v in self._retired.get(tenant, {}).items()}
        for key, c in self._live.items():
            if self._tenants.get(key[0]) == tenant:
                _add(book, key, c)
        out: dict[tuple[str, str], Histogram] = {}
        for (hist, call), counts in book.items():
            name = call_name(hist, call)
            if matches(kind, name):
                which = (name, HISTOGRAMS.get(hist, str(hist)))
                out[which] = out.get(which, Histogram()) + Histogram.of(counts[:SLOTS],
                                                                        counts[SLOTS])
        return out


def _add(book: dict[tuple[int, int], list[int]], key: CountKey, counts: Counts) -> None:
    """Counts by slot, the sum at index SLOTS."""
    if len(counts) != SLOTS + 1:
        return  # not struct vgpu_lat_val: a map written by something else
    have = book.setdefault((key[1], key[2]), [0] * (SLOTS + 1))
    for i, n in enumerate(counts):
        have[i] += n
