"""Scheduling accuracy of nvsim's work engine, run inside the VM.

    scripts/vm-run -- python tests/bench/bench_engine.py [--seconds 3]

Loads nvsim (2 GPUs) unless it is loaded, then measures over windows of
real time with saturated channel groups (10 s of work queued each):

- equal shares: N groups with the default 1024 us slice on one GPU; the
  share error (percentage points from 1/N, worst group), the time lost
  (1 - the groups' busy time / wall time), switches per second against
  one per slice, and the mean slice actually run;
- weighted: 2048 us against 1024 us, the busy ratio (ideal 2);
- two GPUs at once, two groups each: share error and busy fraction per GPU;
- the time lost each time a group's work runs out before its slice ends
  (engine idle until the kthread wakes; a disable or free loses none: the
  caller starts the next group itself).

Prints a table; asserts nothing (figures go to docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as a script: the repository root on sys.path, for tests.support.
sys.path.insert(0, str(ROOT))

from tests.support import nvclient as nv  # noqa: E402

SEC = 1_000_000_000
MAX_PENDING = 10 * SEC


class Group:
    def __init__(self, ctl: int, gpu: int):
        t = nv.build_tree(ctl, gpu)
        self.ctl, self.client = ctl, t.client
        self.handle = nv.alloc_channel_group(ctl, t.client, t.device)

    def fill(self) -> None:
        st = nv.work_stats(self.ctl, self.client, self.handle)[2]
        assert st is not None
        if st.pending_ns < MAX_PENDING:
            nv.must(nv.submit_work(self.ctl, self.client, self.handle,
                                     MAX_PENDING - st.pending_ns), "submit")

    def busy(self) -> int:
        st = nv.work_stats(self.ctl, self.client, self.handle)[2]
        assert st is not None
        return st.busy_ns

    def enable(self, on: bool) -> None:
        nv.must(nv.gpfifo_schedule(self.ctl, self.client, self.handle, on), "schedule")

    def timeslice(self, us: int) -> None:
        nv.must(nv.set_timeslice(self.ctl, self.client, self.handle, us), "timeslice")

    def free(self) -> None:
        nv.must(nv.rm_free(self.ctl, self.client, 0, self.client), "free")


def window(groups: list[Group], seconds: float) -> tuple[list[int], dict[int, nv.ProcEngine], int]:
    """Busy deltas per group, engine deltas per GPU and the wall time (ns)."""
    for g in groups:
        g.fill()
    time.sleep(0.05)
    e0, b0, t0 = nv.proc_engines(), [g.busy() for g in groups], time.monotonic_ns()
    time.sleep(seconds)
    e1, b1, t1 = nv.proc_engines(), [g.busy() for g in groups], time.monotonic_ns()
    eng = {x.gpu: nv.ProcEngine(x.gpu, y.busy_ns - x.busy_ns, y.idle_ns - x.idle_ns,
                                y.switches - x.switches) for x, y in zip(e0, e1, strict=True)}
    return [y - x for x, y in zip(b0, b1, strict=True)], eng, t1 - t0


def equal(ctl: int, n: int, seconds: float) -> str:
    groups = [Group(ctl, 0) for _ in range(n)]
    busy, eng, wall = window(groups, seconds)
    total = sum(busy)
    err = max(abs(b / total - 1 / n) for b in busy) * 100
    e = eng[0]
    rate = e.switches / (wall / SEC)
    mean_us = total / max(e.switches, 1) / 1e3
    line = (f"| {n} equal groups, 1 GPU | {err:.2f} pp | {100 * (1 - total / wall):.2f}% | "
            f"{rate:.0f}/s ({SEC / 1024e3:.0f} ideal) | {mean_us:.0f} us |")
    for g in groups:
        g.free()
    return line


def weighted(ctl: int, seconds: float) -> str:
    a, b = Group(ctl, 0), Group(ctl, 0)
    a.timeslice(2048)
    (da, db), _, wall = window([a, b], seconds)
    a.free()
    b.free()
    return (f"| 2048 us vs 1024 us, 1 GPU | ratio {da / db:.3f} (ideal 2) | "
            f"{100 * (1 - (da + db) / wall):.2f}% | | |")


def two_gpus(ctl: int, seconds: float) -> str:
    groups = [Group(ctl, gpu) for gpu in (0, 0, 1, 1)]
    busy, _, wall = window(groups, seconds)
    cells = []
    for gpu in (0, 1):
        a, b = busy[2 * gpu], busy[2 * gpu + 1]
        cells.append(f"GPU{gpu}: {abs(a / (a + b) - 0.5) * 100:.2f} pp, "
                     f"busy {100 * (a + b) / wall:.1f}%")
    for g in groups:
        g.free()
    return f"| 2 GPUs x 2 equal groups | {'; '.join(cells)} | | | |"


def completion_gap(ctl: int, rounds: int) -> str:
    """Time lost when a group's work runs out mid-slice: the engine idles
    until its kthread wakes and starts the next group (here a saturated one)."""
    a, b = Group(ctl, 0), Group(ctl, 0)
    b.fill()
    time.sleep(0.05)
    e0 = nv.proc_engines()[0]
    for _ in range(rounds):
        nv.must(nv.submit_work(ctl, a.client, a.handle, 500_000), "submit")
        time.sleep(0.01)
    e1 = nv.proc_engines()[0]
    a.free()
    b.free()
    return (f"| a group's work runs out mid-slice ({rounds} times) | | "
            f"{(e1.idle_ns - e0.idle_ns) / rounds / 1e3:.0f} us each | | |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    loaded_here = False
    if not Path("/sys/module/nvsim").exists():
        subprocess.run(["insmod", str(ROOT / "kmod/nvsim/nvsim.ko"), "gpus=2", "mem_mib=64"],
                       check=True)
        loaded_here = True
    ctl = nv.NvNodes().open_ctl()
    try:
        print("| case | share error | time lost | switches | mean slice |")
        print("|---|---|---|---|---|")
        for n in (2, 4):
            print(equal(ctl, n, args.seconds), flush=True)
        print(weighted(ctl, args.seconds), flush=True)
        print(two_gpus(ctl, args.seconds), flush=True)
        print(completion_gap(ctl, args.rounds), flush=True)
    finally:
        os.close(ctl)
        if loaded_here:
            subprocess.run(["rmmod", "nvsim"], check=True)


if __name__ == "__main__":
    main()
