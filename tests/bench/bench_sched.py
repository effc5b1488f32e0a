"""Benchmark of SCHEDULE and LIST_CONTEXTS, run inside the VM:

    scripts/vm-run -- python tests/bench/bench_sched.py

Loads nvsim (1 GPU) and vgpu; one process owns 256 channel groups allocated
through /dev/vgpu/nvidiactl. Measures, in one boot:

1. the owner's own GPFIFO_SCHEDULE RM_CONTROL straight on /dev/nvsim (what
   one entry costs the driver, the floor);
2. SCHEDULE round trips through GenlChannel.schedule() (encode, sendmsg,
   the module's mapping + ioctls + reply, decode) for 1, 2 (a switch: one
   group off, one on), 16 and 256 entries;
3. LIST_CONTEXTS of 1,000 contexts (one page) and 2,000 (two pages).

Prints a table of figures; asserts nothing (see docs/performance.md).
"""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Run as a script: the repository root on sys.path, for tests.support.
sys.path.insert(0, str(ROOT))

from tests.support import nvclient as nv  # noqa: E402
from vgpud.kernel.channel import GenlChannel  # noqa: E402
from vgpud.kernel.uapi import Sched  # noqa: E402

GROUPS = 256


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def figures(samples: list[float]) -> str:
    ordered = sorted(samples)
    p50 = ordered[len(ordered) // 2]
    p99 = ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)]
    mean = statistics.mean(ordered)
    return f"p50 {p50 * 1e6:9.1f} us   p99 {p99 * 1e6:9.1f} us   mean {mean * 1e6:9.1f} us"


async def timed(call: Callable[[], Awaitable[object]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t0)
    return out


def direct(ctl: int, client: int, group: int, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        _, status, _ = nv.rm_control(ctl, client, group, nv.NVA06C_CTRL_CMD_GPFIFO_SCHEDULE,
                                     bytes([i & 1, 0, 0]))
        out.append(time.perf_counter() - t0)
        assert status == nv.NV_OK
    return out


async def bench() -> None:
    ctl_direct = os.open("/dev/nvsim/nvidiactl", os.O_RDWR)
    td = nv.build_tree(ctl_direct)
    gd = nv.rm_alloc(ctl_direct, td.client, td.device, 0, nv.KEPLER_CHANNEL_GROUP_A).handle
    floor = direct(ctl_direct, td.client, gd, 2000)
    print(f"{'GPFIFO_SCHEDULE straight on nvsim':40s} {figures(floor)}")
    os.close(ctl_direct)

    ctl = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
    t = nv.build_tree(ctl)
    groups = [nv.rm_alloc(ctl, t.client, t.device, 0, nv.KEPLER_CHANNEL_GROUP_A).handle
              for _ in range(GROUPS)]
    channel = await GenlChannel.open()
    await channel.register()
    (ctx,) = [c.ctx_id for c in await channel.list_contexts()]
    for n, reps in ((1, 2000), (2, 2000), (16, 500), (256, 100)):
        entries = [Sched(ctx, t.client, g, bool(i >= n // 2)) for i, g in enumerate(groups[:n])]
        samples = await timed(lambda entries=entries: channel.schedule(entries), reps)
        per = statistics.median(samples) / n * 1e6
        print(f"{f'SCHEDULE, {n} entries':40s} {figures(samples)}   ({per:.1f} us/entry)")

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), max(hard, 4096)))
    fds = [os.open("/dev/vgpu/nvidia-uvm", os.O_RDWR) for _ in range(999)]
    print(f"{'LIST_CONTEXTS, 1000 contexts (1 page)':40s} "
          f"{figures(await timed(channel.list_contexts, 200))}")
    fds += [os.open("/dev/vgpu/nvidia-uvm", os.O_RDWR) for _ in range(1000)]
    print(f"{'LIST_CONTEXTS, 2000 contexts (2 pages)':40s} "
          f"{figures(await timed(channel.list_contexts, 200))}")
    for fd in fds:
        os.close(fd)
    channel.close()
    os.close(ctl)


def main() -> None:
    sh("insmod", str(ROOT / "kmod/nvsim/nvsim.ko"), "gpus=1", "mem_mib=1024")
    sh("insmod", str(ROOT / "kmod/vgpu/vgpu.ko"), "backing_dir=/dev/nvsim",
       "backing_driver=nvsim", "backing_uvm_driver=nvsim")
    try:
        deadline = time.monotonic() + 5
        while not os.path.exists("/dev/vgpu/nvidiactl") and time.monotonic() < deadline:
            time.sleep(0.01)
        asyncio.run(bench())
    finally:
        sh("rmmod", "vgpu")
        sh("rmmod", "nvsim")


if __name__ == "__main__":
    main()
