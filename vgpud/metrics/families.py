"""A snapshot as Prometheus metric families (pure: no I/O, no clock).

Names follow Prometheus's base-unit rules and the vocabulary of
dcgm-exporter and HAMi: bytes, seconds, ratios in 0..1, ``_total`` for
counters (the client library appends it to a counter family's name).
Per tenant and GPU the labels are ``tenant``, ``gpu`` (the index) and
``gpu_uuid`` (empty where the inventory has none, as under nvsim).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from vgpud.kernel.uapi import Stats, Stats4
from vgpud.metrics.snapshot import DaemonFigures, Snapshot, TenantGpu

__all__ = ["families"]

TENANT_LABELS = ("tenant", "gpu", "gpu_uuid")
# struct vgpu_stats fields not among the vgpud_module_* counters: the protocol
# version, the daemon's netlink port (a pid), and those given names of their own.
_NOT_COUNTERS = frozenset({"version", "daemon_portid", "contexts", "timeouts", "lost"})


def families(snapshot: Snapshot) -> Iterator[Metric]:
    """Every family of the snapshot, in a stable order."""
    yield from _tenant_families(snapshot.tenants)
    yield from _daemon_families(snapshot.daemon)
    if snapshot.module is not None:
        yield from _module_families(snapshot.module, snapshot.module4)


def _labels(row: TenantGpu) -> list[str]:
    return [row.tenant, str(row.gpu), row.gpu_uuid]


def _tenant_families(rows: tuple[TenantGpu, ...]) -> Iterator[Metric]:
    used = GaugeMetricFamily("vgpud_memory_used_bytes",
                             "Device memory charged or reserved to the tenant.",
                             labels=TENANT_LABELS)
    limit = GaugeMetricFamily("vgpud_memory_limit_bytes",
                              "Device memory the tenant may hold (0: may not use the GPU).",
                              labels=TENANT_LABELS)
    denied = CounterMetricFamily("vgpud_allocations_denied",
                                 "Allocations refused because they were over the tenant's "
                                 "limit, since the daemon started.", labels=TENANT_LABELS)
    gpu_time = CounterMetricFamily("vgpud_gpu_time_seconds",
                                   "GPU time the tenant's work got, as the scheduler's "
                                   "activity source measures it.", labels=TENANT_LABELS)
    target = GaugeMetricFamily("vgpud_share_target_ratio",
                               "Share of GPU time the scheduler targets for the tenant.",
                               labels=TENANT_LABELS)
    measured = GaugeMetricFamily("vgpud_share_measured_ratio",
                                 "Share of GPU time the tenant got over the last interval.",
                                 labels=TENANT_LABELS)
    for row in rows:
        labels = _labels(row)
        used.add_metric(labels, row.used_bytes)
        limit.add_metric(labels, row.limit_bytes)
        denied.add_metric(labels, row.denied)
        if row.gpu_time_ns is not None:
            gpu_time.add_metric(labels, row.gpu_time_ns / 1e9)
        if row.share_target is not None:
            target.add_metric(labels, row.share_target / 100)
        if row.share_measured is not None:
            measured.add_metric(labels, row.share_measured / 100)
    yield from (used, limit, denied, gpu_time, target, measured)


def _daemon_families(daemon: DaemonFigures) -> Iterator[Metric]:
    yield CounterMetricFamily("vgpud_upcalls", "Upcalls the daemon received.",
                              value=daemon.upcalls)
    verdicts = CounterMetricFamily("vgpud_verdicts", "Verdicts the daemon gave, by action.",
                                   labels=("action",))
    for action, count in daemon.verdicts.items():
        verdicts.add_metric([action], count)
    yield verdicts
    yield CounterMetricFamily("vgpud_upcalls_malformed", "Upcalls that did not decode.",
                              value=daemon.malformed)
    yield CounterMetricFamily("vgpud_policy_errors",
                              "Policy failures answered with the safe verdict.",
                              value=daemon.policy_errors)
    yield CounterMetricFamily("vgpud_netlink_overruns",
                              "Receive queue overruns of the daemon's netlink socket "
                              "(upcalls lost before the daemon read them).",
                              value=daemon.overruns)
    yield _latency(daemon)


def _latency(daemon: DaemonFigures) -> HistogramMetricFamily:
    """The log2 slots as cumulative buckets: slot i holds times below 2**i ns."""
    buckets: list[tuple[str, float]] = []
    total = 0
    last = len(daemon.latency) - 1
    for slot, count in enumerate(daemon.latency):
        total += count
        buckets.append(("+Inf" if slot == last else floatToGoString((1 << slot) / 1e9), total))
    return HistogramMetricFamily("vgpud_verdict_latency_seconds",
                                 "Time from an upcall's arrival in the daemon to its verdict.",
                                 buckets=buckets, sum_value=daemon.latency_sum_ns / 1e9)


def _module_families(stats: Stats, stats4: Stats4 | None) -> Iterator[Metric]:
    yield GaugeMetricFamily("vgpud_module_contexts", "Emulated files open now (vgpu module).",
                            value=stats.contexts)
    yield CounterMetricFamily("vgpud_upcalls_timed_out",
                              "Upcalls that got no verdict in time (vgpu module).",
                              value=stats.timeouts)
    yield CounterMetricFamily("vgpud_upcalls_lost",
                              "Upcalls the module could not send, and late or unknown "
                              "verdicts (vgpu module).", value=stats.lost)
    structs: list[tuple[str, Stats | Stats4]] = [("vgpu_stats", stats)]
    if stats4 is not None:
        structs.append(("vgpu_stats4", stats4))
    for struct, values in structs:
        for f in fields(values):
            if f.name not in _NOT_COUNTERS:
                yield CounterMetricFamily(f"vgpud_module_{f.name}",
                                          f"struct {struct} {f.name} (vgpu module).",
                                          value=getattr(values, f.name))
