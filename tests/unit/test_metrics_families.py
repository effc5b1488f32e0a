"""vgpud.metrics: snapshot -> families -> text, read back by prometheus_client's
own parser (names, labels, exact values), and the Dispatcher's verdict stats."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fakekernel import FAMILY, make_stats, make_stats4, upcall_msg
from tests.support.policies import DenyClasses
from vgpud.core.ledger import Usage
from vgpud.kernel import codec
from vgpud.kernel.uapi import ALLOW
from vgpud.metrics.families import families
from vgpud.metrics.snapshot import Snapshot, collect
from vgpud.nvidia import layouts as L
from vgpud.policy.dispatch import LATENCY_SLOTS, Counters, Dispatcher, VerdictStats

GIB = 2**30


class _Fixed:
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> object:
        return families(self.snapshot)


def scrape(snapshot: Snapshot) -> tuple[str, dict[str, Metric]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(snapshot))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    return text, {m.name: m for m in text_string_to_metric_families(text)}


def samples(metric: Metric) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for s in metric.samples}


def snapshot(tenants: list[str] | None = None, **kw: object) -> Snapshot:
    names = tenants or ["alice", "bob"]
    usage = [Usage(n, g, 8 * GIB if n == names[0] else 0, GIB * (g + 1), 4096)
             for n in names for g in (0, 1)]
    verdicts = VerdictStats()
    verdicts.by_action[1] = 40
    verdicts.by_action[3] = 2
    verdicts.latency[11] = 30  # 1024..2047 ns
    verdicts.latency[15] = 12  # 16384..32767 ns
    verdicts.latency_sum_ns = 250_000
    args: dict[str, object] = dict(
        uuids={0: "GPU-0000", 1: "GPU-1111"}, denied={(names[0], 1): 3},
        gpu_time_ns={(0, names[0]): 1_500_000_000, (1, names[-1]): 7},
        target={names[0]: {0: 50.0}}, measured={names[0]: {0: 37.5}},
        counters=Counters(upcalls=42, malformed=1, policy_errors=2), verdicts=verdicts,
        overruns=5, module=make_stats(timeouts=4, lost=6, contexts=3, opens=9, daemon_portid=77),
        module4=make_stats4(tampered=8))
    args.update(kw)
    return collect(usage, **args)  # type: ignore[arg-type]


def key(tenant: str, gpu: int, uuid: str) -> tuple[tuple[str, str], ...]:
    return (("gpu", str(gpu)), ("gpu_uuid", uuid), ("tenant", tenant))


def test_tenant_families_exact() -> None:
    _, got = scrape(snapshot())
    assert samples(got["vgpud_memory_used_bytes"]) == {
        key("alice", 0, "GPU-0000"): GIB + 4096, key("alice", 1, "GPU-1111"): 2 * GIB + 4096,
        key("bob", 0, "GPU-0000"): GIB + 4096, key("bob", 1, "GPU-1111"): 2 * GIB + 4096}
    assert samples(got["vgpud_memory_limit_bytes"])[key("alice", 1, "GPU-1111")] == 8 * GIB
    assert samples(got["vgpud_memory_limit_bytes"])[key("bob", 0, "GPU-0000")] == 0
    assert got["vgpud_allocations_denied"].type == "counter"
    assert samples(got["vgpud_allocations_denied"]) == {
        key("alice", 0, "GPU-0000"): 0, key("alice", 1, "GPU-1111"): 3,
        key("bob", 0, "GPU-0000"): 0, key("bob", 1, "GPU-1111"): 0}
    assert samples(got["vgpud_gpu_time_seconds"]) == {
        key("alice", 0, "GPU-0000"): 1.5, key("alice", 1, "GPU-1111"): 0,
        key("bob", 0, "GPU-0000"): 0, key("bob", 1, "GPU-1111"): 7e-9}
    assert samples(got["vgpud_share_target_ratio"]) == {key("alice", 0, "GPU-0000"): 0.5}
    assert samples(got["vgpud_share_measured_ratio"]) == {key("alice", 0, "GPU-0000"): 0.375}


def test_no_activity_source_no_gpu_time_and_no_uuid() -> None:
    _, got = scrape(snapshot(gpu_time_ns=None, uuids={}))
    assert got["vgpud_gpu_time_seconds"].samples == []
    assert samples(got["vgpud_memory_used_bytes"])[key("bob", 1, "")] == 2 * GIB + 4096


def test_daemon_families_exact() -> None:
    _, got = scrape(snapshot())
    assert samples(got["vgpud_upcalls"]) == {(): 42}
    assert samples(got["vgpud_verdicts"]) == {
        (("action", "allow"),): 40, (("action", "deny"),): 0,
        (("action", "fail_status"),): 2, (("action", "reply"),): 0}
    assert samples(got["vgpud_upcalls_malformed"]) == {(): 1}
    assert samples(got["vgpud_policy_errors"]) == {(): 2}
    assert samples(got["vgpud_netlink_overruns"]) == {(): 5}
    assert samples(got["vgpud_upcalls_timed_out"]) == {(): 4}
    assert samples(got["vgpud_upcalls_lost"]) == {(): 6}


def test_latency_histogram_is_cumulative_in_seconds() -> None:
    _, got = scrape(snapshot())
    hist = got["vgpud_verdict_latency_seconds"]
    assert hist.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in hist.samples if s.name.endswith("_bucket")}
    assert len(buckets) == LATENCY_SLOTS
    assert buckets["1.024e-06"] == 0  # below 1024 ns: none
    assert buckets["2.048e-06"] == 30
    assert buckets["3.2768e-05"] == 42
    assert buckets["+Inf"] == 42
    rest = {s.name: s.value for s in hist.samples if not s.name.endswith("_bucket")}
    assert rest == {"vgpud_verdict_latency_seconds_count": 42,
                    "vgpud_verdict_latency_seconds_sum": 0.00025}


def test_module_counters_and_no_pid() -> None:
    text, got = scrape(snapshot())
    assert samples(got["vgpud_module_opens"]) == {(): 9}
    assert samples(got["vgpud_module_tampered"]) == {(): 8}
    assert got["vgpud_module_contexts"].type == "gauge"
    assert samples(got["vgpud_module_contexts"]) == {(): 3}
    assert "portid" not in text and " 77.0" not in text  # the daemon's netlink port, a pid
    assert "vgpud_module_version" not in got


def test_module_counters_absent_until_the_module_answered() -> None:
    _, got = scrape(snapshot(module=None, module4=None))
    assert not [name for name in got if name.startswith("vgpud_module_")]
    assert "vgpud_upcalls_lost" not in got
    _, old = scrape(snapshot(module4=None))  # a module before protocol v4
    assert "vgpud_module_opens" in old and "vgpud_module_tampered" not in old


@settings(deadline=None)  # a loaded 2-core host is slow, not wrong
@given(st.text(min_size=1, max_size=30))
def test_hostile_tenant_names_stay_one_label_value(name: str) -> None:
    text, got = scrape(snapshot([name]))
    rows = [line for line in text.splitlines() if line.startswith("vgpud_memory_used_bytes")]
    assert len(rows) == 2  # one line per GPU: a newline in the name is escaped
    assert {s.labels["tenant"] for s in got["vgpud_memory_used_bytes"].samples} == {name}
    assert all(len(s.labels) == 3 for s in got["vgpud_memory_used_bytes"].samples)


def test_verdict_stats_slots() -> None:
    stats = VerdictStats()
    for spent in (0, 1, 1023, 1024, 2**40):
        stats.record(ALLOW, 100, 100 + spent)
    assert stats.latency[0] == 1
    assert stats.latency[1] == 1
    assert stats.latency[10] == 1
    assert stats.latency[11] == 1
    assert stats.latency[LATENCY_SLOTS - 1] == 1
    assert stats.latency_sum_ns == 1 + 1023 + 1024 + 2**40
    assert stats.by_action[1] == 5


def test_dispatcher_counts_verdicts_by_action_and_latency() -> None:
    ticks = iter(range(0, 10_000, 500))  # each clock read 500 ns after the last
    dispatcher = Dispatcher(DenyClasses({0x40}), clock=lambda: next(ticks))
    for h_class in (0x40, 0x80, 0x40):
        params = L.NVOS21.struct.pack(1, 2, 3, h_class, 0, 0, 0)
        (msg,) = codec.decode_datagram(upcall_msg(params, nr=0x2B), FAMILY)
        assert isinstance(msg, codec.Upcall)
        dispatcher.on_upcall(msg)
    stats = dispatcher.verdict_stats
    assert stats.by_action[1:] == [1, 0, 2, 0]  # allow, deny, fail_status, reply
    assert stats.latency[9] == 3  # 500 ns: 256 <= t < 512
    assert stats.latency_sum_ns == 1500
