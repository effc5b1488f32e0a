"""Activity sources: nvsim's /proc counters and NVML samples (a fake pynvml), mapped to tenants."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vgpud.core.groups import Group, GroupTracker
from vgpud.sched.activity import NvmlActivity, NvsimActivity, choose_source

MS = 1_000_000
HEADER = "gpu client group tgid enabled timeslice_us pending_ns busy_ns wait_ns\n"


def tracker(*groups: Group) -> GroupTracker:
    t = GroupTracker()
    for g in groups:
        t.add(g)
    return t


A0 = Group(1, "a", 0, 0xC1, 0x100, 0x10, 501)
A0b = Group(1, "a", 0, 0xC1, 0x101, 0x10, 501)
B0 = Group(2, "b", 0, 0xC2, 0x100, 0x10, 502)
B1 = Group(3, "b", 1, 0xC3, 0x100, 0x11, 502)


def line(g: Group, pending: int, busy: int, gpu: int | None = None) -> str:
    return (f"{g.gpu if gpu is None else gpu} {g.client:#x} {g.handle:#x} {g.tgid} 1 1024 "
            f"{pending} {busy} 0\n")


def test_nvsim_runnable_and_busy(tmp_path: Path) -> None:
    proc = tmp_path / "groups"
    source = NvsimActivity(proc)
    groups = tracker(A0, A0b, B0, B1)
    proc.write_text(HEADER + line(A0, 0, 1000) + line(A0b, 5, 500) + line(B0, 0, 0)
                    + line(B1, 7, 100) + "0 0xff 0x1 9 1 1024 9 9\n")
    act = source.update(source.read(), groups, {}, 0)
    assert act.runnable == {(0, "a"), (1, "b")}
    assert act.busy_ns == {(0, "a"): 1500, (1, "b"): 100}
    # A0b freed (gone from the file); a new group reuses nothing; counters go on
    proc.write_text(HEADER + line(A0, 0, 1700) + line(B0, 3, 250) + line(B1, 0, 100)
                    + "garbage\n")
    act = source.update(source.read(), groups, {}, 0)
    assert act.runnable == {(0, "b")}
    assert act.busy_ns == {(0, "a"): 2200, (0, "b"): 250, (1, "b"): 100}
    assert source.bad_lines == 1
    # the same handle again, a new group: its counter starts from 0
    proc.write_text(HEADER + line(A0, 0, 1700) + line(A0b, 0, 40))
    assert source.update(source.read(), groups, {}, 0).busy_ns[(0, "a")] == 2240


def test_nvsim_work_of_a_paused_group_makes_no_tenant_runnable(tmp_path: Path) -> None:
    proc = tmp_path / "groups"
    source = NvsimActivity(proc)
    groups = tracker(A0, A0b)
    groups.set_paused(A0b, True)
    proc.write_text(HEADER + line(A0, 0, 10) + line(A0b, 5, 20))
    act = source.update(source.read(), groups, {}, 0)
    assert act.runnable == frozenset() and act.busy_ns == {(0, "a"): 30}
    groups.set_paused(A0b, False)
    assert source.update(source.read(), groups, {}, 0).runnable == {(0, "a")}


def test_nvsim_missing_file_is_no_activity(tmp_path: Path) -> None:
    source = NvsimActivity(tmp_path / "none")
    act = source.update(source.read(), tracker(A0), {}, 0)
    assert (act.runnable, act.busy_ns) == (frozenset(), {})


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    """The pynvml calls the source makes, with samples the test feeds."""

    NVMLError = NVMLError

    def __init__(self, count: int = 2, fail_init: int | None = None) -> None:
        self.count = count
        self.fail_init = fail_init
        self.samples: dict[int, list[tuple[int, int, int]]] = {}  # gpu -> (pid, ts_us, sm)
        self.asked: list[tuple[int, int]] = []
        self.error: dict[int, int] = {}
        self.inits = 0

    def nvmlInit(self) -> None:
        if self.fail_init is not None:
            raise NVMLError(self.fail_init)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.inits -= 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        if i >= self.count:
            raise NVMLError(2)
        return ("handle", i)

    def nvmlDeviceGetProcessUtilization(self, handle: Any, ts: int) -> list[Any]:
        gpu = handle[1]
        self.asked.append((gpu, ts))
        if gpu in self.error:
            raise NVMLError(self.error[gpu])
        rows = [r for r in self.samples.get(gpu, []) if r[1] > ts]
        if not rows:
            raise NVMLError(6)  # NOT_FOUND: no samples since ts
        return [SimpleNamespace(pid=p, timeStamp=t, smUtil=sm, memUtil=0, encUtil=0, decUtil=0)
                for p, t, sm in rows]


def test_nvml_maps_pids_to_tenants_and_estimates_busy() -> None:
    nvml = FakeNvml()
    source = NvmlActivity(nvml, [0, 1], hold=0.3, probe=5.0)
    groups = tracker(A0, B0, B1)
    nvml.samples = {0: [(501, 1_000, 40), (502, 1_000, 0), (999, 1_000, 90)],
                    1: [(502, 2_000, 10)]}
    act = source.update(source.read(), groups, {0: {"a"}, 1: {"b"}}, 0)
    assert act.runnable == {(0, "a"), (0, "b"), (1, "b")}  # nobody seen idle yet
    nvml.samples[0] += [(501, 167_000, 50), (502, 167_000, 20)]
    act = source.update(source.read(), groups, {0: {"a"}, 1: {"b"}}, 100 * MS)
    # 166 ms between samples, at 50% and 20% of the SMs
    assert act.busy_ns == {(0, "a"): 83_000_000, (0, "b"): 33_200_000}
    assert nvml.asked[-2:] == [(0, 1_000), (1, 2_000)]  # each GPU from its last sample


def test_nvml_idle_while_on_then_probed_again() -> None:
    nvml = FakeNvml(count=1)
    source = NvmlActivity(nvml, [0], hold=0.3, probe=5.0)
    groups = tracker(A0, B0)
    t = 0

    def poll(running: str | None, samples: list[tuple[int, int]] = ()) -> frozenset:
        nonlocal t
        t += 100 * MS
        nvml.samples.setdefault(0, []).extend((pid, t // 1000, sm) for pid, sm in samples)
        return source.update(source.read(), groups, {0: {running} if running else set()},
                             t).runnable

    assert poll("a", [(501, 30)]) == {(0, "a"), (0, "b")}
    # b is off: it cannot show use, so it stays runnable however long it waits
    for _ in range(20):
        assert (0, "b") in poll("a", [(501, 30)])
    # b runs without using the GPU: idle after 300 ms of being on
    assert (0, "b") in poll("b")
    assert (0, "b") in poll("b")
    assert (0, "b") in poll("b")
    assert (0, "b") not in poll("b")
    # off again: idle until the probe, 5 s later
    for _ in range(49):
        assert (0, "b") not in poll("a", [(501, 30)])
    assert (0, "b") in poll("a", [(501, 30)])
    # on, and busy this time: runnable for good
    assert (0, "b") in poll("b", [(502, 70)])
    for _ in range(10):
        assert (0, "b") in poll("b", [(502, 70)])


def test_nvml_in_runlist_mode_every_tenant_is_on() -> None:
    """Runlist mode switches every tenant on at once: one that shows no use for
    ``hold`` of being on is idle, while the busy one stays runnable."""
    nvml = FakeNvml(count=1)
    source = NvmlActivity(nvml, [0], hold=0.3, probe=5.0)
    groups = tracker(A0, B0)
    both = {0: {"a", "b"}}
    t = 0
    runnable: frozenset = frozenset()
    for _ in range(5):
        t += 100 * MS
        nvml.samples.setdefault(0, []).append((501, t // 1000, 40))
        runnable = source.update(source.read(), groups, both, t).runnable
    assert runnable == {(0, "a")}


def test_nvml_errors_are_counted_not_raised() -> None:
    nvml = FakeNvml(count=1)
    source = NvmlActivity(nvml, [0])
    nvml.error[0] = 999
    act = source.update(source.read(), tracker(A0), {0: set()}, 0)
    assert source.errors == 1
    assert act.runnable == {(0, "a")}


def test_choose_source(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    proc = tmp_path / "nvsim"
    proc.mkdir()
    assert isinstance(choose_source([0], nvsim=proc, nvml=FakeNvml), NvsimActivity)
    nvml = FakeNvml()
    source = choose_source([0, 1], nvsim=tmp_path / "no", nvml=lambda: nvml)
    assert isinstance(source, NvmlActivity) and nvml.inits == 1
    source.close()
    assert nvml.inits == 0
    assert choose_source([0], nvsim=tmp_path / "no", nvml=lambda: FakeNvml(fail_init=12)) is None
    assert "NVML unavailable" in caplog.text
    bad = FakeNvml(count=1)
    assert choose_source([0, 1], nvsim=tmp_path / "no", nvml=lambda: bad) is None
    assert bad.inits == 0
