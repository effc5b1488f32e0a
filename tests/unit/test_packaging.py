"""The packaging files, checked by the tools that will read them.

systemd/vgpud.service through systemd-analyze verify (with ExecStart pointed
at this checkout's vgpud, as an install would), systemd/vgpu.conf through
modprobe's own config parser (and systemd/nvidia-root-only.conf, which makes
the NVIDIA driver's nodes root-only). The udev rule is checked in the VM tier
(tests/vm/test_packaging.py), where the module's devices exist.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd/vgpud.service"
VGPUD = Path(sys.executable).parent / "vgpud"


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, check=False)


needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze not installed (package systemd)")


@needs_analyze
def test_unit_verifies_clean(tmp_path: Path) -> None:
    text = UNIT.read_text()
    assert "ExecStart=/opt/vgpud/bin/vgpud " in text
    unit = tmp_path / "vgpud.service"
    unit.write_text(text.replace("/opt/vgpud/bin/vgpud", str(VGPUD)))
    res = verify(unit)
    assert (res.returncode, res.stdout + res.stderr) == (0, "")


@needs_analyze
def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: an unknown key or a missing binary is reported."""
    unit = tmp_path / "vgpud.service"
    unit.write_text(UNIT.read_text().replace("Type=notify", "Type=notify\nWatchdogSecs=3"))
    assert "Unknown key" in verify(unit).stderr


def test_unit_matches_the_daemon() -> None:
    """What the unit relies on exists: sd_notify READY/WATCHDOG and SIGHUP reload."""
    text = UNIT.read_text()
    daemon = (ROOT / "vgpud/daemon.py").read_text()
    assert "Type=notify" in text and '"READY=1"' in daemon
    assert "WatchdogSec=" in text and '"WATCHDOG=1"' in daemon
    assert "kill -HUP" in text and "SIGHUP" in daemon


needs_modprobe = pytest.mark.skipif(not Path("/sbin/modprobe").exists(),
                                    reason="kmod not installed")


def showconfig(conf: Path) -> str:
    return subprocess.run(["/sbin/modprobe", f"--config={conf}", "--showconfig"],
                          capture_output=True, text=True, check=True).stdout


@needs_modprobe
def test_modprobe_options_parse() -> None:
    assert ("options vgpu backing_dir=/dev fail_open=N upcall_timeout_ms=5000 "
            "backing_driver=nvidia backing_uvm_driver=nvidia_uvm") in showconfig(
                ROOT / "systemd/vgpu.conf")


@needs_modprobe
def test_real_nodes_are_root_only() -> None:
    """nvidia.ko's own device-file options (NVreg_DeviceFile*, nv-reg.h)."""
    assert ("options nvidia NVreg_ModifyDeviceFiles=1 NVreg_DeviceFileUID=0 "
            "NVreg_DeviceFileGID=0 NVreg_DeviceFileMode=0600") in showconfig(
                ROOT / "systemd/nvidia-root-only.conf")


@needs_modprobe
def test_uvm_without_hmm() -> None:
    """nvidia-uvm's module parameter (uvm_hmm.c): pageable memory stays out of
    video memory, where no quota sees it."""
    assert "options nvidia_uvm uvm_disable_hmm=1" in showconfig(
        ROOT / "systemd/nvidia-uvm-no-hmm.conf")


def test_unit_loads_the_module_outside_its_bounding_set() -> None:
    """The daemon's capabilities cannot load a module: modprobe runs with "+"."""
    text = UNIT.read_text()
    assert "ExecStartPre=+/sbin/modprobe vgpu\n" in text
    assert "CAP_SYS_MODULE" not in text.split("CapabilityBoundingSet=")[1].split("\n")[0]


def test_unit_keeps_only_net_admin_and_sys_nice() -> None:
    """The daemon never touches tenant memory (issue 10 item 6): no CAP_SYS_PTRACE.
    CAP_SYS_NICE is the driver's condition for interleave levels (issue 14)."""
    bounding = UNIT.read_text().split("CapabilityBoundingSet=")[1].split("\n")[0]
    assert bounding.split() == ["CAP_NET_ADMIN", "CAP_SYS_NICE"]
