"""What the test simulator (kmod/nvsim) models, read from its C sources.

The replay report marks the escapes, classes and controls a trace uses that
nvsim does not model. The sets come from nvsim's own tables (its dispatch
switch, class and control tables), so they cannot drift from the simulator;
tests/unit/test_nvtrace_check.py pins that they are found. This reads source
files of the repository only: nothing of vgpud depends on nvsim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_SRC", "NvsimModel", "read_nvsim"]

# This checkout's simulator (tools/nvtrace/ -> the repository root).
DEFAULT_SRC = Path(__file__).resolve().parents[2] / "kmod" / "nvsim"
# The NVIDIA ABI nvsim shares with vgpu, beside nvsim's own header.
_ABI_HEADERS = ("../include/nvidia/nv_ioctl.h", "../include/nvidia/nv_rm.h",
                "../include/nvidia/nv_status.h", "nvsim.h")

_DEFINE = re.compile(r"^#define\s+(\w+)\s+(0x[0-9a-fA-F]+|\d+)\b", re.M)
_CASE = re.compile(r"\bcase\s+(\w+)\s*:")
_ENTRY = re.compile(r"\{\s*(\w+)\s*,")


@dataclass(frozen=True, slots=True)
class NvsimModel:
    escapes: frozenset[int]
    alloc_classes: frozenset[int]  # RM_ALLOC
    alloc_memory_classes: frozenset[int]  # RM_ALLOC_MEMORY
    controls: frozenset[int]
    uvm: frozenset[int]


def _body(text: str, start: str) -> str:
    """From the line holding ``start`` to the next line that is only ``}`` or ``};``."""
    at = text.find(start)
    if at < 0:
        raise ValueError(f"nvsim source: {start!r} not found")
    end = re.compile(r"^\};?$", re.M).search(text, at)
    if end is None:
        raise ValueError(f"nvsim source: no end after {start!r}")
    return text[at:end.start()]


def _values(names: list[str], defines: dict[str, int], what: str) -> frozenset[int]:
    missing = [n for n in names if n not in defines]
    if missing or not names:
        raise ValueError(f"nvsim source: {what}: unknown names {missing} (of {names})")
    return frozenset(defines[n] for n in names)


def read_nvsim(src: Path = DEFAULT_SRC) -> NvsimModel:
    """The simulator's tables; ValueError when the sources do not have them."""
    try:
        abi = "\n".join((src / name).read_text() for name in _ABI_HEADERS)
        ioctl = (src / "ioctl.c").read_text()
        objects = (src / "objects.c").read_text()
    except OSError as exc:
        raise ValueError(f"nvsim sources not readable: {exc}") from exc
    defines = {m.group(1): int(m.group(2), 0) for m in _DEFINE.finditer(abi)}
    escapes = _CASE.findall(_body(ioctl, "nvsim_dispatch(struct file"))
    if "NV_ESC_IOCTL_XFER_CMD" in _body(ioctl, "long nvsim_ioctl("):
        escapes.append("NV_ESC_IOCTL_XFER_CMD")
    uvm = re.findall(r"cmd\s*!=\s*(\w+)", _body(ioctl, "nvsim_uvm_ioctl(struct"))
    classes = _ENTRY.findall(_body(objects, "nvsim_classes[] = {"))
    classes += re.findall(r"h_class\s*==\s*(\w+)", _body(objects, "int nvsim_rm_alloc(struct"))
    memory = re.findall(r"h_class\s*!=\s*(\w+)",
                        _body(objects, "int nvsim_rm_alloc_memory(struct"))
    controls = _ENTRY.findall(_body(objects, "nvsim_ctrls[] = {"))
    return NvsimModel(
        escapes=_values(escapes, defines, "escapes"),
        alloc_classes=_values(classes, defines, "classes"),
        alloc_memory_classes=_values(memory, defines, "RM_ALLOC_MEMORY classes"),
        controls=_values(controls, defines, "controls"),
        uvm=_values(uvm, defines, "uvm commands"),
    )
