"""The GPUs this node has: (index, name, total bytes) for the Manager's ledger,
and what names them outside vgpud (UUID, PCI bus id) for the metrics and the
file view.

Two sources behind one function, ``discover()``:
- nvsim (tests): when the vgpu module's backing_dir
  (/sys/module/vgpu/parameters/backing_dir) is not /dev and the nvsim module
  is loaded, its GPUs are /sys/module/nvsim/parameters/gpus devices of
  mem_mib MiB each, named "nvsim".
- NVML (nvidia-ml-py) on real hosts: every device nvmlDeviceGetCount reports,
  by NVML index, with its name, total memory, UUID and PCI bus id (nvsim's
  have neither: the views name them by index).
When neither answers, the inventory is empty: the daemon runs, but tenants get
no memory accounts (every charged allocation is refused) until it restarts
with GPUs; the log says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["GpuInfo", "discover", "from_nvml", "from_nvsim"]

log = logging.getLogger(__name__)

SYS_MODULE = Path("/sys/module")
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
MIB = 1 << 20


class GpuInfo(NamedTuple):
    number: int  # the NVML index, the N of /dev/nvidiaN
    name: str
    total: int  # bytes
    uuid: str = ""  # GPU-..., "" when unknown (nvsim)
    bus_id: str = ""  # PCI domain:bus:device.function, lower case; "" when unknown


def import_nvml() -> Any:
    """pynvml (nvidia-ml-py), imported on first use rather than at the top: only
    hosts without nvsim need it, and it costs about 200 ms and 3 MiB to load."""
    import pynvml

    return pynvml


def _param(sys_module: Path, module: str, name: str) -> str | None:
    try:
        return (sys_module / module / "parameters" / name).read_text().strip()
    except OSError:
        return None


def from_nvsim(sys_module: Path = SYS_MODULE) -> list[GpuInfo] | None:
    """The nvsim GPUs, or None when vgpu is not backed by a loaded nvsim."""
    backing = _param(sys_module, "vgpu", "backing_dir")
    gpus = _param(sys_module, "nvsim", "gpus")
    mem_mib = _param(sys_module, "nvsim", "mem_mib")
    if backing is None or backing.rstrip("/") == "/dev" or gpus is None or mem_mib is None:
        return None
    try:
        count, mib = int(gpus), int(mem_mib)
    except ValueError:
        log.warning("nvsim parameters unreadable: gpus=%r mem_mib=%r", gpus, mem_mib)
        return None
    log.info("inventory: %d nvsim GPUs of %d MiB (vgpu backing_dir %s)", count, mib, backing)
    return [GpuInfo(i, "nvsim", mib * MIB) for i in range(count)]


def from_nvml(nvml: Any = None) -> list[GpuInfo]:
    """The NVML devices; empty (with a clear log line) when NVML cannot answer."""
    if nvml is None:
        try:
            nvml = import_nvml()
        except ImportError:
            log.warning("inventory: nvidia-ml-py (pynvml) is not installed: no GPUs")
            return []
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        value = getattr(exc, "value", None)
        if value == NVML_ERROR_LIBRARY_NOT_FOUND:
            log.warning("inventory: NVML library (libnvidia-ml.so.1) not found: no GPUs")
        elif value == NVML_ERROR_DRIVER_NOT_LOADED:
            log.warning("inventory: NVIDIA driver not loaded (NVML): no GPUs")
        else:
            log.warning("inventory: NVML init failed: %s: no GPUs", exc)
        return []
    try:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = _text(nvml.nvmlDeviceGetName(handle))
            gpus.append(GpuInfo(i, name, int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                                _text(nvml.nvmlDeviceGetUUID(handle)),
                                _bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))))
        log.info("inventory: %d GPUs from NVML", len(gpus))
        return gpus
    except nvml.NVMLError as exc:
        log.warning("inventory: NVML query failed: %s: no GPUs", exc)
        return []
    finally:
        with suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _bus_id(nvml_bus_id: str) -> str:
    """NVML's bus id has an 8-digit domain (00000000:17:00.0); the kernel's
    (and the dmem controller's) has 4: 0000:17:00.0."""
    domain, sep, rest = nvml_bus_id.lower().partition(":")
    return f"{domain[-4:]}:{rest}" if sep and len(domain) >= 4 else nvml_bus_id.lower()


def discover(
    sys_module: Path = SYS_MODULE, nvml: Callable[[], list[GpuInfo]] = from_nvml,
) -> list[GpuInfo]:
    """nvsim when vgpu is backed by it, else NVML."""
    sim = from_nvsim(sys_module)
    return sim if sim is not None else nvml()
