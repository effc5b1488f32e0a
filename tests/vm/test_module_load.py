"""vgpu.ko as a system loads it: modinfo's alias and version, and the daemon
autoloading the module through the generic netlink family's alias.

Resolving a family the kernel does not know makes it run
`modprobe net-pf-16-proto-16-family-vgpu`, which the module's
MODULE_ALIAS_GENL_FAMILY answers once the module is installed and indexed
(depmod). The guest's /lib/modules is the host's, and a depmod of the whole
tree takes minutes under TCG: for one test, a small tree of the kernel's
builtin lists and extra/vgpu.ko, indexed by depmod, is bind-mounted over
/lib/modules/$(uname -r), and unmounted afterwards.

The hint when the module cannot be loaded is checked on the resolver the
daemon uses (the daemon's own exit on it is a host test, test_daemon.py).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.guest import (
    NVSIM_DIR,
    ROOT,
    VGPU_DIR,
    VGPU_KO,
    VGPU_OVER_NVSIM,
    loaded,
    rmmod,
    run,
    wait_path,
)
from tests.support.vgpud_proc import TEST_DAEMON
from vgpud.kernel.channel import FamilyNotFound, resolve_family

pytestmark = pytest.mark.vm

ALIAS = "net-pf-16-proto-16-family-vgpu"
# What modprobe reads besides the indexes that depmod writes.
KERNEL_LISTS = ("modules.builtin", "modules.builtin.modinfo", "modules.order")
MODPROBE_CONF = Path("/run/modprobe.d/vgpu-test.conf")
HINT = "generic netlink family 'vgpu' not found: is vgpu.ko loaded?"


def dkms_version() -> str:
    text = (ROOT / "kmod/dkms.conf").read_text()
    match = re.search(r'^PACKAGE_VERSION="([^"]+)"', text, flags=re.M)
    assert match, "kmod/dkms.conf has no PACKAGE_VERSION"
    return match.group(1)


def modinfo(field: str) -> list[str]:
    res = run("modinfo", "-F", field, str(VGPU_KO))
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def test_modinfo_alias_and_version() -> None:
    assert ALIAS in modinfo("alias")
    assert modinfo("version") == [dkms_version()]


def _check(res: subprocess.CompletedProcess[str], what: str) -> None:
    assert res.returncode == 0, f"{what}: {res.stdout}{res.stderr}"


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[Path]:
    """vgpu.ko where modprobe finds it, with options for nvsim's nodes."""
    kver = os.uname().release
    real = Path("/lib/modules") / kver
    tree = tmp_path / "lib/modules" / kver
    (tree / "extra").mkdir(parents=True)
    for name in KERNEL_LISTS:
        shutil.copy(real / name, tree / name)
    shutil.copy(VGPU_KO, tree / "extra/vgpu.ko")
    _check(run("depmod", "-b", str(tmp_path), kver), "depmod")
    MODPROBE_CONF.parent.mkdir(parents=True, exist_ok=True)
    MODPROBE_CONF.write_text(f"options vgpu {' '.join(VGPU_OVER_NVSIM)} upcall_timeout_ms=2000\n")
    _check(run("mount", "--bind", str(tree), str(real)), "bind mount")
    try:
        yield tree
    finally:
        # Lazily: udevd's kmod builtin may still map the indexes it read.
        _check(run("umount", "--lazy", str(real)), "umount")
        MODPROBE_CONF.unlink()
        if loaded("vgpu"):
            _check(rmmod("vgpu"), "rmmod vgpu")


def test_installed_module_is_indexed(nvsim: Path, installed: Path) -> None:
    """modprobe resolves the family's alias to the installed module."""
    res = run("modprobe", "--resolve-alias", ALIAS)
    assert res.stdout.split() == ["vgpu"], res.stdout + res.stderr


def test_daemon_autoloads_the_module(nvsim: Path, installed: Path, daemon_factory) -> None:
    assert not loaded("vgpu")
    daemon = daemon_factory("--policy", "deny-class:0x40", entry=TEST_DAEMON).start(timeout=180)
    assert loaded("vgpu"), daemon.log()
    wait_path(VGPU_DIR / "nvidiactl")
    backing = Path("/sys/module/vgpu/parameters/backing_dir").read_text().strip()
    assert backing == str(NVSIM_DIR)  # loaded by modprobe, with its options
    assert daemon.stop() == 0, daemon.log()


def assert_not_loadable() -> None:
    with pytest.raises(FamilyNotFound) as info:
        asyncio.run(resolve_family())
    assert HINT in str(info.value)
    assert not loaded("vgpu")


def test_module_that_fails_to_load_gives_the_hint(installed: Path) -> None:
    """Installed, but nvsim is not there: modprobe runs, init finds no node."""
    assert not loaded("vgpu") and not (NVSIM_DIR / "nvidiactl").exists()
    assert_not_loadable()


def test_module_not_installed_gives_the_hint(nvsim: Path) -> None:
    assert not loaded("vgpu")
    assert run("modprobe", "--resolve-alias", ALIAS).stdout.strip() != "vgpu"
    assert_not_loadable()
