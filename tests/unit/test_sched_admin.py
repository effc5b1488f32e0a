"""The scheduler's side of the admin API: Share / MeasuredShare, Timeslices /
Preemptions, SchedMode and `vgpuctl top`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from dbus_fast import Message

from tests.support.bus import (
    GIB,
    PrivateBus,
    ServiceThread,
    make_manager,
    properties_changed,
    write_config,
)
from vgpud import cli
from vgpud.admin.client import AdminClient
from vgpud.admin.names import tenant_path
from vgpud.core.observers import Topic
from vgpud.core.shares import SharesChanged


class FakeScheduler:
    def __init__(self) -> None:
        self.shares: dict[str, dict[int, float]] = {"alice": {0: 62.5, 1: 100.0}}
        self.measured: dict[str, dict[int, float]] = {"alice": {0: 61.9}}
        self.slices: dict[str, dict[int, list[int]]] = {"alice": {0: [2048, 2048]}}
        self.preempts: dict[str, dict[int, int]] = {"alice": {0: 3}}
        self.mode = {0: "runlist", 1: "frame (runlist refused: NVIDIA status 0x56)"}
        self.observers: Topic[SharesChanged] = Topic()

    def modes(self) -> dict[int, str]:
        return dict(self.mode)

    def timeslices(self, tenant: str) -> dict[int, list[int]]:
        return dict(self.slices.get(tenant, {}))

    def preemptions(self, tenant: str) -> dict[int, int]:
        return dict(self.preempts.get(tenant, {}))

    def share(self, tenant: str) -> dict[int, float]:
        return dict(self.shares.get(tenant, {}))

    def measured_share(self, tenant: str) -> dict[int, float]:
        return dict(self.measured.get(tenant, {}))


@pytest.fixture
def sched_service(system_bus: PrivateBus, tmp_path: Path) -> Iterator[ServiceThread]:
    thread = ServiceThread(make_manager(write_config(tmp_path)), FakeScheduler())
    yield thread
    thread.close()


def properties(name: str) -> dict[str, Any]:
    return asyncio.run(AdminClient.run(lambda c: c.tenant_properties(tenant_path(name))))


def vgpuctl(*args: str) -> Any:
    return CliRunner().invoke(cli.main, list(args), env={"COLUMNS": "160"})


def test_share_properties(sched_service: ServiceThread) -> None:
    alice = properties("alice")
    assert (alice["Share"], alice["MeasuredShare"]) == ({0: 62.5, 1: 100.0}, {0: 61.9})
    assert (properties("shared")["Share"], properties("shared")["MeasuredShare"]) == ({}, {})
    assert (alice["Timeslices"], alice["Preemptions"]) == ({0: [2048, 2048]}, {0: 3})
    assert (properties("shared")["Timeslices"], properties("shared")["Preemptions"]) == ({}, {})
    manager = asyncio.run(AdminClient.run(lambda c: c.manager_properties()))
    assert manager["SchedMode"] == {0: "runlist",
                                    1: "frame (runlist refused: NVIDIA status 0x56)"}


def test_shares_changed_emits_properties_changed(sched_service: ServiceThread) -> None:
    scheduler: FakeScheduler = sched_service.scheduler
    assert len(scheduler.observers) == 1  # the AdminService, as vgpud.app subscribes it

    async def run(client: AdminClient) -> Message:
        received = await properties_changed(client)
        scheduler.measured["alice"] = {0: 50.0}
        sched_service.call(scheduler.observers.notify, SharesChanged(("alice",)))
        return await asyncio.wait_for(received.get(), 5)

    msg = asyncio.run(AdminClient.run(run))
    assert msg.path == tenant_path("alice")
    _interface, changed, _invalidated = msg.body
    assert {k: v.value for k, v in changed.items()} == {
        "Share": {0: 62.5, 1: 100.0}, "MeasuredShare": {0: 50.0},
        "Timeslices": {0: [2048, 2048]}, "Preemptions": {0: 3}}


def test_top_json_and_once(sched_service: ServiceThread) -> None:
    result = vgpuctl("top", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [(r["tenant"], r["gpu"]) for r in rows] == [
        ("alice", 0), ("alice", 1), ("bob.x-1", 1), ("shared", 0), ("shared", 1)]
    assert rows[0] == {"tenant": "alice", "gpu": 0, "memory_used": 0,
                       "memory_limit": 8 * GIB, "weight": 100, "cap": 0,
                       "priority": "best-effort", "share": 62.5, "measured_share": 61.9,
                       "mode": "runlist", "timeslices_us": [2048, 2048], "preemptions": 3}
    assert (rows[1]["share"], rows[1]["measured_share"]) == (100.0, None)
    assert rows[1]["mode"] == "frame (runlist refused: NVIDIA status 0x56)"
    assert (rows[1]["timeslices_us"], rows[1]["preemptions"]) == ([], 0)
    assert rows[2]["weight"] == 300
    once = vgpuctl("top", "--once")
    assert once.exit_code == 0, once.output
    assert "MEASURED" in once.output and "62.5%" in once.output and "61.9%" in once.output
    assert "2x2048" in once.output and "GPU 0: runlist" in once.output
    assert "runlist refused: NVIDIA status 0x56" in once.output


def test_top_refreshes_until_interrupted(sched_service: ServiceThread,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    refreshes = []

    async def sleep(seconds: float) -> None:
        refreshes.append(seconds)
        if len(refreshes) == 2:
            raise KeyboardInterrupt
        sched_service.scheduler.shares["alice"] = {0: 12.5}

    monkeypatch.setattr(cli.asyncio, "sleep", sleep)
    result = vgpuctl("top", "--interval", "0.5")
    assert result.exit_code == 0, result.output
    assert refreshes == [0.5, 0.5]
    assert "12.5%" in result.output


def test_top_without_daemon_exits_69(system_bus: PrivateBus) -> None:
    assert vgpuctl("top", "--once").exit_code == cli.EX_UNAVAILABLE


def test_status_says_each_gpus_mode(sched_service: ServiceThread) -> None:
    result = vgpuctl("status")
    assert result.exit_code == 0, result.output
    assert ("scheduling: GPU 0 runlist; GPU 1 frame (runlist refused: NVIDIA status 0x56)"
            in result.output)
