"""scripts/gpu-check without a GPU (the dry run), its summary of a GPU run, and
the PyTorch probe's verdicts against a stand-in torch."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
import gpu_probe  # noqa: E402

GIB = 1 << 30


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a GPU is here: not a dry run")
def test_dry_run(tmp_path: Path) -> None:
    res = subprocess.run([str(ROOT / "scripts/gpu-check")],
                         env={**os.environ, "OUT": str(tmp_path)}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["check.json", "check.txt", "facts.json", "log.txt", "quota.txt",
                     "summary.txt"]
    summary = (tmp_path / "summary.txt").read_text()
    assert summary == res.stdout
    assert "DRY RUN: no NVIDIA GPU here" in summary
    assert len(summary.splitlines()) <= 40
    facts = json.loads((tmp_path / "facts.json").read_text())
    assert set(facts["modules"]) >= {"modules_disabled", "build_dir", "can_build_and_load"}
    assert facts["nodes"] == []
    check = json.loads((tmp_path / "check.json").read_text())
    assert check["data"]["ok"] is True  # the recorded traces, replayed here
    assert "check data: PASS" in summary
    assert "record-dry       ok" in summary and "quota            skip" in summary


def fake_facts() -> dict:
    return {
        "uname": "Linux gpu 6.18.44-fc x86_64", "driver_proc": "NVRM version: 580.159.04",
        "modules": {"can_build_and_load": False, "why_not": ["no CAP_SYS_MODULE"],
                    "nvidia_in_proc_modules": True, "nvidia_initstate": "live"},
        "nodes": [{"path": "/dev/nvidiactl", "major": 195, "minor": 255, "mode": "0o666"}],
        "nvml": {"driver": "580.159.04", "cuda_driver": 13000,
                 "inventory": [[0, "NVIDIA H200", 150 * GIB]],
                 "devices": [{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-1",
                              "memory": {"total": 150 * GIB}, "mig_mode": [0, 0],
                              "accounting_mode": 0, "process_utilization": {"error": "x"}}]},
        "python": {"version": "3.12.3", "modules": {"torch": "2.11.0",
                                                    "pydantic": {"error": "missing"}}},
    }


def test_summary_of_a_gpu_run(tmp_path: Path) -> None:
    (tmp_path / "facts.json").write_text(json.dumps(fake_facts()))
    check = {"probe-torch": {"ok": True, "mem_get_info": [1, 2]},
             "torch": {"ok": False, "calls": 900, "decoded": 700, "unknown": {"X": 200},
                       "findings": ["torch-1.nvtrace#42: escape 0x2b: size"],
                       "ledger": None, "ledger_skipped": "no pydantic"},
             "smi": {"ok": True, "calls": 50, "decoded": 40, "unknown": {}, "findings": [],
                     "ledger": [{"held_end": 0, "ledger_end": 0}], "ledger_skipped": None}}
    (tmp_path / "check.json").write_text(json.dumps(check))
    (tmp_path / "quota.txt").write_text("vgpu loaded over /dev\nprogram exit status 0; its "
                                        "output:\n{\"ok\": true, \"got_1g\": true}\n")
    steps = tmp_path / "steps.tsv"
    steps.write_text("recorder\tok\t1\t\ntrace-torch\tok\t30\t\nquota\tskip\t0\tno modules\n")
    assert gpu_check.summary(tmp_path, steps) == 0
    text = (tmp_path / "summary.txt").read_text()
    assert "DRY RUN" not in text
    assert "driver: NVRM version: 580.159.04" in text
    assert "nodes: nvidiactl 195:255 0o666" in text
    assert "GPU 0 NVIDIA H200 GPU-1" in text and "MIG [0, 0]" in text
    assert "check torch: FAIL 900 calls, 700 decoded, 200 not decoded, 1 findings" in text
    assert "torch-1.nvtrace#42" in text
    assert "check smi: PASS" in text
    assert "missing ['pydantic']" in text
    assert 'torch program: {"ok": true, "mem_get_info": [1, 2]}' in text
    assert "quota: program exit status 0" in text
    assert 'quota program: {"ok": true, "got_1g": true}' in text


class OutOfMemoryError(RuntimeError):
    pass


class FakeTorch:
    """Enough of torch for the probe: ``budget`` bytes of device memory."""

    uint8 = "uint8"

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self.cuda = SimpleNamespace(
            init=lambda: None, current_device=lambda: 0, get_device_name=lambda d: "Fake",
            synchronize=lambda: None, mem_get_info=lambda: (self.budget - self.used,
                                                            self.budget),
            memory_allocated=lambda: self.used, empty_cache=lambda: None,
            OutOfMemoryError=OutOfMemoryError)

    def empty(self, n: int, dtype: str, device: str) -> SimpleNamespace:
        if self.used + n > self.budget:
            raise OutOfMemoryError(f"tried to allocate {n}")
        self.used += n
        return SimpleNamespace(fill_=lambda v: None)

    def randn(self, *shape: int, device: str) -> FakeTensor:
        return FakeTensor()

    def isfinite(self, t: FakeTensor) -> FakeTensor:
        return t


class FakeTensor:
    def __matmul__(self, other: FakeTensor) -> FakeTensor:
        return self

    def all(self) -> FakeTensor:
        return self

    def item(self) -> bool:
        return True


def test_torch_probe_asks_for_more_than_the_gpu_holds() -> None:
    out = gpu_probe.torch_run(FakeTorch(4 * GIB))
    assert out["oom_over_total"] is True and out["ok"] is True
    assert "tried to allocate 5368709120" in out["error_over_total"]


def test_quota_probe_verdicts() -> None:
    assert gpu_probe.quota_run(FakeTorch(2 * GIB))["ok"] is True  # 1 GiB fits, 3 more do not
    assert gpu_probe.quota_run(FakeTorch(512 << 20))["ok"] is False  # not even 1 GiB
    assert gpu_probe.quota_run(FakeTorch(8 * GIB))["ok"] is False  # no quota at all


class FakeCuda:
    """Enough of libcuda's driver API for the sizes probe: memory taken in
    2 MiB pages from ``total`` bytes. Out-parameters arrive as ctypes.byref."""

    PAGE = 2 << 20

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0
        self.live: dict[int, int] = {}

    def cuInit(self, flags: int) -> int:
        return 0

    def cuDeviceGet(self, dev: Any, ordinal: int) -> int:
        return 0

    def cuDevicePrimaryCtxRetain(self, ctx: Any, dev: Any) -> int:
        return 0

    def cuCtxSetCurrent(self, ctx: Any) -> int:
        return 0

    def cuMemGetInfo_v2(self, free: Any, total: Any) -> int:
        free._obj.value, total._obj.value = self.total - self.used, self.total
        return 0

    def cuMemAlloc_v2(self, ptr: Any, size: ctypes.c_size_t) -> int:
        took = -(-size.value // self.PAGE) * self.PAGE
        if self.used + took > self.total:
            return gpu_probe.CUDA_ERROR_OUT_OF_MEMORY
        self.used += took
        ptr._obj.value = 0x1000 + len(self.live)
        self.live[ptr._obj.value] = took
        return 0

    def cuMemFree_v2(self, ptr: ctypes.c_uint64) -> int:
        self.used -= self.live.pop(ptr.value)
        return 0

    # The virtual memory API: a handle holds the memory until released.
    def cuMemGetAllocationGranularity(self, gran: Any, prop: Any, option: int) -> int:
        gran._obj.value = self.PAGE
        return 0

    def cuMemCreate(self, handle: Any, size: ctypes.c_size_t, prop: Any,
                    flags: ctypes.c_uint64) -> int:
        assert prop._obj.type == 1 and prop._obj.location.type == 1  # pinned, on device 0
        return self.cuMemAlloc_v2(handle, size)

    def cuMemRelease(self, handle: ctypes.c_uint64) -> int:
        return self.cuMemFree_v2(handle)

    def cuMemAddressReserve(self, va: Any, *rest: Any) -> int:
        va._obj.value = 0x7F0000000000
        return 0

    def cuMemMap(self, *args: Any) -> int:
        return 0

    cuMemSetAccess = cuMemUnmap = cuMemAddressFree = cuMemMap


def test_sizes_probe_reports_what_each_size_takes() -> None:
    cuda = FakeCuda(8 * GIB)
    out = gpu_probe.sizes_run(cuda)
    assert out["ok"] is True and out["rc_over_total"] == gpu_probe.CUDA_ERROR_OUT_OF_MEMORY
    took = {a["size"]: a["took"] for a in out["allocs"]}
    assert took[4096] == 2 << 20 and took[(2 << 20) + 1] == 4 << 20 and took[GIB] == GIB
    assert cuda.used == 0  # every allocation freed
    assert gpu_probe.sizes_run(FakeCuda(GIB))["ok"] is False  # 1 GiB did not fit


def test_vmm_probe_reports_what_create_and_map_take() -> None:
    cuda = FakeCuda(8 * GIB)
    out = gpu_probe.vmm_run(cuda)
    assert out["ok"] is True and out["size"] == gpu_probe.VMM_SIZE
    assert out["took_create"] == out["took_mapped"] == gpu_probe.VMM_SIZE
    assert out["left_after"] == 0 and cuda.used == 0
