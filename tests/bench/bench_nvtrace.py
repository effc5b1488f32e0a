"""Benchmark of the recorder (libnvtrace.so), run inside the VM:

    scripts/vm-run -- python tests/bench/bench_nvtrace.py

The fast-path ioctl (an RM_CONTROL that no rule selects, through
/dev/vgpu/nvidiactl, and the same straight on /dev/nvsim/nvidiactl), timed
per call by tests/bench/ioctl_lat.c with the recorder off and on, the runs
alternating (--turns) so that the shared host's noise hits both alike; each
figure is the median over the turns of that run's p50 / p99. Also the same
wrapped in IOCTL_XFER_CMD (the recorder then copies the payload too), and
the bytes the recorder writes per call. Prints a table; asserts nothing
(docs/performance.md keeps the figures).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "tools/nvtrace/libnvtrace.so"
NODES = ("/dev/nvsim/nvidiactl", "/dev/vgpu/nvidiactl")
CTRL = 0xDEAD0001  # a control no driver knows: its answer is cheap
LINE = re.compile(r"^(\S+)\s+p50\s+(\d+) ns\s+p90\s+(\d+) ns\s+p99\s+(\d+) ns")


def sh(*cmd: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout


def run(lat: Path, rounds: int, calls: int, xfer: bool, out: Path | None) -> dict[str, tuple]:
    """One ioctl_lat run; out: the recorder's folder (None: recorder off)."""
    env = dict(os.environ)
    if out is not None:
        env |= {"LD_PRELOAD": str(LIB), "NVTRACE_DIR": str(out),
                "NVTRACE_PREFIXES": "/dev/nvsim/:/dev/vgpu/"}
    text = sh(str(lat), *NODES, str(rounds), str(calls), hex(CTRL), *(["xfer"] if xfer else []),
              env=env)
    figures = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            figures[m.group(1)] = (int(m.group(2)), int(m.group(4)))
    return figures


def compare(lat: Path, tmp: Path, args: argparse.Namespace, xfer: bool) -> None:
    off: dict[str, list[tuple]] = {n: [] for n in NODES}
    on: dict[str, list[tuple]] = {n: [] for n in NODES}
    per_call = []
    for turn in range(args.turns):
        for n, fig in run(lat, args.rounds, args.calls, xfer, None).items():
            off[n].append(fig)
        out = tmp / f"trace-{xfer}-{turn}"
        out.mkdir()
        for n, fig in run(lat, args.rounds, args.calls, xfer, out).items():
            on[n].append(fig)
        size = sum(p.stat().st_size for p in out.iterdir())
        per_call.append(size / (2 * args.rounds * args.calls))
        for p in out.iterdir():
            p.unlink()
    label = "XFER-wrapped " if xfer else ""
    for n in NODES:
        p50_off = statistics.median(f[0] for f in off[n])
        p50_on = statistics.median(f[0] for f in on[n])
        p99_off = statistics.median(f[1] for f in off[n])
        p99_on = statistics.median(f[1] for f in on[n])
        print(f"  {label}{n:<22} off p50 {p50_off:7.0f} p99 {p99_off:7.0f} ns | on p50 "
              f"{p50_on:7.0f} p99 {p99_on:7.0f} ns | ratio p50 {p50_on / p50_off:5.2f} "
              f"p99 {p99_on / p99_off:5.2f}")
    print(f"  {label}trace bytes per call: {statistics.median(per_call):.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args()
    sh("make", "-s", "-C", str(LIB.parent))
    sh("insmod", str(ROOT / "kmod/nvsim/nvsim.ko"), "gpus=1", "mem_mib=1024")
    sh("insmod", str(ROOT / "kmod/vgpu/vgpu.ko"), "backing_dir=/dev/nvsim",
       "backing_driver=nvsim", "backing_uvm_driver=nvsim")
    try:
        tmp = Path(tempfile.mkdtemp())
        lat = tmp / "ioctl_lat"
        sh("gcc", "-O2", "-o", str(lat), str(ROOT / "tests/bench/ioctl_lat.c"))
        print(f"kernel {os.uname().release}, {os.cpu_count()} vCPUs; {args.turns} turns of "
              f"{args.rounds} x {args.calls} calls per node, recorder off then on")
        print("fast path (RM_CONTROL, no rule, no daemon), per call:")
        compare(lat, tmp, args, xfer=False)
        compare(lat, tmp, args, xfer=True)
    finally:
        sh("rmmod", "vgpu")
        sh("rmmod", "nvsim")


if __name__ == "__main__":
    main()
