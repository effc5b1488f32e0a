"""uapi.py struct layouts agree with gcc's reading of the header, field by field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.layouts import c_layouts, needs_gcc, py_layouts
from vgpud.kernel import uapi

# Pinned on this side too, so that a change on both sides still shows up.
SIZES = {"vgpu_rule": 160, "vgpu_upcall": 80, "vgpu_verdict": 32, "vgpu_event": 32,
         "vgpu_stats": 120, "vgpu_mmap_params": 24, "vgpu_context": 40,
         "vgpu_sched": 24, "vgpu_sched_result": 8, "vgpu_opener": 16,
         "vgpu_rule_nested": 24, "vgpu_obj_op": 24, "vgpu_obj_result": 16,
         "vgpu_stats4": 64}


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
