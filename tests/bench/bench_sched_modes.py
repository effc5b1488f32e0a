"""Benchmark of the two scheduling modes on nvsim's work engine, in one boot.

    scripts/vm-run -- python tests/bench/bench_sched_modes.py [--seconds 10]
                      [--tenants 2,4,16,64] [--modes runlist,frame] [--wakes 50]

One nvsim GPU, vgpu over it, vgpud --config (no D-Bus) per mode and tenant
count N: N best-effort tenants (cgroups, random weights 1..1000, seeded),
each a channel group kept saturated by tests/support/tdma_workload.py, and
one more tenant, idle, with a group of its own. After a warm-up, over
--seconds:
- share error: the worst |busy share - weight share| of the N, in percentage
  points (busy from /proc/driver/nvsim/groups);
- switching loss: (engine idle + PREEMPT switch time) / elapsed
  (/proc/driver/nvsim/engines; every tenant has work, so that time is lost);
- daemon CPU per second (utime + stime from /proc/PID/stat);
then the cost of a weight change: the median tenant's weight raised by a
tenth (SIGHUP reload), the TIMESLICE entries the module applied in the next
2 s (the vgpu_schedule tracepoint, enable=3);
then priority: the idle tenant made priority (reload), it wakes --wakes times
(1 ms of work, each 40 ms after the last ran dry): submit-to-run p50 / p99
from nvsim's wake counters (wake_sum_ns per wake), how late nvsim's engine
thread ran after its slice timers (mean and share over 1 ms meanwhile, max
since nvsim was loaded: the guest's timer latency, which a wake waits for
too), and the daemon CPU per
second meanwhile
(its activity source polls every 20 ms once a tenant is priority), and the
PREEMPTs nvsim's engine took meanwhile.
Prints a table; asserts nothing (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as a script: the repository root on sys.path, for tests.support.
sys.path.insert(0, str(ROOT))

from bench_tdma_vm import cpu_seconds, sh  # noqa: E402

from tests.support import nvclient as nv  # noqa: E402
from tests.support.tdma import (  # noqa: E402
    CGROOT,
    Tenants,
    config_text,
    open_as_tenant,
    wake_latencies,
)
from tests.support.vgpud_proc import Daemon  # noqa: E402

TRACEFS = Path("/sys/kernel/tracing")
TIMESLICE_ENTRY = re.compile(r"vgpu_schedule: .* enable=3 ")


def tracing(on: bool) -> int:
    """Switch the vgpu_schedule tracepoint; off: the TIMESLICE entries traced (-1:
    no tracefs)."""
    event = TRACEFS / "events/vgpu/vgpu_schedule/enable"
    if not event.exists():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=False,
                       capture_output=True)
    if not event.exists():
        return -1
    if on:
        (TRACEFS / "trace").write_text("")
        event.write_text("1")
        return 0
    event.write_text("0")
    return len(TIMESLICE_ENTRY.findall((TRACEFS / "trace").read_text()))


def pct(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000 if ordered else 0.0


def reload(daemon: Daemon, config: Path, text: str) -> None:
    config.write_text(text)
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    time.sleep(2.0)  # the reload, and the time the entries land in


def run(mode: str, weights: list[int], seconds: float, warmup: float,
        wakes: int) -> dict[str, float]:
    n = len(weights)
    cgroups = [CGROOT / f"vgpu-tdma-t{i}" for i in range(n + 1)]
    for path in cgroups:
        path.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-modes-"))
    config = tmp / "vgpud.toml"
    everyone = [*weights, 500]  # t{n}: idle, then priority
    text = config_text(tmp / "state.json", everyone, mode=mode)
    config.write_text(text)
    daemon = Daemon("--config", str(config), "--no-dbus", log_level="info").start()
    assert daemon.proc is not None
    pid = daemon.proc.pid
    tenants, ctl = None, -1
    try:
        ctl = open_as_tenant(n)
        tree = nv.build_tree(ctl)
        group = nv.alloc_channel_group(ctl, tree.client, tree.device)
        tenants = Tenants(n)
        time.sleep(warmup)
        e0, b0, c0, t0 = nv.proc_engines()[0], tenants.busy(), cpu_seconds(pid), \
            time.monotonic()
        time.sleep(seconds)
        e1, b1, c1, t1 = nv.proc_engines()[0], tenants.busy(), cpu_seconds(pid), \
            time.monotonic()
        median = sorted(range(n), key=lambda i: weights[i])[n // 2]
        changed = list(everyone)
        changed[median] = min(1000, changed[median] + max(1, changed[median] // 10))
        trace = tracing(True)
        reload(daemon, config, config_text(tmp / "state.json", changed, mode=mode))
        entries = tracing(False) if trace == 0 else -1
        prio = config_text(tmp / "state.json", changed, mode=mode,
                           tenant={n: 'priority = "priority"\n'})
        reload(daemon, config, prio)
        e2, c2, t2 = nv.proc_engines()[0], cpu_seconds(pid), time.monotonic()
        latencies = wake_latencies(ctl, tree.client, group, wakes)
        e3, c3, t3 = nv.proc_engines()[0], cpu_seconds(pid), time.monotonic()
    finally:
        if ctl >= 0:
            os.close(ctl)
        if tenants is not None:
            tenants.close()
        daemon.stop()
        for path in cgroups:
            path.rmdir()
    used = [b - a for a, b in zip(b0, b1, strict=True)]
    error = max(abs(u / sum(used) - w / sum(weights)) for u, w in zip(used, weights,
                                                                       strict=True))
    wakeups = e3.timer_wakes - e2.timer_wakes
    lost = (e1.idle_ns - e0.idle_ns) + (e1.switch_ns - e0.switch_ns)
    elapsed = lost + e1.busy_ns - e0.busy_ns
    return {
        "share_err_pp": 100 * error,
        "loss": lost / elapsed,
        "cpu_ms_s": 1000 * (c1 - c0) / (t1 - t0),
        "timeslices": entries,
        "wakes": len(latencies),
        "wake_p50": pct(latencies, 0.5),
        "wake_p99": pct(latencies, 0.99),
        "prio_cpu_ms_s": 1000 * (c3 - c2) / (t3 - t2),
        "preempts": e3.preempts - e2.preempts,
        "late_mean": (e3.late_sum_ns - e2.late_sum_ns) / 1000 / max(1, wakeups),
        "late_max": e3.late_max_ns / 1000,
        "late_1ms": (e3.late_1ms - e2.late_1ms) / max(1, wakeups),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--tenants", default="2,4,16,64")
    ap.add_argument("--modes", default="runlist,frame")
    ap.add_argument("--wakes", type=int, default=50)
    args = ap.parse_args()
    sh("insmod", str(ROOT / "kmod/nvsim/nvsim.ko"), "gpus=1", "mem_mib=4096")
    sh("insmod", str(ROOT / "kmod/vgpu/vgpu.ko"), "backing_dir=/dev/nvsim",
       "backing_driver=nvsim", "backing_uvm_driver=nvsim")
    try:
        print(f"{args.seconds:g} s per run, random weights (seed 1), frame 100 ms, "
              f"{args.wakes} priority wakes 40 ms after the last ran dry")
        print(f"{'mode':>7} {'tenants':>7} {'share err pp':>12} {'switch loss':>11} "
              f"{'CPU ms/s':>8} {'TIMESLICE/change':>16} {'wake p50/p99 us':>17} "
              f"{'CPU ms/s (prio)':>15} {'PREEMPTs':>8} {'timer late mean/max us, >1ms':>29}")
        for n in (int(x) for x in args.tenants.split(",")):
            rng = random.Random(1)
            weights = [rng.randint(1, 1000) for _ in range(n)]
            for mode in args.modes.split(","):
                r = run(mode, weights, args.seconds, args.warmup, args.wakes)
                print(f"{mode:>7} {n:>7} {r['share_err_pp']:>12.2f} {r['loss']:>11.2%} "
                      f"{r['cpu_ms_s']:>8.1f} {r['timeslices']:>16.0f} "
                      f"{r['wake_p50']:>8.0f}/{r['wake_p99']:>8.0f} "
                      f"{r['prio_cpu_ms_s']:>15.1f} {r['preempts']:>8.0f} "
                      f"{r['late_mean']:>9.0f}/{r['late_max']:>8.0f}, {r['late_1ms']:>8.2%}",
                      flush=True)
    finally:
        sh("rmmod", "vgpu")
        sh("rmmod", "nvsim")


if __name__ == "__main__":
    main()
