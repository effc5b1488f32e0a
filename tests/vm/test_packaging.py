"""udev/70-vgpu.rules applied by the real udevadm to the module's devices."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "udev/70-vgpu.rules"
RUN_RULES = Path("/run/udev/rules.d")

pytestmark = pytest.mark.vm


@pytest.fixture
def installed_rules() -> Iterator[Path]:
    RUN_RULES.mkdir(parents=True, exist_ok=True)
    dest = RUN_RULES / RULES.name
    shutil.copy(RULES, dest)
    yield dest
    dest.unlink()


def udevadm_test(syspath: str) -> str:
    res = subprocess.run(["udevadm", "test", "--action=add", syspath], capture_output=True,
                         text=True, check=False)
    assert res.returncode == 0, res.stderr
    return res.stdout + res.stderr


@pytest.mark.parametrize("name", ["nvidiactl", "nvidia0", "nvidia1"])
def test_rule_applies_to_every_vgpu_node(vgpu: Path, installed_rules: Path, name: str) -> None:
    out = udevadm_test(f"/sys/class/vgpu/{name}")
    assert f"{installed_rules}" in out, out
    assert "MODE 0666" in out, out
    assert "TAG" in out and "systemd" in out, out
    assert (vgpu / name).exists()


def test_rule_leaves_other_devices_alone(installed_rules: Path) -> None:
    out = udevadm_test("/sys/class/mem/null")
    assert f"{installed_rules}:" not in out, out
