"""Latency histograms as text, the way bcc's tools print them (print_log2_hist)."""

from __future__ import annotations

from collections.abc import Iterable

from vgpud.probes.histograms import Histogram, slot_bounds

__all__ = ["by_histogram", "log2_lines", "summary"]

BAR_WIDTH = 40


def log2_lines(h: Histogram, unit: str = "nsecs") -> list[str]:
    """bcc's log2 histogram: one line per bucket from slot 1 up to the last one
    counted (slot 0, never written by bpf_log2l, is not shown)."""
    if not h.total:
        return []
    top = max(h.counts)
    lines = [f"{unit:>24} : count     distribution"]
    for slot in range(1, len(h.counts)):
        low, high = slot_bounds(slot)
        n = h.counts[slot]
        stars = n * BAR_WIDTH // top
        lines.append(f"{low:>10} -> {high:<10} : {n:<8} |{'*' * stars:<{BAR_WIDTH}}|")
    return lines


def _us(ns: int | None) -> str:
    return "-" if ns is None else f"{ns / 1000:.1f} us"


def summary(h: Histogram) -> str:
    return (f"{h.total} calls, mean {_us(h.mean_ns)}, p50 <= {_us(h.percentile(0.5))}, "
            f"p99 <= {_us(h.percentile(0.99))}")


def by_histogram(hists: Iterable[tuple[tuple[str, str], Histogram]]) -> dict[str, Histogram]:
    """Sum over the call kinds: histogram name -> histogram."""
    out: dict[str, Histogram] = {}
    for (_, name), h in hists:
        out[name] = out.get(name, Histogram()) + h
    return out
