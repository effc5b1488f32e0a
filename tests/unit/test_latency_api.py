"""GetLatency, the Probes property and `vgpuctl latency`, over a private bus.

The probes are a stand-in holding a LatencyBook with known counts (the real
probes run in the VM tier, tests/vm/test_probes.py): what is checked here is
the API and the CLI around them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from dbus_fast import DBusError

from tests.support.bus import PrivateBus, ServiceThread, make_manager, write_config
from vgpud.admin.client import AdminClient
from vgpud.nvidia.escapes import Escape, NvClass
from vgpud.probes.histograms import Histogram, LatencyBook
from vgpud.probes.layout import LAT_DRIVER, LAT_SLOTS, LAT_TOTAL, lat_call
from vgpud.probes.render import log2_lines, summary

ALLOC = lat_call(Escape.RM_ALLOC, NvClass.MEMORY_LOCAL_USER)
FREE = lat_call(Escape.RM_FREE, 0)


def val(buckets: dict[int, int], sum_ns: int) -> list[int]:
    return [buckets.get(i, 0) for i in range(LAT_SLOTS)] + [sum_ns]


class Probes:
    def __init__(self, status: str) -> None:
        self.status = status
        self.book = LatencyBook()
        self.book.update({(1, LAT_TOTAL, ALLOC): val({15: 3, 20: 1}, 3 * 20_000 + 600_000),
                          (1, LAT_DRIVER, ALLOC): val({14: 4}, 40_000),
                          (1, LAT_TOTAL, FREE): val({12: 2}, 5_000)},
                         {1: "alice"}.get)

    @property
    def on(self) -> bool:
        return self.status.startswith("on")

    def latency(self, tenant: str, kind: str = "") -> dict[tuple[str, str], Histogram]:
        return self.book.histograms(tenant, kind)


@pytest.fixture
def probes(system_bus: PrivateBus, tmp_path: Path) -> Iterator[Probes]:
    p = Probes("on: tracepoint vgpu:vgpu_ioctl_enter")
    thread = ServiceThread(make_manager(write_config(tmp_path)), probes=p)
    yield p
    thread.close()


def vgpuctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpud.cli", *args], capture_output=True,
                          text=True, timeout=60)


def call(member: str, signature: str = "", *body: object) -> object:
    import asyncio
    return asyncio.run(AdminClient.run(lambda c: c.call(member, signature, *body)))


def test_get_latency_by_kind(probes: Probes) -> None:
    rows = [list(r) for r in call("GetLatency", "ss", "alice", "")]  # type: ignore[attr-defined]
    assert rows == [["RM_ALLOC:0x40", "driver", [0] * 14 + [4], 40_000],
                    ["RM_ALLOC:0x40", "total", [0] * 15 + [3, 0, 0, 0, 0, 1], 660_000],
                    ["RM_FREE", "total", [0] * 12 + [2], 5_000]]
    assert [list(r) for r in call("GetLatency", "ss", "alice", "RM_FREE")] == [  # type: ignore[attr-defined]
        ["RM_FREE", "total", [0] * 12 + [2], 5_000]]
    assert call("GetLatency", "ss", "bob.x-1", "") == []
    with pytest.raises(DBusError, match="no tenant named 'nobody'") as err:
        call("GetLatency", "ss", "nobody", "")
    assert err.value.type == "org.vgpud1.Error.NoSuchTenant"


def test_probes_off_is_an_error_that_says_why(probes: Probes) -> None:
    probes.status = "off: tracefs is not mounted at /sys/kernel/tracing"
    with pytest.raises(DBusError, match="tracefs is not mounted") as err:
        call("GetLatency", "ss", "alice", "")
    assert err.value.type == "org.vgpud1.Error.ProbesOff"
    res = vgpuctl("latency", "--tenant", "alice")
    assert res.returncode == 1 and "tracefs is not mounted" in res.stderr
    status = json.loads(vgpuctl("status", "--json").stdout)
    assert status["probes"] == probes.status


def test_vgpuctl_latency_prints_bcc_style_histograms(probes: Probes) -> None:
    res = vgpuctl("latency", "--tenant", "alice")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert ("tenant alice, all, total: 6 calls, mean 110.8 us, p50 <= 32.8 us, "
            "p99 <= 1048.6 us") in lines
    assert "tenant alice, all, driver: 4 calls, mean 10.0 us, p50 <= 16.4 us, p99 <= 16.4 us" \
        in lines
    assert any(line.startswith("     16384 -> 32767      : 3 ") for line in lines)
    data = json.loads(vgpuctl("latency", "--tenant", "alice", "--kind", "RM_ALLOC:0x40",
                              "--json").stdout)
    assert {(r["kind"], r["histogram"], r["p50_ns"], r["p99_ns"], r["mean_ns"])
            for r in data["alice"]} == {("RM_ALLOC:0x40", "driver", 16383, 16383, 10_000),
                                        ("RM_ALLOC:0x40", "total", 32767, 1048575, 165_000)}
    every = json.loads(vgpuctl("latency", "--json").stdout)
    assert set(every) == {"alice", "bob.x-1", "shared"} and every["bob.x-1"] == []


def test_log2_lines_match_bccs_layout() -> None:
    h = Histogram.of([0, 0, 1, 4])
    assert log2_lines(h) == [
        "                   nsecs : count     distribution",
        "         0 -> 1          : 0        |                                        |",
        "         2 -> 3          : 1        |**********                              |",
        "         4 -> 7          : 4        |****************************************|",
    ]
    assert log2_lines(Histogram()) == []
    assert summary(h) == "5 calls, mean 0.0 us, p50 <= 0.0 us, p99 <= 0.0 us"
    assert summary(Histogram()) == "0 calls, mean -, p50 <= -, p99 <= -"
