"""A SIGKILLed vgpud, restarted, schedules the channel groups made before.

The groups are learned from the charge journal (vgpud.journal): without it the
restarted daemon would not know them, the module would turn them all back on
at its registration, and nvsim's round robin would give them equal time.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

import nvclient as nv
from conftest import remove_cgroup
from dbus_fixtures import PrivateBus
from test_tdma import CGROOT, Tenants, config_text, measure

from vgpud.admin.client import AdminClient
from vgpud.admin.dbus import tenant_path

pytestmark = pytest.mark.vm

WEIGHTS = (300, 100)  # 75 / 25


def shares_over_dbus() -> list[dict[int, float]]:
    async def read(client: AdminClient) -> list[dict[int, float]]:
        return [(await client.tenant_properties(tenant_path(f"t{i}")))["Share"]
                for i in range(len(WEIGHTS))]

    return asyncio.run(AdminClient.run(read))


def test_sigkill_and_restart_keep_scheduling_the_groups(vgpu: Path, daemon_factory,
                                                        tmp_path: Path) -> None:
    if not (CGROOT / "cgroup.controllers").exists():
        pytest.skip("cgroup v2 is not mounted at /sys/fs/cgroup in this guest")
    if not Path(nv.PROC_GROUPS).exists():
        pytest.skip("nvsim has no work engine (/proc/driver/nvsim/groups)")
    bus = PrivateBus()
    os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = bus.address
    made = [CGROOT / f"vgpu-tdma-t{i}" for i in range(len(WEIGHTS))]
    for path in made:
        path.mkdir(exist_ok=True)
    config = tmp_path / "vgpud.toml"
    charges = tmp_path / "run" / "charges"
    config.write_text(config_text(tmp_path / "state.json", WEIGHTS).replace(
        "[daemon]\n", f'[daemon]\ncharges_path = "{charges}"\n'))
    daemons = []
    tenants = None
    try:
        daemons.append(daemon_factory("--config", str(config), log_level="info").start())
        tenants = Tenants(len(WEIGHTS))
        time.sleep(1.0)  # the daemon learns the groups; a few frames go by
        got = measure(tenants, 2.0)
        print("before the kill", got)
        assert abs(got[0] - 75) <= 5.0, got

        daemons[0].kill()  # SIGKILL: no stop, the groups stay as it left them
        daemons.append(daemon_factory("--config", str(config), log_level="info").start())
        time.sleep(0.5)
        got = measure(tenants, 3.0)
        print("after the restart", got)
        assert abs(got[0] - 75) <= 4.0 and abs(got[1] - 25) <= 4.0, got
        assert shares_over_dbus() == [{0: 75.0}, {0: 25.0}]  # the targets of known groups
        assert "2 contexts and 2 channel groups restored" in daemons[1].log()
    finally:
        if tenants is not None:
            tenants.close()
        for d in daemons:
            d.kill()
            print(d.log())  # shown when the test fails
        for path in made:
            remove_cgroup(path)
        bus.close()
        del os.environ["DBUS_SYSTEM_BUS_ADDRESS"]
