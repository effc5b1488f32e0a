"""Benchmark of TDMA scheduling on nvsim's work engine, run inside the VM.

    scripts/vm-run -- python tests/bench/bench_tdma_vm.py [--seconds 10] [--tenants 2,4,16,64]

One nvsim GPU, vgpu over it, vgpud --config with N tenants (cgroups, random
weights 1..1000, seeded), each a channel group kept saturated by
tests/support/tdma_workload.py. After a warm-up, over --seconds:
- share error: the worst |busy share - weight share| over the tenants, in
  percentage points (busy from /proc/driver/nvsim/groups);
- switching loss: the engine's idle time / elapsed (/proc/driver/nvsim/engines;
  every tenant has work, so idle time is time lost to switching);
- switches per second (the engine's count);
- switch latency: decision -> the SCHEDULE call answered (the outgoing groups
  are off by then), p50 / p99, and timer lateness (deadline -> decision),
  from the daemon's "scheduler stats" line at stop; and the module's own time
  per "off" entry (lookup + GPFIFO_SCHEDULE), from the vgpu_schedule
  tracepoint when tracefs is there;
- daemon CPU per second of scheduling (utime + stime from /proc/PID/stat).
First, the cost of making a channel group: alloc + free of a TSG straight on
nvsim and through vgpud (the alloc upcalled and shadowed, the group made off
by the module before the alloc returns, its POST; the free's POST), the two
interleaved, p50 / p99 and their ratio.
Prints a table; asserts nothing (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as a script: the repository root on sys.path, for tests.support.
sys.path.insert(0, str(ROOT))

from tests.support import nvclient as nv  # noqa: E402
from tests.support.tdma import CGROOT, Tenants, config_text, open_as_tenant  # noqa: E402
from tests.support.vgpud_proc import Daemon  # noqa: E402

STATS = re.compile(r"scheduler stats (\{.*\})")
TRACEFS = Path("/sys/kernel/tracing")
TRACE_OFF = re.compile(r"vgpu_schedule: .* enable=0 .* ns=(\d+)")


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tracing(on: bool) -> list[int]:
    """Switch the vgpu_schedule tracepoint; off: the ns of the "off" entries traced."""
    event = TRACEFS / "events/vgpu/vgpu_schedule/enable"
    if not event.exists():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=False,
                       capture_output=True)
    if not event.exists():
        return []
    if on:
        (TRACEFS / "trace").write_text("")
        event.write_text("1")
        return [1]
    event.write_text("0")
    return [int(m.group(1)) for m in TRACE_OFF.finditer((TRACEFS / "trace").read_text())]


def percentiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"p50": ordered[len(ordered) // 2] / 1000,
            "p99": ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)] / 1000}


def group_round_trips(count: int) -> tuple[list[int], list[int]]:
    """TSG alloc + free times (ns), straight on nvsim and through vgpud, interleaved."""
    cgroup = CGROOT / "vgpu-tdma-t0"
    cgroup.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-groups-"))
    config = tmp / "vgpud.toml"
    config.write_text(config_text(tmp / "state.json", [1]))
    daemon = Daemon("--config", str(config), "--no-dbus", log_level="warning").start()
    fds: list[int] = []
    try:
        fds = [nv.NvNodes("/dev/nvsim").open_ctl(), open_as_tenant(0)]
        trees = [nv.build_tree(fd) for fd in fds]
        times: tuple[list[int], list[int]] = ([], [])
        for _ in range(count):
            for fd, tree, out in zip(fds, trees, times, strict=True):
                t0 = time.perf_counter_ns()
                group = nv.alloc_channel_group(fd, tree.client, tree.device)
                nv.must(nv.rm_free(fd, tree.client, tree.device, group), "free")
                out.append(time.perf_counter_ns() - t0)
        return times
    finally:
        for fd in fds:
            os.close(fd)
        daemon.stop()
        cgroup.rmdir()


def run(n: int, seconds: float, warmup: float, rng: random.Random) -> dict[str, object]:
    weights = [rng.randint(1, 1000) for _ in range(n)]
    cgroups = [CGROOT / f"vgpu-tdma-t{i}" for i in range(n)]
    for path in cgroups:
        path.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-tdma-"))
    config = tmp / "vgpud.toml"
    config.write_text(config_text(tmp / "state.json", weights))
    daemon = Daemon("--config", str(config), "--no-dbus", log_level="info").start()
    tenants = None
    trace = tracing(True)
    try:
        tenants = Tenants(n)
        time.sleep(warmup)
        assert daemon.proc is not None
        e0, b0, c0, t0 = nv.proc_engines()[0], tenants.busy(), cpu_seconds(daemon.proc.pid), \
            time.monotonic()
        time.sleep(seconds)
        e1, b1, c1, t1 = nv.proc_engines()[0], tenants.busy(), cpu_seconds(daemon.proc.pid), \
            time.monotonic()
    finally:
        offs = tracing(False) if trace else []
        if tenants is not None:
            tenants.close()
        daemon.stop()
        for path in cgroups:
            path.rmdir()
    used = [b - a for a, b in zip(b0, b1, strict=True)]
    error = max(abs(u / sum(used) - w / sum(weights)) for u, w in zip(used, weights,
                                                                       strict=True))
    elapsed_ns = (e1.busy_ns + e1.idle_ns) - (e0.busy_ns + e0.idle_ns)
    found = STATS.findall(daemon.log())
    stats = ast.literal_eval(found[-1]) if found else {}
    return {
        "tenants": n,
        "share_err_pp": 100 * error,
        "loss": (e1.idle_ns - e0.idle_ns) / elapsed_ns,
        "switches_s": (e1.switches - e0.switches) / (t1 - t0),
        "latency": stats.get("latency_us", {}),
        "lateness": stats.get("lateness_us", {}),
        "module_off": percentiles(offs),
        "cpu_ms_s": 1000 * (c1 - c0) / (t1 - t0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--tenants", default="2,4,16,64")
    ap.add_argument("--group-allocs", type=int, default=200)
    args = ap.parse_args()
    sh("insmod", str(ROOT / "kmod/nvsim/nvsim.ko"), "gpus=1", "mem_mib=4096")
    sh("insmod", str(ROOT / "kmod/vgpu/vgpu.ko"), "backing_dir=/dev/nvsim",
       "backing_driver=nvsim", "backing_uvm_driver=nvsim")
    rng = random.Random(1)
    try:
        direct, via = (percentiles(t) for t in group_round_trips(args.group_allocs))
        print(f"channel group alloc + free ({args.group_allocs}): straight on nvsim p50 "
              f"{direct['p50']:.0f} / p99 {direct['p99']:.0f} us, through vgpud p50 "
              f"{via['p50']:.0f} / p99 {via['p99']:.0f} us, ratio p50 "
              f"{via['p50'] / direct['p50']:.2f}\n", flush=True)
        print(f"{args.seconds:g} s per run, frame 100 ms, min slot 2048 us, random weights")
        print(f"{'tenants':>7} {'share err pp':>12} {'switch loss':>11} {'switch/s':>8} "
              f"{'latency p50/p99 us':>18} {'lateness p50/p99 us':>19} "
              f"{'module off p50/p99 us':>21} {'daemon CPU ms/s':>15}")
        for n in (int(x) for x in args.tenants.split(",")):
            r = run(n, args.seconds, args.warmup, rng)
            lat, late, off = r["latency"], r["lateness"], r["module_off"]
            print(f"{n:>7} {r['share_err_pp']:>12.2f} {r['loss']:>11.2%} "
                  f"{r['switches_s']:>8.0f} "
                  f"{lat.get('p50', 0):>8.0f} / {lat.get('p99', 0):>7.0f} "  # type: ignore[union-attr]
                  f"{late.get('p50', 0):>9.0f} / {late.get('p99', 0):>7.0f} "  # type: ignore[union-attr]
                  f"{off.get('p50', 0):>11.1f} / {off.get('p99', 0):>7.1f} "  # type: ignore[union-attr]
                  f"{r['cpu_ms_s']:>15.1f}", flush=True)
    finally:
        sh("rmmod", "vgpu")
        sh("rmmod", "nvsim")


if __name__ == "__main__":
    main()
