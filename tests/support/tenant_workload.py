"""A tenant's GPU workload, as a process of its own (demo and VM tests).

    python -m tests.support.tenant_workload NODEDIR alloc SIZE COUNT [--hold]
    python -m tests.support.tenant_workload NODEDIR fbinfo | fbinfo1 | heapinfo
    python -m tests.support.tenant_workload NODEDIR compute SECONDS

(from the repository root; `command()` gives that argv, to run with cwd=ROOT).

`alloc` opens the node directory's nvidiactl, builds a client/device/subdevice
tree on GPU 0 and allocates COUNT blocks of SIZE (MiB units: 256MiB) of local
video memory, printing one JSON line per allocation ({"i", "errno",
"status"}); with --hold it then prints "holding" and waits for a line on
stdin before closing. `fbinfo` prints the FB_GET_INFO_V2 figures the tenant
sees (KiB), `fbinfo1` the same through the legacy FB_GET_INFO (its list in
our memory), `heapinfo` RM_VID_HEAP_CONTROL INFO's total, free and largest
free block (bytes). `compute` allocates a channel group, prints whether it
was scheduled when its alloc returned ({"client", "group", "enabled"}), keeps
40 ms or more of simulated work pending on it (nvsim's work engine) for
SECONDS, and prints the GPU time it got ({"busy_ns"}). An open refused by the
daemon prints {"open_errno": N}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tests.support import nvclient as nv


def command(*args: str) -> list[str]:
    """The argv that runs this workload; run it with the repository root as cwd."""
    return [sys.executable, "-m", "tests.support.tenant_workload", *args]


FB_INDICES = {"ram_size": 7, "total_ram_size": 8, "heap_size": 9, "heap_free": 0x16,
              "usable_ram_size": 0x20}


def mib(text: str) -> int:
    if not text.endswith("MiB"):
        raise argparse.ArgumentTypeError("SIZE is in MiB: 256MiB")
    return int(text[:-3]) << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("nodedir")
    sub = ap.add_subparsers(dest="what", required=True)
    alloc = sub.add_parser("alloc")
    alloc.add_argument("size", type=mib)
    alloc.add_argument("count", type=int)
    alloc.add_argument("--hold", action="store_true")
    for what in ("fbinfo", "fbinfo1", "heapinfo"):
        sub.add_parser(what)
    sub.add_parser("compute").add_argument("seconds", type=float)
    args = ap.parse_args()

    try:
        ctl = nv.NvNodes(args.nodedir).open_ctl()
    except OSError as exc:
        print(json.dumps({"open_errno": exc.errno}), flush=True)
        return
    tree = nv.build_tree(ctl)
    if args.what in ("fbinfo", "fbinfo1"):
        query = nv.fb_get_info_v2 if args.what == "fbinfo" else nv.fb_get_info
        e, st, vals = query(ctl, tree.client, tree.subdevice, list(FB_INDICES.values()))
        print(json.dumps({"errno": e, "status": st,
                          **{k: vals[i] for k, i in FB_INDICES.items()}}), flush=True)
        return
    if args.what == "heapinfo":
        e, st, head, data = nv.vid_heap(ctl, tree.client, tree.device, nv.NVOS32_FUNCTION_INFO)
        _attr, _offset, largest, _base = nv.NVOS32_INFO.unpack_from(data)
        print(json.dumps({"errno": e, "status": st, **head, "largest": largest}), flush=True)
        return
    if args.what == "compute":
        compute(ctl, tree, args.seconds)
        return
    for i in range(args.count):
        r = nv.alloc_memory(ctl, tree.client, tree.device, args.size)
        print(json.dumps({"i": i, "errno": r.errno, "status": r.status}), flush=True)
    if args.hold:
        print("holding", flush=True)
        sys.stdin.readline()
    os.close(ctl)


def compute(ctl: int, tree: nv.Tree, seconds: float) -> None:
    group = nv.alloc_channel_group(ctl, tree.client, tree.device)
    stats = nv.work_stats(ctl, tree.client, group)[2]
    print(json.dumps({"client": tree.client, "group": group,
                      "enabled": stats is not None and stats.enabled}), flush=True)
    target = 40_000_000  # ns of work kept pending
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        stats = nv.work_stats(ctl, tree.client, group)[2]
        if stats is not None and stats.pending_ns < target:
            nv.submit_work(ctl, tree.client, group, 2 * target - stats.pending_ns)
        time.sleep(0.01)
    stats = nv.work_stats(ctl, tree.client, group)[2]
    print(json.dumps({"busy_ns": stats.busy_ns if stats else None}), flush=True)
    os.close(ctl)


if __name__ == "__main__":
    main()
