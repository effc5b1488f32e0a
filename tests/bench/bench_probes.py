"""Benchmark of the latency probes, run inside the VM (`make bench-probes`).

In one boot, the probes (ebpf/vgpu_latency.bpf.c, compiled once) attached
and detached in turns, so that both states see the same noise:

1. fast path: an RM_CONTROL through /dev/vgpu/nvidiactl that no rule
   selects (ioctl_lat, against nvsim straight), probes on against off;
2. slow path: the same call selected by a rule and answered by vgpud (the
   allow policy), probes on against off;
3. the daemon's CPU per second reading the maps at 64 tenants: the map
   filled with what 64 tenants of 4 contexts would leave (16 call kinds, 3
   histograms each, 8 buckets used), read and folded as the probe service does
   at its 1 s interval;
4. the time from a quota daemon's start to its probes attached.

Prints figures; asserts nothing (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.bench_path import CTRL, build, measure, sh  # noqa: E402
from tests.support.vgpud_proc import TEST_DAEMON, Daemon  # noqa: E402
from vgpud.probes.bcc_probes import LatencyProbes, find_source  # noqa: E402
from vgpud.probes.histograms import LatencyBook  # noqa: E402
from vgpud.probes.layout import LAT_DRIVER, LAT_TOTAL, LAT_UPCALL, lat_call  # noqa: E402

TRACEFS = Path("/sys/kernel/tracing")


def on_off(lat: Path, turns: int, rounds: int, calls: int) -> dict[str, list[int]]:
    """p50 through vgpu of each turn: probes on, on without the driver's
    kprobe and kretprobe (where the rest of the cost lies), and off."""
    p50: dict[str, list[int]] = {"on": [], "tracepoints only": [], "off": []}
    for _ in range(turns):
        probes = LatencyProbes(find_source())
        probes.load()
        try:
            p50["on"].append(measure(lat, rounds, calls)["/dev/vgpu/nvidiactl"][0])
            probes._bpf.detach_kprobe(event="nvsim_ioctl")  # the bench looks inside
            probes._bpf.detach_kretprobe(event="nvsim_ioctl")
            p50["tracepoints only"].append(
                measure(lat, rounds, calls)["/dev/vgpu/nvidiactl"][0])
        finally:
            probes.close()
        p50["off"].append(measure(lat, rounds, calls)["/dev/vgpu/nvidiactl"][0])
    return p50


def report(name: str, p50: dict[str, list[int]], target: float) -> None:
    off = statistics.median(p50["off"])
    print(f"{name}: p50 via vgpu, median of {len(p50['off'])} turns")
    for what, turns in p50.items():
        m = statistics.median(turns)
        print(f"  probes {what:17s} {m:9.0f} ns  ratio {m / off:.3f}  (turns {turns})")
    print(f"  target on/off <= {target}\n")


def read_cost(tenants: int, contexts: int, reads: int) -> None:
    probes = LatencyProbes(find_source())
    probes.load()
    try:
        table = probes._bpf["hist"]  # the bench fills the map as 64 tenants would
        n = 0
        for ctx in range(1, tenants * contexts + 1):
            for call in range(16):
                for hist in (LAT_TOTAL, LAT_UPCALL, LAT_DRIVER):
                    leaf = table.Leaf()
                    for slot in range(12, 20):
                        leaf.slots[slot] = 7
                    leaf.sum_ns = 7 * 8 * 300_000
                    table[table.Key(ctx, hist, lat_call(0x2B, 0x40 + call))] = leaf
                    n += 1
        book = LatencyBook()
        owners = {ctx: f"t{ctx % tenants}" for ctx in range(1, tenants * contexts + 1)}
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(reads):
            book.update(probes.read(), owners.get)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        probes.close()
    print(f"map reads at {tenants} tenants x {contexts} contexts ({n} map entries)")
    print(f"  one read + fold: {1000 * wall / reads:.1f} ms wall, {1000 * cpu / reads:.1f} ms CPU")
    print(f"  CPU per second at a 1 s interval: {cpu / reads:.3f} s/s\n")


def start_to_attached(tmp: Path) -> None:
    config = tmp / "vgpud.toml"
    config.write_text(f'[daemon]\nstate_path = "{tmp / "state.json"}"\n'
                      f'charges_path = "{tmp / "charges"}"\n\n'
                      '[[tenant]]\nname = "bench"\nmemory = "1GiB"\nmatch = [{ uid = 0 }]\n')
    t0 = time.monotonic()
    d = Daemon("--config", str(config), "--no-dbus", log_level="info", probes=True).start()
    ready = time.monotonic() - t0
    try:
        while "latency probes" not in d.log():
            time.sleep(0.1)
        attached = time.monotonic() - t0
        line = next(x for x in d.log().splitlines() if "latency probes" in x)
    finally:
        d.stop()
    print("daemon start -> probes attached")
    print(f"  READY=1 after {ready:.1f} s, probes after {attached:.1f} s")
    print(f"  the daemon's line: {line[line.index('latency'):][:60]}...\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--fast-calls", type=int, default=5000)
    ap.add_argument("--slow-calls", type=int, default=300)
    ap.add_argument("--reads", type=int, default=10)
    args = ap.parse_args()

    if not (TRACEFS / "events").exists():
        sh("mount", "-t", "tracefs", "nodev", str(TRACEFS))
    sh("insmod", str(ROOT / "kmod/nvsim/nvsim.ko"), "gpus=1", "mem_mib=4096")
    sh("insmod", str(ROOT / "kmod/vgpu/vgpu.ko"), "backing_dir=/dev/nvsim",
       "backing_driver=nvsim", "backing_uvm_driver=nvsim")
    tmp = Path(tempfile.mkdtemp())
    lat, _ = build(tmp)
    print(f"kernel {os.uname().release}, {os.cpu_count()} vCPUs (TCG)\n")

    report("fast path (RM_CONTROL, no rule)",
           on_off(lat, args.turns, args.rounds, args.fast_calls), 1.10)

    d = Daemon("--filter", f"control:{CTRL:#x}", log_level="warning", entry=TEST_DAEMON).start()
    try:
        slow = on_off(lat, args.turns, args.rounds, args.slow_calls)
    finally:
        d.stop()
    report("slow path (RM_CONTROL upcalled, vgpud answers ALLOW)", slow, 1.05)

    read_cost(64, 4, args.reads)
    start_to_attached(tmp)
    sh("rmmod", "vgpu")
    sh("rmmod", "nvsim")


if __name__ == "__main__":
    main()
