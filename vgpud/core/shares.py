"""The share of GPU time each runnable tenant is entitled to (pure), and the
event that tells when the shares the scheduler publishes changed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["SharesChanged", "target_shares"]


@dataclass(frozen=True, slots=True)
class SharesChanged:
    """The target or measured shares of these tenants changed."""

    tenants: tuple[str, ...]


def target_shares(tenants: Mapping[str, tuple[int, int | None]]) -> dict[str, float]:
    """Percent of GPU time for runnable tenants {name: (weight, cap)}: by weight,
    each capped, what a cap leaves going to the others by weight (water-filling)."""
    left = {t: w for t, (w, _) in tenants.items() if w > 0}
    shares = dict.fromkeys(tenants, 0.0)
    budget = 100.0
    while left:
        total = sum(left.values())
        capped = {t: cap for t, w in left.items()
                  if (cap := tenants[t][1]) is not None and budget * w / total > cap}
        if not capped:
            for t, w in left.items():
                shares[t] = budget * w / total
            break
        for t, cap in capped.items():
            shares[t] = float(cap)
            budget -= cap
            del left[t]
    return shares
