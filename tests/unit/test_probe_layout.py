"""ebpf/vgpu_latency.h against vgpud/probes/layout.py: the same numbers and key."""

from __future__ import annotations

import re
from pathlib import Path

from vgpud.nvidia.escapes import UvmCmd
from vgpud.probes import layout

HEADER = Path(__file__).resolve().parents[2] / "ebpf" / "vgpu_latency.h"


def defines() -> dict[str, str]:
    text = HEADER.read_text()
    name = r"VGPU_LAT_\w+(?:\([^)]*\))?"
    return dict(re.findall(rf"^#define\s+({name})\s+(.+?)\s*(?:/\*.*)?$", text, re.M))


def test_numbers_match_the_header() -> None:
    d = defines()
    for name in ("TOTAL", "UPCALL", "DRIVER", "SWITCH", "SLOT", "SLOTS", "STAT_DROPPED",
                 "STAT_N"):
        assert int(d[f"VGPU_LAT_{name}"], 0) == getattr(layout, f"LAT_{name}"), name
    assert d["VGPU_LAT_UVM"] == "(1U << 31)" and layout.LAT_UVM == 1 << 31
    assert int(d["VGPU_LAT_NR_OTHER"], 0) == layout.LAT_NR_OTHER
    assert int(d["VGPU_LAT_UVM_INITIALIZE"], 0) == UvmCmd.INITIALIZE
    assert "0xffffffff00000000ULL" in d["VGPU_LAT_CALL_UPCALL(kind)"]
    assert layout.CALL_UPCALL == 0xFFFFFFFF00000000
    assert set(layout.HISTOGRAMS) == {layout.LAT_TOTAL, layout.LAT_UPCALL, layout.LAT_DRIVER,
                                      layout.LAT_SWITCH, layout.LAT_SLOT}
    assert layout.LAT_SLOTS == 65  # bpf_log2l of a u64: 0..64


def test_call_encoding_matches_the_macro() -> None:
    assert "(((__u64)(key) << 32) | (__u32)(nr))" in defines()["VGPU_LAT_CALL(nr, key)"]
    assert layout.lat_call(0x2B, 0x40) == 0x40_0000_002B
    assert layout.lat_call(0x2B, 0xFFFF_FFFF) >> 32 == 0xFFFF_FFFF


def test_key_is_three_u64_in_order() -> None:
    body = re.search(r"struct vgpu_lat_key \{(.*?)\};", HEADER.read_text(), re.S)
    assert body is not None
    fields = re.findall(r"(\w+)\s+(\w+);", body.group(1))
    assert fields == [("__u64", f) for f in layout.KEY_FIELDS]


def test_value_is_the_buckets_then_the_sum() -> None:
    body = re.search(r"struct vgpu_lat_val \{(.*?)\};", HEADER.read_text(), re.S)
    assert body is not None
    assert re.findall(r"(\w+)\s+(\w+(?:\[\w+\])?);", body.group(1)) == [
        ("__u64", "slots[VGPU_LAT_SLOTS]"), ("__u64", "sum_ns")]
