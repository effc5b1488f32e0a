"""Benchmark of the file view (vgpud.fsview); prints figures, asserts nothing.

In the VM as root (kmod built): nvsim + vgpu + vgpud --config with the view
mounted, 8 tenants (uids 1000..1007). A reader opens, reads and closes
tenants/t0/dmem.current in a loop, first with the GPU idle, then while each
of the 8 tenants runs a process that allocates and frees 1 MiB as fast as it
can (each allocation and free moves the tenant's usage: a snapshot rebuild).
Prints the read's p50 and p99 in each phase, and how many allocations the
tenants made.

With --host (anywhere, as root with /dev/fuse): no kernel module; FsView over
a Manager on an event loop in a thread, as in the daemon, with 8 tenants
whose usage the loop moves (reserve, commit, free and the Manager's
notification, as an upcall does) as fast as it can in the second phase. This
isolates the view's own cost from TCG.

    scripts/vm-run -- python tests/bench/bench_fsview.py [--seconds 20]
    .venv/bin/python tests/bench/bench_fsview.py --host
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script: tests.support on the path

from tests.support.contexts import open_context, usage_changed  # noqa: E402
from tests.support.vgpud_proc import Daemon  # noqa: E402
from vgpud.admin.manager import Manager  # noqa: E402
from vgpud.core.ledger import Key, Ledger, Reservation  # noqa: E402
from vgpud.fsview.service import FsView  # noqa: E402
from vgpud.store.config import FsSettings, load_config  # noqa: E402
from vgpud.store.state import load_state  # noqa: E402

TENANTS = 8
T = TypeVar("T")
ALLOCATOR = """
import sys, time
from tests.support import nvclient as nv
ctl = nv.NvNodes("/dev/vgpu").open_ctl()
tree = nv.build_tree(ctl)
end, n = time.monotonic() + float(sys.argv[1]), 0
while time.monotonic() < end:
    r = nv.alloc_memory(ctl, tree.client, tree.device, 1 << 20)
    nv.must(r, "alloc")
    nv.must(nv.rm_free(ctl, tree.client, tree.device, r.handle), "free")
    n += 1
print(n)
"""


def pct(values: list[int], p: float) -> int:
    return values[min(len(values) - 1, int(len(values) * p))]


def reads_ns(path: Path, seconds: float) -> list[int]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter_ns()
        with open(path, "rb", buffering=0) as f:
            f.read(4096)
        out.append(time.perf_counter_ns() - t0)
    return sorted(out)


def show(name: str, ns: list[int]) -> None:
    print(f"  {name:28} p50 {pct(ns, .5) / 1000:8.1f} us  p99 {pct(ns, .99) / 1000:8.1f} us"
          f"  ({len(ns)} reads)")


def config_text(tmp: Path) -> str:
    return (f'[daemon]\nstate_path = "{tmp / "state.json"}"\ncharges_path = "{tmp / "charges"}"\n'
            f'[fs]\nmountpoint = "{tmp / "fs"}"\n'
            + "".join(f'[[tenant]]\nname = "t{i}"\nmemory = "1GiB"\n'
                      f'match = [{{ uid = {1000 + i} }}]\n' for i in range(TENANTS)))


class NoShares:
    def share(self, tenant: str) -> dict[int, float]:
        return {}

    def measured_share(self, tenant: str) -> dict[int, float]:
        return {}


async def churn(manager: Manager, ledger: Ledger, stop: asyncio.Event) -> int:
    """Move the tenants' usage as upcalls do, yielding to the loop between them."""
    n = 0
    for i in range(TENANTS):
        open_context(manager, ledger, i + 1, f"t{i}")
    while not stop.is_set():
        for i in range(TENANTS):
            r = ledger.reserve(i + 1, 0, 1 << 20)
            assert isinstance(r, Reservation)
            ledger.commit(r, Key(i + 1, n + 1))
            usage_changed(manager, f"t{i}")
            ledger.free(Key(i + 1, n + 1))
            usage_changed(manager, f"t{i}")
            n += 1
            await asyncio.sleep(0)
    return n


def host(seconds: float) -> None:
    import threading

    tmp = Path(tempfile.mkdtemp())
    (tmp / "vgpud.toml").write_text(config_text(tmp))
    config = load_config(tmp / "vgpud.toml")
    ledger = Ledger()
    manager = Manager(tmp / "vgpud.toml", config, load_state(config.daemon.state_path), ledger,
                      [(0, "sim", 16 << 30)])
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def on_loop(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    view = FsView(manager, ledger, NoShares(), FsSettings(mountpoint=tmp / "fs"))
    manager.observers.subscribe(view)
    assert on_loop(view.start())
    path = tmp / "fs" / "tenants" / "t0" / "dmem.current"
    try:
        print(f"host kernel {os.uname().release}, {os.cpu_count()} CPUs; FUSE read of "
              "dmem.current (open + read + close), no TCG")
        reads_ns(path, 1.0)
        show("idle", reads_ns(path, seconds))
        stop = asyncio.Event()
        running = asyncio.run_coroutine_threadsafe(churn(manager, ledger, stop), loop)
        busy = reads_ns(path, seconds)
        loop.call_soon_threadsafe(stop.set)
        changes = running.result()
        show(f"{TENANTS} tenants' usage moving", busy)
        print(f"  usage changes meanwhile: {2 * changes} ({2 * changes / seconds:.0f}/s)")
    finally:
        on_loop(view.stop())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    ap.add_argument("--host", action="store_true", help="the view alone, without the VM")
    args = ap.parse_args()
    if args.host:
        host(args.seconds)
        return
    subprocess.run(["modprobe", "fuse"], check=True)
    subprocess.run(["insmod", str(ROOT / "kmod/nvsim/nvsim.ko"), "gpus=1", "mem_mib=16384"],
                   check=True)
    subprocess.run(["insmod", str(ROOT / "kmod/vgpu/vgpu.ko"), "backing_dir=/dev/nvsim",
                    "backing_driver=nvsim", "backing_uvm_driver=nvsim"], check=True)
    tmp = Path(tempfile.mkdtemp())
    config = tmp / "vgpud.toml"
    config.write_text(config_text(tmp))
    daemon = Daemon("--config", str(config), "--no-dbus", log_level="warning", fs=True).start()
    path = tmp / "fs" / "tenants" / "t0" / "dmem.current"
    try:
        deadline = time.monotonic() + 180
        while not path.exists():  # the view is mounted after READY=1
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.2)
        print(f"kernel {os.uname().release}, {os.cpu_count()} CPUs; "
              f"FUSE read of dmem.current (open + read + close)")
        reads_ns(path, 1.0)  # warm up
        show("idle", reads_ns(path, args.seconds))
        workers = [subprocess.Popen(
            ["setpriv", f"--reuid={1000 + i}", f"--regid={1000 + i}", "--clear-groups",
             sys.executable, "-c", ALLOCATOR, str(args.seconds + 5)], cwd=ROOT,
            stdout=subprocess.PIPE, text=True) for i in range(TENANTS)]
        time.sleep(3)  # let them all start allocating (Python starts slowly under TCG)
        busy = reads_ns(path, args.seconds)
        counts = [int(w.communicate(timeout=600)[0] or 0) for w in workers]
        show(f"{TENANTS} tenants allocating", busy)
        print(f"  allocations + frees meanwhile: {sum(counts)} ({counts})")
    finally:
        daemon.stop()
        subprocess.run(["rmmod", "vgpu"], check=False)
        subprocess.run(["rmmod", "nvsim"], check=False)


if __name__ == "__main__":
    main()
