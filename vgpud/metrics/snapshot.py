"""What the event loop hands the metrics thread: plain, immutable values.

``collect`` copies the figures it is given at once (on the loop, between
two upcalls), so that a snapshot is consistent and the thread that formats
it never reads the daemon's own structures.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vgpud.core.ledger import Usage
from vgpud.kernel.uapi import Stats, Stats4, VerdictAction
from vgpud.policy.dispatch import Counters, VerdictStats

__all__ = ["DaemonFigures", "Snapshot", "TenantGpu", "collect"]


@dataclass(frozen=True, slots=True)
class TenantGpu:
    """One tenant on one GPU. ``gpu_time_ns``: None without an activity
    source; shares in percent, None where the scheduler has none."""

    tenant: str
    gpu: int
    gpu_uuid: str
    used_bytes: int
    limit_bytes: int
    denied: int
    gpu_time_ns: int | None
    share_target: float | None
    share_measured: float | None


@dataclass(frozen=True, slots=True)
class DaemonFigures:
    upcalls: int
    verdicts: Mapping[str, int]  # action name (lower case) -> verdicts
    malformed: int
    policy_errors: int
    overruns: int  # netlink receive queue overruns: upcalls lost before the daemon read them
    latency: tuple[int, ...]  # VerdictStats.latency slots
    latency_sum_ns: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    tenants: tuple[TenantGpu, ...]
    daemon: DaemonFigures
    module: Stats | None  # None until the first GET_STATS answered
    module4: Stats4 | None  # None from a module before protocol v4


def collect(usage: Iterable[Usage], *, uuids: Mapping[int, str],
            denied: Mapping[tuple[str, int], int],
            gpu_time_ns: Mapping[tuple[int, str], int] | None,
            target: Mapping[str, Mapping[int, float]],
            measured: Mapping[str, Mapping[int, float]],
            counters: Counters, verdicts: VerdictStats, overruns: int,
            module: Stats | None, module4: Stats4 | None) -> Snapshot:
    """A snapshot of the figures given: ``usage`` one account per (tenant,
    GPU), ``denied`` and ``gpu_time_ns`` by (tenant, GPU) and (GPU, tenant),
    shares by tenant then GPU; ``overruns`` the channel's ENOBUFS count."""
    rows = tuple(
        TenantGpu(u.tenant, u.gpu, uuids.get(u.gpu, ""), u.used, u.limit,
                  denied.get((u.tenant, u.gpu), 0),
                  None if gpu_time_ns is None else gpu_time_ns.get((u.gpu, u.tenant), 0),
                  target.get(u.tenant, {}).get(u.gpu), measured.get(u.tenant, {}).get(u.gpu))
        for u in usage)
    daemon = DaemonFigures(
        upcalls=counters.upcalls,
        verdicts={a.name.lower(): verdicts.by_action[a] for a in VerdictAction},
        malformed=counters.malformed, policy_errors=counters.policy_errors,
        overruns=overruns,
        latency=tuple(verdicts.latency), latency_sum_ns=verdicts.latency_sum_ns)
    return Snapshot(rows, daemon, module, module4)
