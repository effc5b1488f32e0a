"""The small PyTorch program scripts/gpu-check records and runs under a quota.

    python3 scripts/gpu_probe.py torch    init, 1 GiB, a matmul, mem_get_info, a free,
                                          then more than the GPU holds (the driver's OOM)
    python3 scripts/gpu_probe.py quota    1 GiB must fit, then 3 GiB must not
    python3 scripts/gpu_probe.py sizes    cuMemAlloc of odd sizes (libcuda, no torch): what
                                          each takes from the GPU (item 8: the driver's rounding)

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


def sizes_run(cuda: Any) -> dict[str, Any]:
    """cuMemAlloc of each of SIZES, with the free memory cuMemGetInfo reports
    before and after: what each size takes from the GPU. Then an allocation
    of twice the GPU's memory, which must fail with CUDA_ERROR_OUT_OF_MEMORY."""
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    rc = cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0) or \
        cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) or cuda.cuCtxSetCurrent(ctx)
    if rc:
        return {"ok": False, "error": f"CUDA init: CUresult {rc}"}
    allocs, ptrs = [], []
    for size in SIZES:
        cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        before, ptr = free.value, ctypes.c_uint64()
        rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size))
        cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        allocs.append({"size": size, "rc": rc, "took": before - free.value})
        if not rc:
            ptrs.append(ptr.value)
    for p in ptrs:
        cuda.cuMemFree_v2(ctypes.c_uint64(p))
    huge = ctypes.c_uint64()
    rc_huge = cuda.cuMemAlloc_v2(ctypes.byref(huge), ctypes.c_size_t(2 * total.value))
    if not rc_huge:
        cuda.cuMemFree_v2(huge)
    return {"allocs": allocs, "total": total.value, "rc_over_total": rc_huge,
            "ok": all(a["rc"] == 0 for a in allocs) and rc_huge == CUDA_ERROR_OUT_OF_MEMORY}


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "torch"
    if mode == "sizes":
        try:
            out = sizes_run(ctypes.CDLL("libcuda.so.1"))
        except OSError as exc:
            out = {"ok": False, "error": f"no libcuda: {exc}"}
        return report(out)
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
