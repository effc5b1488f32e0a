"""Where a snapshot's figures come from in the running daemon, wired once."""

from __future__ import annotations

from vgpud.admin.manager import Manager
from vgpud.core.ledger import Ledger
from vgpud.kernel.channel import ChannelStats
from vgpud.kernel.uapi import Stats, Stats4
from vgpud.metrics.service import Collect
from vgpud.metrics.snapshot import Snapshot, collect
from vgpud.policy.dispatch import Dispatcher
from vgpud.policy.events import QuotaEvent, QuotaExceeded
from vgpud.sched.service import SchedulerService

__all__ = ["DeniedCounts", "snapshot_source"]


class DeniedCounts:
    """Observes the quota policy: allocations refused over quota, by (tenant, GPU)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, int], int] = {}

    def notify(self, event: QuotaEvent) -> None:
        if type(event) is QuotaExceeded:
            key = (event.denied.tenant, event.denied.gpu)
            self.counts[key] = self.counts.get(key, 0) + 1


def snapshot_source(manager: Manager, ledger: Ledger, scheduler: SchedulerService,
                    dispatcher: Dispatcher, channel: ChannelStats, denied: DeniedCounts,
                    uuids: dict[int, str]) -> Collect:
    """The function the metrics service takes its snapshots with (on the loop)."""

    def take(module: Stats | None, module4: Stats4 | None) -> Snapshot:
        names = [t.name for t in manager.tenants]
        return collect(
            ledger.snapshot(), uuids=uuids, denied=denied.counts,
            gpu_time_ns=scheduler.gpu_time_ns(),
            target={n: scheduler.share(n) for n in names},
            measured={n: scheduler.measured_share(n) for n in names},
            counters=dispatcher.counters, verdicts=dispatcher.verdict_stats,
            overruns=channel.enobufs, module=module, module4=module4)

    return take

