"""The small PyTorch program scripts/gpu-check records and runs under a quota.

    python3 scripts/gpu_probe.py torch    init, 1 GiB, a matmul, mem_get_info, a free,
                                          then more than the GPU holds (the driver's OOM)
    python3 scripts/gpu_probe.py quota    1 GiB must fit, then 3 GiB must not
    python3 scripts/gpu_probe.py sizes    cuMemAlloc of odd sizes (libcuda, no torch): what
                                          each takes from the GPU (item 8: the driver's rounding)
    python3 scripts/gpu_probe.py vmm      cuMemCreate + cuMemMap of 64 MiB (the virtual memory
                                          API under PyTorch's expandable segments and
                                          cudaMallocAsync): which driver calls make that memory

Prints one JSON line of what it saw (also to $GPU_PROBE_OUT if set); exits 0
when the run went as it should (quota: the 1 GiB allocation succeeded and the
3 GiB one raised torch.cuda.OutOfMemoryError), 1 otherwise.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30


def torch_run(torch: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    torch.cuda.init()
    dev = torch.cuda.current_device()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(dev),
                           "init_s": round(time.monotonic() - t0, 3)}
    x = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    x.fill_(1)
    a = torch.randn(1024, 1024, device="cuda")
    b = a @ a
    torch.cuda.synchronize()
    out["matmul_finite"] = bool(torch.isfinite(b).all().item())
    out["mem_get_info"] = list(torch.cuda.mem_get_info())
    out["allocated"] = torch.cuda.memory_allocated()
    del x, a, b
    torch.cuda.empty_cache()
    out["after_free"] = list(torch.cuda.mem_get_info())
    # What a real out-of-memory looks like in the trace: the status the driver
    # answers, which a quota denial must imitate (docs/hardware.md).
    try:
        torch.empty(out["after_free"][1] + GIB, dtype=torch.uint8, device="cuda")
        out["oom_over_total"] = False
    except torch.cuda.OutOfMemoryError as exc:
        out["oom_over_total"], out["error_over_total"] = True, str(exc)[:300]
    out["ok"] = out["matmul_finite"] and out["oom_over_total"]
    return out


def quota_run(torch: Any) -> dict[str, Any]:
    torch.cuda.init()
    out: dict[str, Any] = {"mem_get_info": list(torch.cuda.mem_get_info())}
    try:
        x = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
        out["got_1g"] = True
    except torch.cuda.OutOfMemoryError as exc:
        out["got_1g"], out["error_1g"] = False, str(exc)[:300]
    try:
        y = torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")
        y.fill_(1)
        torch.cuda.synchronize()
        out["oom_3g"] = False
    except torch.cuda.OutOfMemoryError as exc:
        out["oom_3g"], out["error_3g"] = True, str(exc)[:300]
    out["ok"] = out["got_1g"] and out["oom_3g"]
    return out


# Sizes that straddle the page sizes the driver may choose (4 KiB, 64 KiB, 2 MiB).
SIZES = (4096, 64 * 1024 + 1, 2 << 20, (2 << 20) + 1, (64 << 20) + 4096, GIB)
CUDA_ERROR_OUT_OF_MEMORY = 2


def cuda_init(cuda: Any) -> int:
    """cuInit and device 0's primary context made current; the CUresult."""
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    return int(cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0) or
               cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) or
               cuda.cuCtxSetCurrent(ctx))


def mem_info(cuda: Any) -> tuple[int, int]:
    """(free, total) bytes, as cuMemGetInfo reports them."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def sizes_run(cuda: Any) -> dict[str, Any]:
    """cuMemAlloc of each of SIZES, with the free memory cuMemGetInfo reports
    before and after: what each size takes from the GPU. Then an allocation
    of twice the GPU's memory, which must fail with CUDA_ERROR_OUT_OF_MEMORY."""
    rc = cuda_init(cuda)
    if rc:
        return {"ok": False, "error": f"CUDA init: CUresult {rc}"}
    allocs, ptrs = [], []
    for size in SIZES:
        before, ptr = mem_info(cuda)[0], ctypes.c_uint64()
        rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))
        allocs.append({"size": size, "rc": rc, "took": before - mem_info(cuda)[0]})
        if not rc:
            ptrs.append(ptr.value)
    for p in ptrs:
        cuda.cuMemFree_v2(ctypes.c_uint64(p))
    huge, total = ctypes.c_uint64(), mem_info(cuda)[1]
    rc_huge = cuda.cuMemAlloc_v2(ctypes.byref(huge), ctypes.c_size_t(2 * total))
    if not rc_huge:
        cuda.cuMemFree_v2(huge)
    return {"allocs": allocs, "total": total, "rc_over_total": rc_huge,
            "ok": all(a["rc"] == 0 for a in allocs) and rc_huge == CUDA_ERROR_OUT_OF_MEMORY}


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemAllocationProp(ctypes.Structure):
    """CUmemAllocationProp (cuda.h): pinned device memory, no shareable handle."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", MemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class MemAccessDesc(ctypes.Structure):
    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE = 1, 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
VMM_SIZE = 64 << 20


def vmm_run(cuda: Any) -> dict[str, Any]:
    """cuMemCreate of VMM_SIZE (rounded to the granularity), reserved, mapped
    and made accessible, then unmapped and released: what it takes from the
    GPU at each step (cuMemGetInfo)."""
    rc = cuda_init(cuda)
    if rc:
        return {"ok": False, "error": f"CUDA init: CUresult {rc}"}
    prop = MemAllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                             location=MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, 0))
    gran, handle, va = ctypes.c_size_t(), ctypes.c_uint64(), ctypes.c_uint64()
    steps: dict[str, int] = {}
    steps["granularity"] = cuda.cuMemGetAllocationGranularity(ctypes.byref(gran),
                                                              ctypes.byref(prop), 0)
    size = ctypes.c_size_t(-(-VMM_SIZE // max(gran.value, 1)) * max(gran.value, 1))
    free0 = mem_info(cuda)[0]
    steps["create"] = cuda.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop),
                                       ctypes.c_uint64(0))
    took_create = free0 - mem_info(cuda)[0]
    steps["reserve"] = cuda.cuMemAddressReserve(ctypes.byref(va), size, ctypes.c_size_t(0),
                                                ctypes.c_uint64(0), ctypes.c_uint64(0))
    steps["map"] = cuda.cuMemMap(va, size, ctypes.c_size_t(0), handle, ctypes.c_uint64(0))
    access = MemAccessDesc(MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, 0),
                           CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    steps["access"] = cuda.cuMemSetAccess(va, size, ctypes.byref(access), ctypes.c_size_t(1))
    took_mapped = free0 - mem_info(cuda)[0]
    steps["unmap"] = cuda.cuMemUnmap(va, size)
    steps["release"] = cuda.cuMemRelease(handle)
    steps["free_va"] = cuda.cuMemAddressFree(va, size)
    return {"size": size.value, "granularity": gran.value, "took_create": took_create,
            "took_mapped": took_mapped, "left_after": free0 - mem_info(cuda)[0],
            "rc": steps, "ok": not any(steps.values())}


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "torch"
    if mode in ("sizes", "vmm"):
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            return report({"ok": False, "error": f"no libcuda: {exc}"})
        return report(sizes_run(cuda) if mode == "sizes" else vmm_run(cuda))
    try:
        torch = importlib.import_module("torch")
    except ImportError as exc:
        print(json.dumps({"ok": False, "error": f"no torch: {exc}"}))
        return 1
    try:
        out = quota_run(torch) if mode == "quota" else torch_run(torch)
    except Exception as exc:  # the summary reports what broke, whatever it is
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    return report(out)


def report(out: dict[str, Any]) -> int:
    line = json.dumps(out)
    print(line, flush=True)
    if os.environ.get("GPU_PROBE_OUT"):
        Path(os.environ["GPU_PROBE_OUT"]).write_text(line + "\n")
    return 0 if out.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
