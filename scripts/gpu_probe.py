"""The small PyTorch program scripts/gpu-check records and runs under a quota.

    python3 scripts/gpu_probe.py torch    init, 1 GiB, a matmul, mem_get_info, a free
    python3 scripts/gpu_probe.py quota    1 GiB must fit, then 3 GiB must not

Prints one JSON line of what it saw (also to $GPU_PROBE_OUT if set); exits 0
when the run went as it should (quota: the 1 GiB allocation succeeded and the
3 GiB one raised torch.cuda.OutOfMemoryError), 1 otherwise.
"""

from __future__ import annotations

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
    out["ok"] = out["matmul_finite"]
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


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "torch"
    try:
        torch = importlib.import_module("torch")
    except ImportError as exc:
        print(json.dumps({"ok": False, "error": f"no torch: {exc}"}))
        return 1
    try:
        out = quota_run(torch) if mode == "quota" else torch_run(torch)
    except Exception as exc:  # the summary reports what broke, whatever it is
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    line = json.dumps(out)
    print(line, flush=True)
    if os.environ.get("GPU_PROBE_OUT"):
        Path(os.environ["GPU_PROBE_OUT"]).write_text(line + "\n")
    return 0 if out.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
