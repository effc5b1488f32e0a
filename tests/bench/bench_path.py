"""Benchmark of the interception path, run inside the VM (scripts/bench-vm).

Loads nvsim and vgpu, then measures in one boot, with ioctl_lat interleaving
the two nodes it compares so that both see the same noise:

1. fast path: an RM_CONTROL through /dev/vgpu/nvidiactl (no rule matches)
   against the same call straight on /dev/nvsim/nvidiactl; the same wrapped
   in IOCTL_XFER_CMD (the driver gets the module's copy of the wrapper); an
   RM_CONTROL on the escape a rule selects, with a key no rule matches (the
   driver gets the module's checked copy of the params);
2. slow path: the same call selected by a rule, so that each call is an
   upcall, a verdict and a forward; answered by the minimal C responder
   (tests/support/c_responder.c), by the same with the rule asking for shadow
   calls (VGPU_RULE_F_SHADOW: the module's own cost of the checked copy), by
   the floor of a Python responder (tests/bench/py_responder.py: blocking
   recv, struct) and by vgpud. The figure of merit is the ratio vgpud / C
   responder at p50 and p99;
3. allocation round trip: a 1 MiB memory allocation and its free through
   vgpud's slow path, against the same pair straight on nvsim; class 0x3F
   plain and class 0x40 with shadow calls, interleaved call by call;
4. FB_GET_INFO (v1, its list behind a pointer) of a tenant with a limit
   through vgpud's quota policy (the module copies the list up as DATA2 and
   writes the REPLY's back: no process_vm_*), against the same call straight
   on nvsim.
5. the driver-truth check: the same round trip through vgpud's quota policy,
   which answers the allocation with ALLOW + POST and, on its POST upcall,
   asks the driver for the object's class, parent and size (VGPU_CMD_OBJECT)
   before its verdict, against the vgpud+shadow figure of 3 (one upcall and a
   POST event): the difference is the truth check's cost per allocation.

Prints a table of figures; asserts nothing (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as a script: the repository root on sys.path, for tests.support.
sys.path.insert(0, str(ROOT))

from tests.support import nvclient as nv  # noqa: E402
from tests.support.vgpud_proc import TEST_DAEMON, Daemon  # noqa: E402

CTRL = 0xDEAD0001  # a control id no driver knows: the driver's answer is cheap
CTRL_MISS = 0xDEAD0002  # another: on an escape with a rule, but no rule's key
LINE = re.compile(r"^(\S+)\s+p50\s+(\d+) ns\s+p90\s+(\d+) ns\s+p99\s+(\d+) ns\s+mean\s+(\d+)")


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def build(tmp: Path) -> tuple[Path, Path]:
    inc = ROOT / "kmod/include/uapi"
    lat, resp = tmp / "ioctl_lat", tmp / "c_responder"
    sh("gcc", "-O2", "-o", str(lat), str(ROOT / "tests/bench/ioctl_lat.c"))
    sh("gcc", "-O2", f"-I{inc}", "-o", str(resp), str(ROOT / "tests/support/c_responder.c"))
    return lat, resp


def measure(lat: Path, rounds: int, calls: int, xfer: bool = False,
            ctrl: int = CTRL) -> dict[str, tuple[int, int, int, int]]:
    out = sh(str(lat), "/dev/nvsim/nvidiactl", "/dev/vgpu/nvidiactl", str(rounds), str(calls),
             hex(ctrl), *(["xfer"] if xfer else []))
    figures = {}
    for line in out.splitlines():
        m = LINE.match(line)
        if m:
            figures[m.group(1)] = tuple(int(v) for v in m.groups()[1:])
    return figures


def wait_ready(proc: subprocess.Popen[str], what: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "ready" not in line:
        raise SystemExit(f"{what} did not start: {line!r}")


PLAIN, SHADOW = 0x3F, 0x40  # both device memory: one filtered plain, one with shadow calls


def alloc_free_ns(nodes: nv.NvNodes, count: int) -> dict[int, list[int]]:
    """Sorted round-trip times per class, the classes interleaved."""
    ctl = nodes.open_ctl()
    try:
        tree = nv.build_tree(ctl)
        times: dict[int, list[int]] = {PLAIN: [], SHADOW: []}
        for _ in range(count):
            for hclass, out in times.items():
                t0 = time.perf_counter_ns()
                r = nv.alloc_memory(ctl, tree.client, tree.device, 1 << 20, hclass=hclass)
                nv.must(nv.rm_free(ctl, tree.client, tree.device, r.handle), "free")
                out.append(time.perf_counter_ns() - t0)
                nv.must(r, "alloc")
        return {hclass: sorted(out) for hclass, out in times.items()}
    finally:
        os.close(ctl)


def miss_path(lat: Path, resp: Path, rule: str, args: argparse.Namespace) -> None:
    """An RM_CONTROL on an escape some rule selects, whose key no rule matches:
    the module copies the params, matches none, and forwards its checked copy."""
    c = subprocess.Popen([str(resp), "-f", rule], stdout=subprocess.PIPE, text=True)
    try:
        wait_ready(c, "c_responder")
        figures = measure(lat, args.rounds, args.fast_calls, ctrl=CTRL_MISS)
    finally:
        c.terminate()
        c.wait()
    direct, via = figures["/dev/nvsim/nvidiactl"], figures["/dev/vgpu/nvidiactl"]
    print("escape with a rule, no rule's key matches (forwarded on the checked copy)")
    print(f"  direct nvsim  p50 {direct[0]:7d} ns  p99 {direct[2]:7d} ns")
    print(f"  via vgpu      p50 {via[0]:7d} ns  p99 {via[2]:7d} ns")
    print(f"  ratio p50 {via[0] / direct[0]:.3f}  (target <= 1.3)\n")


def fb_v1_ns(nodes: nv.NvNodes, count: int) -> tuple[list[int], dict[int, int]]:
    """Sorted FB_GET_INFO (v1) times and the last answer (index -> KiB)."""
    ctl = nodes.open_ctl()
    try:
        tree = nv.build_tree(ctl)
        out: list[int] = []
        vals: dict[int, int] = {}
        for _ in range(count):
            t0 = time.perf_counter_ns()
            e, st, vals = nv.fb_get_info(ctl, tree.client, tree.subdevice,
                                         [nv.FB_HEAP_SIZE, nv.FB_HEAP_FREE])
            out.append(time.perf_counter_ns() - t0)
            if e or st:
                raise RuntimeError(f"FB_GET_INFO: errno {e}, status {st:#x}")
        return sorted(out), vals
    finally:
        os.close(ctl)


def fb_v1_path(tmp: Path, count: int) -> None:
    """FB_GET_INFO v1 of a 1 GiB tenant (uid 0) through vgpud, against nvsim."""
    config = tmp / "vgpud.toml"
    config.write_text(f'[daemon]\nstate_path = "{tmp / "state.json"}"\n'
                      f'charges_path = "{tmp / "charges"}"\n\n'
                      '[[tenant]]\nname = "bench"\nmemory = "1GiB"\nmatch = [{ uid = 0 }]\n')
    direct, _ = fb_v1_ns(nv.NvNodes("/dev/nvsim"), count)
    d = Daemon("--config", str(config), "--no-dbus", log_level="warning").start()
    try:
        via, vals = fb_v1_ns(nv.NvNodes("/dev/vgpu"), count)
    finally:
        d.stop()
    print("FB_GET_INFO v1 (list behind a pointer; IOCTL + POST upcall, REPLY DATA2)")
    print(f"  direct nvsim  p50 {pct(direct, .5):9d} ns  p99 {pct(direct, .99):9d} ns")
    print(f"  via vgpud     p50 {pct(via, .5):9d} ns  p99 {pct(via, .99):9d} ns"
          f"  (the tenant saw HEAP_SIZE {vals.get(nv.FB_HEAP_SIZE)} KiB)")
    print(f"  ratio p50 {pct(via, .5) / pct(direct, .5):.2f}\n")


def pct(values: list[int], p: float) -> int:
    return values[min(len(values) - 1, int(len(values) * p))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--fast-calls", type=int, default=5000)
    ap.add_argument("--slow-calls", type=int, default=300)
    ap.add_argument("--allocs", type=int, default=300)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--fb-calls", type=int, default=300)
    ap.add_argument("--only-fb", action="store_true", help="the FB_GET_INFO v1 case alone")
    args = ap.parse_args()

    sh("insmod", str(ROOT / "kmod/nvsim/nvsim.ko"), "gpus=1", "mem_mib=4096")
    sh("insmod", str(ROOT / "kmod/vgpu/vgpu.ko"), "backing_dir=/dev/nvsim",
       "backing_driver=nvsim", "backing_uvm_driver=nvsim")
    tmp = Path(tempfile.mkdtemp())
    lat, resp = build(tmp)
    rule = f"ctl:0x2a:0:8:-:-:{CTRL:#x}"
    print(f"kernel {os.uname().release}, {os.cpu_count()} vCPUs (TCG)\n")
    if args.only_fb:
        fb_v1_path(tmp, args.fb_calls)
        sh("rmmod", "vgpu")
        sh("rmmod", "nvsim")
        return

    fast = measure(lat, args.rounds, args.fast_calls)
    direct, via = fast["/dev/nvsim/nvidiactl"], fast["/dev/vgpu/nvidiactl"]
    print("fast path (RM_CONTROL, no rule matches)")
    print(f"  direct nvsim  p50 {direct[0]:7d} ns  p99 {direct[2]:7d} ns")
    print(f"  via vgpu      p50 {via[0]:7d} ns  p99 {via[2]:7d} ns")
    print(f"  ratio p50 {via[0] / direct[0]:.3f}  (target <= 1.05)")
    fast = measure(lat, args.rounds, args.fast_calls, xfer=True)
    direct, via = fast["/dev/nvsim/nvidiactl"], fast["/dev/vgpu/nvidiactl"]
    print(f"  XFER direct   p50 {direct[0]:7d} ns  p99 {direct[2]:7d} ns")
    print(f"  XFER via vgpu p50 {via[0]:7d} ns  p99 {via[2]:7d} ns  (a copy of the wrapper)")
    print(f"  ratio p50 {via[0] / direct[0]:.3f}\n")
    miss_path(lat, resp, rule, args)

    # The responders take turns, `--turns` times, so that a slow phase of the
    # (noisy, shared) host hits them alike; each figure is the median over the
    # turns of that turn's p50 / p99.
    runs: dict[str, list[tuple[int, int, int, int]]] = {}
    per_turn = max(1, args.rounds // args.turns)
    vg_alloc: dict[int, list[int]] = {}
    for _ in range(args.turns):
        for name, flags in (("C responder", ()), ("C + shadow", ("-W",))):
            c = subprocess.Popen([str(resp), "-f", rule, *flags], stdout=subprocess.PIPE,
                                 text=True)
            try:
                wait_ready(c, "c_responder")
                runs.setdefault(name, []).append(
                    measure(lat, per_turn, args.slow_calls)["/dev/vgpu/nvidiactl"])
            finally:
                c.terminate()
                c.wait()
        py = subprocess.Popen([sys.executable, str(ROOT / "tests/bench/py_responder.py"),
                               f"control:{CTRL:#x}"], stdout=subprocess.PIPE, text=True)
        try:
            wait_ready(py, "py_responder")
            runs.setdefault("Python floor", []).append(
                measure(lat, per_turn, args.slow_calls)["/dev/vgpu/nvidiactl"])
        finally:
            py.terminate()
            py.wait()
        d = Daemon("--filter", f"control:{CTRL:#x}", "--filter", f"alloc:{PLAIN:#x}",
                   "--filter", f"alloc+shadow:{SHADOW:#x}", log_level="warning",
                   entry=TEST_DAEMON).start()
        try:
            runs.setdefault("vgpud", []).append(
                measure(lat, per_turn, args.slow_calls)["/dev/vgpu/nvidiactl"])
            if not vg_alloc:
                vg_alloc = alloc_free_ns(nv.NvNodes("/dev/vgpu"), args.allocs)
        finally:
            d.stop()
    slow = {name: tuple(int(statistics.median(r[i] for r in turns)) for i in range(4))
            for name, turns in runs.items()}
    print(f"slow path (rule matches: upcall, verdict ALLOW, forward; median of {args.turns}"
          " turns)")
    for name, (p50, _p90, p99, _mean) in slow.items():
        print(f"  {name:12s}  p50 {p50:7d} ns  p99 {p99:7d} ns")
    cr, pf, vg = slow["C responder"], slow["Python floor"], slow["vgpud"]
    print(f"  ratio vgpud / C responder: p50 {vg[0] / cr[0]:.2f}, p99 {vg[2] / cr[2]:.2f}"
          "  (target <= 1.6)")
    print(f"  ratio Python floor / C responder: p50 {pf[0] / cr[0]:.2f}, p99 {pf[2] / cr[2]:.2f}")
    print(f"  ratio vgpud / Python floor: p50 {vg[0] / pf[0]:.2f}, p99 {vg[2] / pf[2]:.2f}")
    cs = slow["C + shadow"]
    print(f"  shadow call cost (C + shadow - C responder): p50 {cs[0] - cr[0]} ns, "
          f"p99 {cs[2] - cr[2]} ns\n")

    direct = alloc_free_ns(nv.NvNodes("/dev/nvsim"), args.allocs)[PLAIN]
    plain, shadow = vg_alloc[PLAIN], vg_alloc[SHADOW]
    print("allocation round trip (1 MiB alloc + free, Python client, the alloc upcalled)")
    print(f"  direct nvsim  p50 {pct(direct, .5):9d} ns  p99 {pct(direct, .99):9d} ns")
    print(f"  via vgpud     p50 {pct(plain, .5):9d} ns  p99 {pct(plain, .99):9d} ns")
    print(f"  vgpud+shadow  p50 {pct(shadow, .5):9d} ns  p99 {pct(shadow, .99):9d} ns")
    print(f"  ratio p50 {pct(plain, .5) / pct(direct, .5):.2f}, with shadow "
          f"{pct(shadow, .5) / pct(direct, .5):.2f}\n")
    fb_v1_path(tmp, args.fb_calls)

    truth = truth_ns(args.allocs)
    print("driver-truth check (1 MiB alloc + free through the quota policy: POST upcall "
          "and OBJECT)")
    print(f"  vgpud quota   p50 {pct(truth, .5):9d} ns  p99 {pct(truth, .99):9d} ns")
    print(f"  truth check (quota - vgpud+shadow): p50 {pct(truth, .5) - pct(shadow, .5)} ns, "
          f"p99 {pct(truth, .99) - pct(shadow, .99)} ns; ratio to direct p50 "
          f"{pct(truth, .5) / pct(direct, .5):.2f}")

    sh("rmmod", "vgpu")
    sh("rmmod", "nvsim")


def truth_ns(count: int) -> list[int]:
    """Round trips of class 0x40 through vgpud's quota policy (root a tenant)."""
    d_dir = Path(tempfile.mkdtemp())
    config = d_dir / "vgpud.toml"
    config.write_text(f'[daemon]\nstate_path = "{d_dir / "state.json"}"\n'
                      f'charges_path = "{d_dir / "charges"}"\n\n'
                      '[[tenant]]\nname = "bench"\nmemory = "2GiB"\nmatch = [{ uid = 0 }]\n')
    d = Daemon("--config", str(config), "--no-dbus", log_level="warning").start()
    try:
        return alloc_free_ns(nv.NvNodes("/dev/vgpu"), count)[SHADOW]
    finally:
        d.stop()


if __name__ == "__main__":
    main()
