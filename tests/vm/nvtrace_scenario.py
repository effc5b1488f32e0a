"""tests' own NVIDIA client (tests/support/nvclient.py) through a varied run, for the recorder.

    python tests/vm/nvtrace_scenario.py NODEDIR

Opens NODEDIR's nodes and makes the calls a CUDA program's start-up and
allocations are made of (OS escapes, a client tree, memory of each path,
XFER-wrapped and NVOS64 allocs, views, a dup, a mapping, a channel group and
its controls, calls the driver refuses, threads, a forked child, nvidia-uvm),
then exits holding some memory. Prints one JSON line of what it saw
({"client", "held", "statuses"}) for the test to hold the trace against.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support import nvclient as nv

MIB = 1 << 20


def child(nodes: nv.NvNodes) -> None:
    """A forked process with a client of its own; exits holding 2 MiB."""
    ctl = nodes.open_ctl()
    t = nv.build_tree(ctl)
    nv.must(nv.alloc_memory(ctl, t.client, t.device, 2 * MIB), "child alloc")
    os._exit(0)


def memory(ctl: int, t: nv.Tree, statuses: list[int]) -> int:
    """Allocations of each path and size; returns the bytes left allocated."""
    m1 = nv.must(nv.alloc_memory(ctl, t.client, t.device, 64 * MIB), "alloc 64M").handle
    nv.must(nv.alloc_memory(ctl, t.client, t.device, 4 * MIB, size64=True, xfer=True),
            "alloc 4M")
    nv.must(nv.alloc_memory(ctl, t.client, t.subdevice, 8 * MIB,
                            hclass=nv.NV01_MEMORY_LOCAL_PRIVILEGED), "alloc 8M")
    e, st, h, _ = nv.vid_heap_alloc(ctl, t.client, t.device, 2 * MIB)
    nv.must((e, st), "vid heap alloc")
    nv.must(nv.vid_heap_free(ctl, t.client, t.device, h), "vid heap free")
    e, st, _ = nv.rm_dup_object(ctl, t.client, t.device, 0, t.client, m1)
    nv.must((e, st), "dup")
    nv.must(nv.rm_free(ctl, t.client, t.device, m1), "free m1")  # the dup keeps it
    big = nv.alloc_memory(ctl, t.client, t.device, 1 << 40)  # refused: no memory
    statuses.append(big.status)
    statuses.append(nv.rm_free(ctl, t.client, t.device, 0xBAD0)[1])  # unknown handle
    return (64 + 4 + 8) * MIB


def mapping(ctl: int, gpu: int, t: nv.Tree) -> int:
    """RM_ALLOC_MEMORY on the GPU node, a mapping of device memory, its unmap."""
    e, st, _, _ = nv.rm_alloc_memory(gpu, t.client, t.device, 0, nv.NV01_MEMORY_LOCAL_USER,
                                     4 * MIB, fd=gpu)
    nv.must((e, st), "alloc memory")
    hm = nv.must(nv.alloc_memory(ctl, t.client, t.device, 64 * 1024), "alloc 64K").handle
    r, m = nv.map_and_mmap(ctl, gpu, t.client, t.device, hm, 64 * 1024)
    m[:4] = b"nvtr"
    m.close()
    nv.must(nv.rm_unmap_memory(ctl, t.client, t.device, hm, r.address), "unmap")
    return 4 * MIB + 64 * 1024


def views_and_groups(ctl: int, t: nv.Tree) -> None:
    nv.must(nv.fb_get_info_v2(ctl, t.client, t.subdevice, [nv.FB_HEAP_FREE, nv.FB_RAM_SIZE],
                              xfer=True), "fb info")
    nv.must(nv.vid_heap(ctl, t.client, t.device, nv.NVOS32_FUNCTION_INFO), "heap info")
    group = nv.alloc_channel_group(ctl, t.client, t.device)
    nv.must(nv.set_timeslice(ctl, t.client, group, 2000), "timeslice")
    nv.must(nv.gpfifo_schedule(ctl, t.client, group, True), "schedule")

    def queries() -> None:
        for _ in range(20):
            nv.must(nv.fb_get_info_v2(ctl, t.client, t.subdevice, [nv.FB_HEAP_FREE]), "fb")

    threads = [threading.Thread(target=queries) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def main() -> None:
    nodes = nv.NvNodes(sys.argv[1])
    ctl = nodes.open_ctl()
    statuses: list[int] = []
    assert nv.check_version(ctl)[0] == 0
    assert nv.card_info(ctl)[0] == 0
    t = nv.build_tree(ctl)
    gpu = nodes.open_gpu(0)
    assert nv.register_fd(gpu, ctl) == 0
    held = memory(ctl, t, statuses) + mapping(ctl, gpu, t)
    views_and_groups(ctl, t)
    # A params block of a size no escape has: the driver refuses it (EINVAL).
    statuses.append(nv.nv_ioctl(ctl, nv.ESC_RM_ALLOC, nv.cbuf(40)))
    uvm = nodes.open_uvm()
    nv.must(nv.uvm_initialize(uvm), "uvm init")
    pid = os.fork()
    if pid == 0:
        child(nodes)
    os.waitpid(pid, 0)
    print(json.dumps({"client": t.client, "held": held, "statuses": statuses}), flush=True)
    os._exit(0)  # with its files open: the memory is held at the end of the trace


if __name__ == "__main__":
    main()
