"""udev/70-vgpu.rules applied by the real udevadm to the module's devices, and
udev/71-nvidia-root-only.rules to devices named as NVIDIA's (nvsim's stand in)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "udev/70-vgpu.rules"
ROOT_ONLY = ROOT / "udev/71-nvidia-root-only.rules"
RUN_RULES = Path("/run/udev/rules.d")

pytestmark = pytest.mark.vm


@pytest.fixture
def installed_rules() -> Iterator[Path]:
    RUN_RULES.mkdir(parents=True, exist_ok=True)
    dest = RUN_RULES / RULES.name
    shutil.copy(RULES, dest)
    yield dest
    dest.unlink()


@pytest.fixture
def root_only_rules(installed_rules: Path) -> Iterator[Path]:
    dest = RUN_RULES / ROOT_ONLY.name
    shutil.copy(ROOT_ONLY, dest)
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


def test_real_uvm_node_is_made_root_only(vgpu: Path, root_only_rules: Path) -> None:
    out = udevadm_test("/sys/class/nvsim/nvidia-uvm")
    assert f"{root_only_rules}" in out, out
    assert "MODE 0600" in out, out


def test_emulated_uvm_node_stays_open(vgpu: Path, root_only_rules: Path) -> None:
    """vgpu's node has NVIDIA's name too: the root-only rule leaves it alone."""
    out = udevadm_test("/sys/class/vgpu/nvidia-uvm")
    assert "MODE 0666" in out and "MODE 0600" not in out, out
