"""The CDI spec file and the daemon's keeper of it: atomic rewrites, only our
file touched, rewritten when tenants change and not on the upcall path."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from tests.support.bus import make_manager, write_config
from tests.support.contexts import close_context, open_context, usage_changed
from vgpud.admin.manager import Manager
from vgpud.cdi import files
from vgpud.cdi.files import SpecFile, this_hook
from vgpud.cdi.keeper import SpecKeeper
from vgpud.cdi.spec import SPEC_FILE, Hook, build_spec

HOOK = Hook("/usr/bin/vgpuctl")


def devices(path: Path) -> list[str]:
    return [d["name"] for d in json.loads(path.read_text())["devices"]]


def test_a_rewrite_replaces_the_file_whole_0644_whatever_the_umask(tmp_path: Path) -> None:
    spec_file = SpecFile(tmp_path / "cdi")
    old_umask = os.umask(0o077)
    try:
        spec_file.write(build_spec([("a", (0,))], HOOK))
        first = spec_file.path.stat()
        spec_file.write(build_spec([("a", (0,)), ("b", (1,))], HOOK))
    finally:
        os.umask(old_umask)
    second = spec_file.path.stat()
    assert stat.S_IMODE(second.st_mode) == 0o644
    assert first.st_ino != second.st_ino  # renamed over, never written in place
    assert devices(spec_file.path) == ["a", "b"]
    assert os.listdir(tmp_path / "cdi") == [SPEC_FILE]  # no temporary left


def test_a_failed_rewrite_keeps_the_old_spec(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    spec_file = SpecFile(tmp_path)
    spec_file.write(build_spec([("a", (0,))], HOOK))

    def no_space(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", no_space)
    with pytest.raises(OSError, match="No space"):
        spec_file.write(build_spec([("b", (0,))], HOOK))
    assert devices(spec_file.path) == ["a"]
    assert os.listdir(tmp_path) == [SPEC_FILE]


def test_only_our_file_is_removed(tmp_path: Path) -> None:
    others = [tmp_path / "nvidia.yaml", tmp_path / "vgpud.io-tenant.yaml"]
    for other in others:
        other.write_text("kept")
    spec_file = SpecFile(tmp_path)
    spec_file.update(build_spec([("a", (0,))], HOOK))
    spec_file.update(build_spec([("idle", ())], HOOK))  # no device: no spec
    assert not spec_file.path.exists()
    spec_file.remove()  # none is no error
    assert [o.read_text() for o in others] == ["kept", "kept"]


def test_the_hook_is_the_vgpuctl_beside_python_on_the_daemons_bus(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "python3").touch()
    vgpuctl = tmp_path / "vgpuctl"
    vgpuctl.touch(mode=0o755)
    monkeypatch.setattr(files.sys, "executable", str(tmp_path / "python3"))
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/run/b")
    assert this_hook() == Hook(str(vgpuctl), ("DBUS_SYSTEM_BUS_ADDRESS=unix:path=/run/b",))
    monkeypatch.delenv("DBUS_SYSTEM_BUS_ADDRESS")
    vgpuctl.unlink()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(OSError, match="no vgpuctl"):
        this_hook()


# --- the keeper, over a real Manager ---


@pytest.fixture
def manager(tmp_path: Path) -> Manager:
    return make_manager(write_config(tmp_path))


@pytest.fixture
def keeper(manager: Manager, tmp_path: Path) -> SpecKeeper:
    keeper = SpecKeeper(manager, SpecFile(tmp_path / "cdi"), HOOK)
    manager.observers.subscribe(keeper)
    return keeper


def spec_path(tmp_path: Path) -> Path:
    return tmp_path / "cdi" / SPEC_FILE


def test_the_spec_follows_the_tenants(manager: Manager, keeper: SpecKeeper,
                                      tmp_path: Path) -> None:
    keeper.start()
    path = spec_path(tmp_path)
    spec = json.loads(path.read_text())
    assert [(d["name"], [n["path"] for n in d["containerEdits"]["deviceNodes"]][2:])
            for d in spec["devices"]] == [("alice", ["/dev/nvidia0", "/dev/nvidia1"]),
                                          ("bob.x-1", ["/dev/nvidia1"]),
                                          ("shared", ["/dev/nvidia0", "/dev/nvidia1"])]
    manager.create_tenant("carol", {"gpus": [0]})
    assert devices(path) == ["alice", "bob.x-1", "shared", "carol"]
    manager.delete_tenant("alice")
    assert devices(path) == ["bob.x-1", "shared", "carol"]
    keeper.stop()
    assert not path.exists()


def test_a_reload_that_moves_a_tenants_gpus_rewrites(manager: Manager, keeper: SpecKeeper,
                                                     tmp_path: Path) -> None:
    keeper.start()
    config = manager.config_path.read_text()
    manager.config_path.write_text(config.replace("gpus = [1]", "gpus = [0]"))
    manager.reload()
    bob = json.loads(spec_path(tmp_path).read_text())["devices"][1]
    assert bob["containerEdits"]["deviceNodes"][2]["path"] == "/dev/nvidia0"


def test_usage_limits_and_bindings_leave_the_file_alone(manager: Manager, keeper: SpecKeeper,
                                                        tmp_path: Path) -> None:
    keeper.start()
    path = spec_path(tmp_path)
    path.write_text("sentinel")  # any rewrite would replace it
    manager.update_tenant("alice", {"memory": "1GiB", "weight": 7})
    manager.bind(4242, "alice")
    open_context(manager, manager._ledger, 1, "alice")
    usage_changed(manager, "alice")
    close_context(manager, manager._ledger, 1)
    assert path.read_text() == "sentinel"


def test_a_spec_that_cannot_be_written_is_logged(manager: Manager, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("")
    keeper = SpecKeeper(manager, SpecFile(tmp_path / "file"), HOOK)
    with caplog.at_level(logging.ERROR):
        keeper.start()
    assert "CDI: cannot write" in caplog.text


def test_skipped_tenants_are_logged_once(manager: Manager, keeper: SpecKeeper,
                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        keeper.start()
        manager.create_tenant("dash-", {})
        manager.create_tenant("other", {})
    assert caplog.text.count("'dash-' has no CDI device") == 1
