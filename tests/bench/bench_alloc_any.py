"""Benchmark of the quota policy's catch-all RM_ALLOC rule, run inside the VM
(`scripts/vm-run -- python tests/bench/bench_alloc_any.py`).

Since item 9 every RM_ALLOC goes up, so that unknown memory classes can be
refused: a class no rule names (here NV50_MEMORY_VIRTUAL, a VA range) is an
upcall and an ALLOW, and a counted one (KEPLER_CHANNEL_GROUP_A) an upcall,
an ALLOW and a POST event. Loads nvsim and vgpu, starts vgpud with one
tenant (uid 0), and times an alloc + free of each, through /dev/vgpu and
straight on /dev/nvsim, interleaved call by call (Python client).

Prints a table of figures; asserts nothing (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support import nvclient as nv  # noqa: E402
from tests.support.vgpud_proc import Daemon  # noqa: E402

CONFIG = """\
[daemon]
state_path = "{tmp}/state.json"
charges_path = "{tmp}/charges"

[[tenant]]
name = "bench"
memory = "2GiB"
match = [{{ uid = 0 }}]
"""


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def pct(values: list[int], p: float) -> int:
    return values[min(len(values) - 1, int(p * len(values)))]


def rounds(count: int) -> dict[str, dict[str, list[int]]]:
    """node -> call -> sorted round-trip times (ns), the nodes interleaved."""
    fds = {"direct": nv.NvNodes("/dev/nvsim").open_ctl(),
           "vgpud": nv.NvNodes("/dev/vgpu").open_ctl()}
    trees = {name: nv.build_tree(fd) for name, fd in fds.items()}

    def virtual(fd: int, tree: nv.Tree) -> None:
        r = nv.alloc_memory(fd, tree.client, tree.device, 1 << 20, hclass=nv.NV50_MEMORY_VIRTUAL)
        nv.must(r, "virtual alloc")
        nv.must(nv.rm_free(fd, tree.client, tree.device, r.handle), "free")

    def group(fd: int, tree: nv.Tree) -> None:
        h = nv.alloc_channel_group(fd, tree.client, tree.device)
        nv.must(nv.rm_free(fd, tree.client, tree.device, h), "free")

    calls: dict[str, Callable[[int, nv.Tree], None]] = {
        "NV50_MEMORY_VIRTUAL (catch-all)": virtual, "channel group (counted)": group}
    out: dict[str, dict[str, list[int]]] = {n: {c: [] for c in calls} for n in fds}
    try:
        for _ in range(count):
            for call, fn in calls.items():
                for name, fd in fds.items():
                    t0 = time.perf_counter_ns()
                    fn(fd, trees[name])
                    out[name][call].append(time.perf_counter_ns() - t0)
    finally:
        for fd in fds.values():
            os.close(fd)
    return {n: {c: sorted(v) for c, v in calls_.items()} for n, calls_ in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    sh("insmod", str(ROOT / "kmod/nvsim/nvsim.ko"), "gpus=1", "mem_mib=4096")
    sh("insmod", str(ROOT / "kmod/vgpu/vgpu.ko"), "backing_dir=/dev/nvsim",
       "backing_driver=nvsim", "backing_uvm_driver=nvsim")
    tmp = Path(tempfile.mkdtemp())
    (tmp / "vgpud.toml").write_text(CONFIG.format(tmp=tmp))
    print(f"kernel {os.uname().release}, {os.cpu_count()} vCPUs (TCG)\n")
    d = Daemon("--config", str(tmp / "vgpud.toml"), "--no-dbus", log_level="warning").start()
    try:
        figures = rounds(args.calls)
    finally:
        d.stop()
    print(f"RM_ALLOC + RM_FREE round trip ({args.calls} each, Python client)")
    for call in figures["direct"]:
        direct, via = figures["direct"][call], figures["vgpud"][call]
        print(f"  {call}")
        print(f"    direct nvsim  p50 {pct(direct, .5):9d} ns  p99 {pct(direct, .99):9d} ns")
        print(f"    via vgpud     p50 {pct(via, .5):9d} ns  p99 {pct(via, .99):9d} ns")
        print(f"    ratio p50 {pct(via, .5) / pct(direct, .5):.2f}, "
              f"p99 {pct(via, .99) / pct(direct, .99):.2f}")
    sh("rmmod", "vgpu")
    sh("rmmod", "nvsim")


if __name__ == "__main__":
    main()
