"""Inventory: nvsim from sysfs parameters, NVML through a stand-in module."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from vgpud.host.inventory import GpuInfo, discover, from_nvml, from_nvsim


def sysfs(tmp: Path, **params: str) -> Path:
    for key, value in params.items():
        module, name = key.split("__")
        d = tmp / module / "parameters"
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(value + "\n")
    return tmp


def test_nvsim(tmp_path: Path) -> None:
    root = sysfs(tmp_path, vgpu__backing_dir="/dev/nvsim", nvsim__gpus="2",
                 nvsim__mem_mib="4096")
    assert from_nvsim(root) == [GpuInfo(0, "nvsim", 4 << 30), GpuInfo(1, "nvsim", 4 << 30)]
    assert discover(root, nvml=lambda: pytest.fail("NVML asked")) == from_nvsim(root)


def test_real_backing_uses_nvml(tmp_path: Path) -> None:
    root = sysfs(tmp_path, vgpu__backing_dir="/dev", nvsim__gpus="2", nvsim__mem_mib="1")
    assert from_nvsim(root) is None
    assert discover(root, nvml=lambda: [GpuInfo(0, "H200", 1)]) == [GpuInfo(0, "H200", 1)]


class FakeNvml:
    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"nvml error {value}")
            self.value = value

    def __init__(self, init_error: int | None = None) -> None:
        self.init_error = init_error
        self.shut = False

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str | bytes:
        return b"NVIDIA H200" if h else "NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(total=(h + 1) << 30)

    def nvmlDeviceGetUUID(self, h: int) -> str | bytes:
        return b"GPU-0b" if h else "GPU-0a"

    def nvmlDeviceGetPciInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(busId=b"00000000:1B:00.0" if h else "00000001:17:00.0")


def test_nvml_devices() -> None:
    nvml = FakeNvml()
    assert from_nvml(nvml) == [GpuInfo(0, "NVIDIA H200", 1 << 30, "GPU-0a", "0001:17:00.0"),
                               GpuInfo(1, "NVIDIA H200", 2 << 30, "GPU-0b", "0000:1b:00.0")]
    assert nvml.shut


@pytest.mark.parametrize(("value", "text"), [(12, "library (libnvidia-ml.so.1) not found"),
                                             (9, "driver not loaded"), (3, "init failed")])
def test_nvml_absent_is_logged(value: int, text: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    assert from_nvml(FakeNvml(value)) == []
    assert any(text in m for m in caplog.messages)
