"""vgpud.probes.service and the probes' availability checks, without bcc."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from vgpud.probes import bcc_probes
from vgpud.probes.bcc_probes import ProbesUnavailable, unavailable_reason
from vgpud.probes.layout import LAT_SLOTS, LAT_TOTAL, lat_call
from vgpud.probes.service import ProbeService

CALL = lat_call(0x2B, 0x40)


class FakeProbes:
    """LatencyProbes' surface: a map the test fills, reloads it can simulate."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.map: dict[tuple[int, int, int], list[int]] = {}
        self.attach_points = ["tracepoint vgpu:vgpu_ioctl_enter"]
        self.waiting = "waiting for the vgpu tracepoints (module unloaded)"
        self.is_stale = False
        self.can_reattach = True
        self.reattached = 0
        self.maps_made = 0
        self.new_map_on_reattach = False  # as RemoteProbes after a lost helper
        self.closed = False
        self.fail: str | None = None
        self.drops = 0

    def load(self) -> list[str]:
        if self.fail:
            raise ProbesUnavailable(self.fail)
        self.maps_made += 1
        return self.attach_points

    def stale(self) -> bool:
        return self.is_stale

    def reattach(self) -> bool:
        if self.can_reattach:
            self.is_stale = False
            self.reattached += 1
            if self.new_map_on_reattach:
                self.map = {}
                self.maps_made += 1
        return self.can_reattach

    def read(self) -> dict[tuple[int, int, int], list[int]]:
        return dict(self.map)

    def delete(self, keys: list[tuple[int, int, int]]) -> None:
        for key in keys:
            del self.map[key]

    def dropped(self) -> int:
        return self.drops

    def close(self) -> None:
        self.closed = True


def service(tenants: dict[int, str], fake: FakeProbes, **kw: object) -> ProbeService:
    return ProbeService(tenants.get, interval=3600, source=Path("/x.bpf.c"),
                        reason=lambda: None, make_probes=lambda _: fake, **kw)  # type: ignore[arg-type]


async def started(svc: ProbeService) -> None:
    svc.start()
    for _ in range(100):
        if svc.status != "loading":
            return
        await asyncio.sleep(0.01)


def test_off_says_why(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        svc = ProbeService(lambda _: None, reason=lambda: "tracefs is not mounted at /t")
        await started(svc)
        assert svc.status == "off: tracefs is not mounted at /t" and not svc.on
        disabled = ProbeService(lambda _: None, enabled=False)
        disabled.start()
        assert disabled.status.startswith("off: disabled")
        await svc.stop()
        assert svc.status == "off: tracefs is not mounted at /t"

    asyncio.run(main())
    assert "latency probes off: tracefs is not mounted" in caplog.text


def test_a_failed_load_is_off_with_bccs_reason() -> None:
    async def main() -> None:
        fake = FakeProbes(Path())
        fake.fail = "bcc could not load vgpu_latency.bpf.c: clang error"
        svc = service({}, fake)
        await started(svc)
        assert svc.status == f"off: {fake.fail}"
        assert fake.closed

    asyncio.run(main())


def test_reads_fold_and_trim_closed_contexts() -> None:
    async def main() -> None:
        fake = FakeProbes(Path())
        tenants = {1: "a"}
        svc = service(tenants, fake)
        await started(svc)
        assert svc.on and svc.attach_seconds is not None
        fake.map[(1, LAT_TOTAL, CALL)] = [0] * 10 + [4] + [0] * (LAT_SLOTS - 11) + [400]
        await svc.read()
        assert svc.latency("a")[("RM_ALLOC:0x40", "total")].total == 4
        del tenants[1]
        fake.drops = 3
        await svc.read()
        assert fake.map == {} and svc.dropped == 3
        assert svc.latency("a")[("RM_ALLOC:0x40", "total")].total == 4
        await svc.stop()
        assert fake.closed and svc.status == "off: stopped"

    asyncio.run(main())


def test_a_reloaded_module_is_followed() -> None:
    async def main() -> None:
        fake = FakeProbes(Path())
        svc = service({}, fake)
        await started(svc)
        fake.is_stale, fake.can_reattach = True, False
        await svc.read()
        assert svc.status.startswith("off: waiting for the vgpu tracepoints")
        fake.can_reattach = True
        await svc.read()
        assert svc.on and fake.reattached == 1
        await svc.stop()

    asyncio.run(main())


def test_a_new_map_adds_to_what_the_lost_one_counted() -> None:
    """A lost helper's map goes with it; a live context's counts read from it
    stay, and the new map's add to them (no more, no fewer)."""
    def counts(n: int) -> list[int]:
        return [0] * 10 + [n] + [0] * (LAT_SLOTS - 11) + [100 * n]

    async def main() -> None:
        fake = FakeProbes(Path())
        tenants = {1: "a", 2: "b"}
        svc = service(tenants, fake)
        await started(svc)
        fake.map = {(1, LAT_TOTAL, CALL): counts(4), (2, LAT_TOTAL, CALL): counts(1)}
        await svc.read()
        fake.is_stale, fake.new_map_on_reattach = True, True
        await svc.read()  # the new map is empty
        assert svc.on and fake.maps_made == 2
        assert svc.latency("a")[("RM_ALLOC:0x40", "total")].total == 4
        fake.map[(1, LAT_TOTAL, CALL)] = counts(3)
        await svc.read()
        assert svc.latency("a")[("RM_ALLOC:0x40", "total")].total == 7
        assert svc.latency("b")[("RM_ALLOC:0x40", "total")].total == 1
        del tenants[1]  # a closes: its new counts retire once, beside the old
        await svc.read()
        assert fake.map == {}  # a's key deleted from the map once folded
        assert svc.latency("a")[("RM_ALLOC:0x40", "total")].total == 7
        fake.is_stale, fake.new_map_on_reattach = True, False  # a module reload: same map
        await svc.read()
        assert fake.maps_made == 2
        assert svc.latency("a")[("RM_ALLOC:0x40", "total")].total == 7
        await svc.stop()

    asyncio.run(main())


def test_unavailable_reasons(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tracefs, modules = tmp_path / "tracing", tmp_path / "modules"

    def why(caps: int = 1 << bcc_probes.CAP_SYS_ADMIN, paranoid: int = 2) -> str | None:
        return unavailable_reason(tracefs, modules, lambda: caps, lambda: paranoid)

    # The shipped unit's bounding set: CAP_NET_ADMIN (12) alone.
    assert "needs CAP_BPF and CAP_PERFMON" in str(why(1 << 12))
    assert "needs CAP_BPF and CAP_PERFMON" in str(why(1 << bcc_probes.CAP_BPF))
    assert "tracefs is not mounted" in str(why())
    assert "tracefs is not mounted" in str(
        why(1 << bcc_probes.CAP_BPF | 1 << bcc_probes.CAP_PERFMON))
    # Debian's perf_event_paranoid=3 wants CAP_SYS_ADMIN for perf_event_open(2).
    assert "perf_event_paranoid is 3: attaching needs CAP_SYS_ADMIN" in str(
        why(1 << bcc_probes.CAP_BPF | 1 << bcc_probes.CAP_PERFMON, 3))
    assert "tracefs is not mounted" in str(why(paranoid=3))
    (tracefs / "events").mkdir(parents=True)
    assert "tracepoints are absent" in str(why())
    (tracefs / "events/vgpu").mkdir()
    monkeypatch.delenv("BCC_KERNEL_SOURCE", raising=False)
    assert "no kernel headers" in str(why())
    (modules / os.uname().release / "build").mkdir(parents=True)
    monkeypatch.setitem(sys.modules, "bcc", None)  # import bcc -> ImportError
    assert "bcc is not importable" in str(why())


def test_perf_paranoid(tmp_path: Path) -> None:
    (tmp_path / "p").write_text("3\n")
    assert bcc_probes.perf_paranoid(tmp_path / "p") == 3
    assert bcc_probes.perf_paranoid(tmp_path / "absent") == -1


def test_effective_caps(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tvgpud\nCapInh:\t0\nCapEff:\t0000000000001000\n")
    assert bcc_probes.effective_caps(status) == 1 << 12


def test_the_source_is_found_in_the_checkout() -> None:
    assert bcc_probes.find_source().name == "vgpu_latency.bpf.c"


def test_kprobe_targets_come_from_tracefs_with_their_modules(tmp_path: Path) -> None:
    """The handlers and their modules from available_filter_functions (the
    helper's sandbox hides /proc/kallsyms); absent names are left out."""
    functions = tmp_path / "available_filter_functions"
    functions.write_bytes(b"do_sys_open\nnvsim_ioctl [nvsim]\nvgpu_nl_schedule [vgpu]\n"
                          b"vgpu_nl_scheduler_x [vgpu]\n\n")
    assert bcc_probes.kprobe_modules(["nvsim_ioctl", "vgpu_nl_schedule", "do_sys_open",
                                      "nvidia_unlocked_ioctl"], functions) == {
        "nvsim_ioctl": "nvsim", "vgpu_nl_schedule": "vgpu", "do_sys_open": ""}
    assert bcc_probes.kprobe_modules(["nvsim_ioctl"], tmp_path / "absent") == {}


def test_a_module_load_id_is_its_sysfs_directorys_inode(tmp_path: Path) -> None:
    """(kernfs gives a reloaded module's directory a new inode: the VM tests.)"""
    (tmp_path / "nvsim").mkdir()
    first = bcc_probes.module_load_id("nvsim", tmp_path)
    assert first == (tmp_path / "nvsim").stat().st_ino
    assert bcc_probes.module_load_id("", tmp_path) == 0  # built in: never reloaded
    (tmp_path / "nvsim").rmdir()
    assert bcc_probes.module_load_id("nvsim", tmp_path) is None
