"""Struct layouts checked against gcc: a C program prints sizeof/offsetof of every
field of a set of Python layouts (vgpud.kernel.uapi, vgpud.nvidia.layouts)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UAPI_DIR = ROOT / "kmod/include/uapi"


def run_c(tmp_path: Path, source: str, include: Path = UAPI_DIR) -> dict[str, int]:
    """Compile and run a C program whose lines print `name value`."""
    src = tmp_path / "layout.c"
    src.write_text(source)
    exe = tmp_path / "layout"
    subprocess.run(["gcc", "-Wall", "-Werror", f"-I{include}", "-o", exe, src], check=True)
    out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def c_layouts(tmp_path: Path, header: str, layouts, prelude: str = "") -> dict[str, int]:
    """Compile and run a program printing sizeof/offsetof for every field."""
    lines = [f"#include <{header}>" if header else "", "#include <stdio.h>",
             "#include <stddef.h>", prelude, "int main(void) {"]
    for lay in layouts:
        tag = lay.name if lay.name.isupper() or lay.name.startswith("nv_") else f"struct {lay.name}"
        lines.append(f'printf("{lay.name} %zu\\n", sizeof({tag}));')
        for fld in lay.offsets:
            lines.append(f'printf("{lay.name}.{fld} %zu\\n", offsetof({tag}, {fld}));')
    lines += ["return 0; }"]
    return run_c(tmp_path, "\n".join(lines))


def py_layouts(layouts) -> dict[str, int]:
    out = {}
    for lay in layouts:
        out[lay.name] = lay.size
        out.update({f"{lay.name}.{f}": off for f, off in lay.offsets.items()})
    return out


needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
