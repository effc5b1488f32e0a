"""uapi.py struct layouts agree with gcc's reading of the header, field by field."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from vgpud.kernel import uapi

ROOT = Path(__file__).resolve().parents[2]
UAPI_DIR = ROOT / "kmod/include/uapi"

# Pinned on this side too, so that a change on both sides still shows up.
SIZES = {"vgpu_rule": 160, "vgpu_upcall": 80, "vgpu_verdict": 32, "vgpu_event": 32,
         "vgpu_stats": 120, "vgpu_mmap_params": 24, "vgpu_context": 40,
         "vgpu_sched": 24, "vgpu_sched_result": 8, "vgpu_opener": 16,
         "vgpu_rule_nested": 24, "vgpu_obj_op": 24, "vgpu_obj_result": 16,
         "vgpu_stats4": 64}


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


@needs_gcc
def test_layouts_match_gcc(tmp_path: Path) -> None:
    assert py_layouts(uapi.LAYOUTS) == c_layouts(tmp_path, "linux/vgpu.h", uapi.LAYOUTS)


def test_sizes_pinned() -> None:
    assert {lay.name: lay.size for lay in uapi.LAYOUTS} == SIZES


def test_rule_pack_round_trip() -> None:
    rule = uapi.Rule(1, 0x2B, 32, 12, 16, 24, (0x40, 0x3F))
    packed = rule.pack()
    assert len(packed) == 160
    assert uapi.Rule.unpack(packed) == rule


@pytest.mark.parametrize(("post", "shadow", "flags"), [
    (False, False, 0), (True, False, uapi.RULE_F_POST), (False, True, uapi.RULE_F_SHADOW),
    (True, True, uapi.RULE_F_POST | uapi.RULE_F_SHADOW),
])
def test_rule_flags_round_trip(post: bool, shadow: bool, flags: int) -> None:
    rule = uapi.Rule(1, 0x2B, 32, 12, 16, 24, (0x40,), post=post, shadow=shadow)
    packed = rule.pack()
    assert uapi.RULE.struct.unpack(packed)[7] == flags
    assert uapi.Rule.unpack(packed) == rule


def test_shadow_rule_on_uvm_needs_a_size() -> None:
    with pytest.raises(ValueError, match="size"):
        uapi.Rule(1 << uapi.Node.UVM, 1, 0, shadow=True)
    assert uapi.Rule(1 << uapi.Node.UVM, 1, 16, shadow=True).shadow
