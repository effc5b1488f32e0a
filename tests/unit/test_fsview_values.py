"""The file view's pure parts: what each file says, and what a write means."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpud.fsview.render import TENANT_FILES, WRITABLE, render_gpus, render_tenant_file
from vgpud.fsview.snapshot import ContextView, GpuView, Snapshot, TenantView, device_name
from vgpud.fsview.values import MAX_WRITE, parse_write

GIB = 2**30
GPUS = (GpuView(0, "NVIDIA H100 80GB HBM3", 80 * GIB, device_name(0, "0000:1B:00.0")),
        GpuView(1, "nvsim", 16 * GIB, device_name(1)))
REGIONS = frozenset(g.region for g in GPUS)


ALICE = TenantView(
    "alice", limits=(None, 0), current=(4096, 0), peak=(8192, 0), weight=300, cap=None,
    priority="best-effort", share={0: 62.5}, measured={0: 61.04},
    contexts=(ContextView(7, 100, 99, 1000, 0, 4096), ContextView(8, None, None, None, None, 0)))


def snapshot(**fields: Any) -> Snapshot:
    return Snapshot.of(GPUS, [replace(ALICE, **fields)])


def text(snap: Snapshot, name: str) -> str:
    return render_tenant_file(snap, "alice", name).decode()


def test_region_names_follow_the_dmem_controller() -> None:
    assert [g.region for g in GPUS] == ["nvidia/0000:1b:00.0/vidmem", "nvidia/gpu1/vidmem"]


def test_dmem_files_have_one_line_per_region() -> None:
    snap = snapshot()
    assert text(snap, "dmem.max") == "nvidia/0000:1b:00.0/vidmem max\nnvidia/gpu1/vidmem 0\n"
    assert text(snap, "dmem.current") == (
        "nvidia/0000:1b:00.0/vidmem 4096\nnvidia/gpu1/vidmem 0\n")
    assert text(snap, "dmem.peak") == "nvidia/0000:1b:00.0/vidmem 8192\nnvidia/gpu1/vidmem 0\n"
    assert text(snap, "dmem.capacity") == (
        f"nvidia/0000:1b:00.0/vidmem {80 * GIB}\nnvidia/gpu1/vidmem {16 * GIB}\n")


def test_gpu_files() -> None:
    snap = snapshot()
    assert text(snap, "gpu.weight") == "300\n"
    assert text(snap, "gpu.max") == "max\n"
    assert text(snapshot(cap=40), "gpu.max") == "40\n"
    assert text(snap, "gpu.priority") == "best-effort\n"
    assert text(snap, "gpu.share") == ("nvidia/0000:1b:00.0 target=62.5 measured=61.0\n"
                                       "nvidia/gpu1 target=0.0 measured=0.0\n")


def test_contexts_and_gpus() -> None:
    assert text(snapshot(), "contexts") == (
        "ctx=7 pid=100 tgid=99 uid=1000 gpu=0 bytes=4096\n"
        "ctx=8 pid=- tgid=- uid=- gpu=- bytes=0\n")
    assert render_gpus(snapshot()).decode() == (
        f"nvidia/0000:1b:00.0 index=0 total={80 * GIB} name=NVIDIA H100 80GB HBM3\n"
        f"nvidia/gpu1 index=1 total={16 * GIB} name=nvsim\n")


def test_writable_files_exist() -> None:
    assert set(TENANT_FILES) >= WRITABLE == {"dmem.max", "gpu.weight", "gpu.max"}


@pytest.mark.parametrize(("name", "data", "changes"), [
    ("dmem.max", b"1073741824\n", {"memory": 2**30}),
    ("dmem.max", b"max", {"memory": None}),
    ("dmem.max", b"nvidia/gpu1/vidmem 4096\n", {"memory": 4096}),
    ("dmem.max", b"nvidia/0000:1b:00.0/vidmem max\nnvidia/gpu1/vidmem max\n", {"memory": None}),
    ("gpu.weight", b"  500 \n", {"weight": 500}),
    ("gpu.weight", b"0\n", {"weight": 0}),  # the range is the Manager's to check
    ("gpu.max", b"max\n", {"cap": None}),
    ("gpu.max", b"25", {"cap": 25}),
])
def test_good_writes(name: str, data: bytes, changes: dict[str, object]) -> None:
    assert parse_write(name, data, REGIONS) == changes


@pytest.mark.parametrize(("name", "data", "why"), [
    ("dmem.max", b"", "empty"),
    ("dmem.max", b"\n\n", "empty"),
    ("dmem.max", b"-1\n", "not a decimal"),
    ("dmem.max", b"8GiB\n", "not a decimal"),
    ("dmem.max", b"1" * 21, "not a decimal"),
    ("dmem.max", b"nvidia/gpu7/vidmem 4096\n", "no region"),
    ("dmem.max", b"nvidia/gpu1/vidmem\n", "not a decimal"),
    ("dmem.max", b"nvidia/gpu1/vidmem 1 2\n", "lines"),
    ("dmem.max", b"nvidia/0000:1b:00.0/vidmem 4096\nnvidia/gpu1/vidmem 8192\n", "same"),
    ("dmem.max", b"4096\n8192\n", "lines"),
    ("dmem.max", b"40\x0096\n", "control"),
    ("dmem.max", b"4096\t\t1\n", "control"),
    ("dmem.max", "4096\u00a0".encode(), "ASCII"),
    ("dmem.max", b"1" * (MAX_WRITE + 1), "at most"),
    ("gpu.weight", b"1 2\n", "not a decimal"),
    ("gpu.weight", b"max\n", "not a decimal"),
    ("gpu.weight", b"5\n6\n", "one value"),
    ("gpu.max", b"+5", "not a decimal"),
    ("gpu.priority", b"priority\n", "read-only"),
    ("dmem.current", b"0\n", "read-only"),
])
def test_bad_writes(name: str, data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_write(name, data, REGIONS)


limits = st.one_of(st.none(), st.integers(1, 2**64 - 1))


@given(limits, st.sampled_from(["", "\n"]), st.booleans())
def test_dmem_max_round_trip(limit: int | None, end: str, bare: bool) -> None:
    """What dmem.max shows for a limit, written back, sets that limit."""
    snap = snapshot(limits=(limit, limit))
    shown = text(snap, "dmem.max")
    data = (shown.split()[1] + end) if bare else shown
    assert parse_write("dmem.max", data.encode(), REGIONS) == {"memory": limit}


@given(st.integers(1, 1000), st.one_of(st.none(), st.integers(1, 100)))
def test_gpu_round_trip(weight: int, cap: int | None) -> None:
    snap = snapshot(weight=weight, cap=cap)
    assert parse_write("gpu.weight", text(snap, "gpu.weight").encode(), REGIONS) == {
        "weight": weight}
    assert parse_write("gpu.max", text(snap, "gpu.max").encode(), REGIONS) == {"cap": cap}


@given(st.sampled_from(sorted(WRITABLE)), st.binary(max_size=MAX_WRITE + 64))
def test_any_bytes_parse_or_fail_cleanly(name: str, data: bytes) -> None:
    """Hostile input: a ValueError or a change the Manager then validates, never another error."""
    try:
        changes = parse_write(name, data, REGIONS)
    except ValueError:
        return
    assert len(data) <= MAX_WRITE and b"\0" not in data
    assert set(changes) <= {"memory", "weight", "cap"}


def test_pure_parts_load_no_io() -> None:
    """snapshot, render and values load neither mfusepy nor the event loop's rooms."""
    code = ("import json, sys\nimport vgpud.fsview.render, vgpud.fsview.values\n"
            "print(json.dumps(sorted(sys.modules)))")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], check=True,
                                           capture_output=True, text=True).stdout))
    io = ("mfusepy", "asyncio", "vgpud.admin", "vgpud.store", "vgpud.kernel", "vgpud.fsview.ops",
          "vgpud.fsview.service", "vgpud.fsview.mountfd")
    assert sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in io)) == []
