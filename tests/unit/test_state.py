"""Runtime state: merge over the config, changes, atomic persistence."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from vgpud.core.tenants import Binding, CgroupBinding, MatchRule, MemoryLimit, Priority, Tenant
from vgpud.store.state import (
    CgroupPathBinding,
    ChangeError,
    PidBinding,
    RuntimeState,
    StateError,
    load_state,
    save_state,
)

CONFIG = (
    Tenant(name="a", match=(MatchRule(uid=1),), weight=10),
    Tenant(name="b", memory=MemoryLimit.parse("1GiB")),
    Tenant(name="c"),
)


def names(state: RuntimeState, config: tuple[Tenant, ...] = CONFIG) -> list[str]:
    return [t.name for t in state.tenants(config)]


# --- merge and changes ---


def test_empty_state_is_the_config() -> None:
    assert RuntimeState().tenants(CONFIG) == CONFIG


def test_change_overrides_only_changed_fields() -> None:
    state = RuntimeState().change(CONFIG, "a", weight=500, memory="50%", cap=20)
    state = state.change(CONFIG, "a", priority="priority")
    a = state.tenants(CONFIG)[0]
    assert (a.weight, a.memory, a.cap, a.priority) == (
        500, MemoryLimit.parse("50%"), 20, Priority.PRIORITY,
    )  # fmt: skip
    # the config's other fields still apply, and later config edits too
    edited = (CONFIG[0].replace(match=[{"uid": 2}]), *CONFIG[1:])
    assert state.tenants(edited)[0].match == (MatchRule(uid=2),)
    assert state.tenants(edited)[0].weight == 500


def test_change_back_to_none() -> None:
    state = RuntimeState().change(CONFIG, "b", memory=None, cap=None)
    assert state.tenants(CONFIG)[1].memory is None


@pytest.mark.parametrize(
    "fields", [{"weight": 0}, {"cap": 101}, {"memory": "8XB"}, {"name": "z"}, {"gpus": [0]}]
)
def test_bad_change(fields: dict[str, object]) -> None:
    with pytest.raises(ChangeError):
        RuntimeState().change(CONFIG, "a", **fields)


def test_change_unknown_tenant() -> None:
    with pytest.raises(ChangeError, match="no tenant named 'z'"):
        RuntimeState().change(CONFIG, "z", weight=1)


def test_create_appends_and_refuses_existing() -> None:
    state = RuntimeState().create(CONFIG, Tenant(name="d", weight=7))
    assert names(state) == ["a", "b", "c", "d"]
    with pytest.raises(ChangeError, match="exists"):
        state.create(CONFIG, Tenant(name="a"))
    with pytest.raises(ChangeError, match="exists"):
        state.create(CONFIG, Tenant(name="d"))
    state = state.change(CONFIG, "d", weight=8)
    assert state.tenants(CONFIG)[3].weight == 8
    assert state.changed == {}


def test_delete_config_tenant_then_recreate_in_place() -> None:
    state = RuntimeState().change(CONFIG, "a", weight=3).delete(CONFIG, "a")
    assert names(state) == ["b", "c"]
    assert state.changed == {}
    with pytest.raises(ChangeError):
        state.delete(CONFIG, "a")
    state = state.create(CONFIG, Tenant(name="a", weight=99))
    assert names(state) == ["a", "b", "c"]  # the config position: rule precedence
    assert state.tenants(CONFIG)[0].weight == 99
    assert state.tenants(CONFIG)[0].match == ()  # state replaces config for that name
    assert state.deleted == ()


def test_delete_runtime_tenant() -> None:
    state = RuntimeState().create(CONFIG, Tenant(name="d")).delete(CONFIG, "d")
    assert state == RuntimeState()


def pb(tenant: str, start: int = 7, boot: str = "boot-1") -> PidBinding:
    return PidBinding(tenant=tenant, start=start, boot_id=boot)


def test_bindings() -> None:
    state = RuntimeState().create(CONFIG, Tenant(name="d")).bind(CONFIG, 42, pb("d"))
    state = state.bind(CONFIG, 43, pb("a", 9))
    assert state.effective_bindings(CONFIG, "boot-1") == {42: Binding("d", 7),
                                                          43: Binding("a", 9)}
    with pytest.raises(ChangeError):
        state.bind(CONFIG, 44, pb("zz"))
    with pytest.raises(ChangeError):
        state.bind(CONFIG, 0, pb("a"))
    state = state.delete(CONFIG, "d")
    assert state.bindings == {43: pb("a", 9)}
    # a config edit that drops the tenant makes the binding inert, not an error
    assert state.effective_bindings(CONFIG[1:], "boot-1") == {}
    # a binding names a process of one boot: after a reboot it binds nothing
    assert state.effective_bindings(CONFIG, "boot-2") == {}
    assert state.without_bindings({43}).bindings == {}
    assert state.without_bindings({44}) is state
    state = state.unbind(43)
    assert state.bindings == {}
    with pytest.raises(ChangeError):
        state.unbind(43)


def cb(tenant: str, cgroup_id: int = 70, boot: str = "boot-1") -> CgroupPathBinding:
    return CgroupPathBinding(tenant=tenant, cgroup_id=cgroup_id, boot_id=boot)


def test_cgroup_bindings() -> None:
    state = (RuntimeState().create(CONFIG, Tenant(name="d"))
             .bind_cgroup(CONFIG, "/m.slice/x", cb("d"))
             .bind_cgroup(CONFIG, "/m.slice/y", cb("a", 71)))
    assert state.effective_cgroup_bindings(CONFIG, "boot-1") == (
        CgroupBinding("d", "/m.slice/x", 70), CgroupBinding("a", "/m.slice/y", 71))
    # the same path again: replaced (a new cgroup there, or another tenant)
    state = state.bind_cgroup(CONFIG, "/m.slice/x", cb("c", 72))
    assert state.cgroup_bindings["/m.slice/x"] == cb("c", 72)
    with pytest.raises(ChangeError, match="no tenant"):
        state.bind_cgroup(CONFIG, "/m.slice/z", cb("zz"))
    for bad in ("", "/", "m.slice", "/m.slice/", "/a//b", "/a/../b", "/a/./b"):
        with pytest.raises(ChangeError, match="normalized"):
            state.bind_cgroup(CONFIG, bad, cb("a"))
    state = state.bind_cgroup(CONFIG, "/m.slice/x", cb("d")).delete(CONFIG, "d")
    assert state.cgroup_bindings == {"/m.slice/y": cb("a", 71)}  # deleted with its tenant
    assert state.effective_cgroup_bindings(CONFIG[1:], "boot-1") == ()  # inert
    assert state.effective_cgroup_bindings(CONFIG, "boot-2") == ()  # ids of another boot
    assert state.without_cgroups({"/m.slice/q"}) is state
    assert state.without_cgroups({"/m.slice/y"}).cgroup_bindings == {}
    state = state.unbind_cgroup("/m.slice/y")
    assert state.cgroup_bindings == {}
    with pytest.raises(ChangeError, match="not bound"):
        state.unbind_cgroup("/m.slice/y")


def test_entries_for_tenants_gone_from_config_are_ignored() -> None:
    state = RuntimeState().change(CONFIG, "a", weight=3).delete(CONFIG, "b")
    assert names(state, (Tenant(name="c"),)) == ["c"]


def test_inconsistent_state_rejected() -> None:
    with pytest.raises(ValueError):
        RuntimeState(created=(Tenant(name="a"), Tenant(name="a")))
    with pytest.raises(ValueError):
        RuntimeState(created=(Tenant(name="a"),), deleted=("a",))
    with pytest.raises(ValueError):
        RuntimeState(changed={"a": {"match": []}})
    with pytest.raises(ValueError):
        RuntimeState(changed={"a": {"weight": 0}})


# --- persistence ---


def full_state() -> RuntimeState:
    return (
        RuntimeState()
        .change(CONFIG, "a", weight=5, memory="12.5%", cap=None, priority="priority")
        .create(CONFIG, Tenant(name="d", memory="512MiB", gpus=[1], pids=[9]))
        .delete(CONFIG, "b")
        .bind(CONFIG, 1234, pb("d", 55))
        .bind_cgroup(CONFIG, "/machine.slice/libpod-c1.scope", cb("d", 4026))
    )


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state = full_state()
    save_state(state, path)
    loaded = load_state(path)
    assert loaded == state
    assert loaded.tenants(CONFIG) == state.tenants(CONFIG)
    assert json.loads(path.read_text())["bindings"] == {
        "1234": {"tenant": "d", "start": 55, "boot_id": "boot-1"}}
    assert json.loads(path.read_text())["cgroup_bindings"] == {
        "/machine.slice/libpod-c1.scope": {"tenant": "d", "cgroup_id": 4026,
                                           "boot_id": "boot-1"}}
    assert loaded.effective_cgroup_bindings(CONFIG, "boot-1") == (
        CgroupBinding("d", "/machine.slice/libpod-c1.scope", 4026),)
    assert os.listdir(tmp_path) == ["state.json"]


def test_missing_file_is_empty_state(tmp_path: Path) -> None:
    assert load_state(tmp_path / "state.json") == RuntimeState()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{", "not JSON"),
        ("", "not JSON"),
        ("[]", "corrupt"),
        ('{"version": 3}', "version"),
        ('{"bindings": {"x": {"tenant": "a", "start": 1, "boot_id": "b"}}}', "bindings"),
        ('{"bindings": {"1": {"tenant": "a", "start": -1, "boot_id": "b"}}}', "bindings"),
        ('{"cgroup_bindings": {"/x/../y": {"tenant": "a", "cgroup_id": 1, "boot_id": "b"}}}',
         "cgroup_bindings"),
        ('{"cgroup_bindings": {"/x": {"tenant": "a", "cgroup_id": 0, "boot_id": "b"}}}',
         "cgroup_bindings"),
        ('{"created": [{"name": "A"}]}', "created[0].name"),
        ('{"surprise": 1}', "surprise"),
        ('{"created": [{"name": "a"}], "deleted": ["a"]}', "corrupt"),
    ],
)
def test_corrupt_file_is_a_clear_error(tmp_path: Path, content: str, problem: str) -> None:
    path = tmp_path / "state.json"
    path.write_text(content)
    with pytest.raises(StateError, match=re.escape(problem)) as info:
        load_state(path)
    assert info.value.path == str(path)


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(StateError, match="cannot read"):
        load_state(tmp_path)  # a directory


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_crash_during_write_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    path = tmp_path / "state.json"
    old = RuntimeState().bind(CONFIG, 1, pb("a"))
    save_state(old, path)
    old_bytes = path.read_bytes()

    def crash(*args: object) -> None:
        raise OSError("simulated crash")

    monkeypatch.setattr(os, failing, crash)
    with pytest.raises(OSError, match="simulated crash"):
        save_state(full_state(), path)
    monkeypatch.undo()
    assert path.read_bytes() == old_bytes
    assert load_state(path) == old
    assert os.listdir(tmp_path) == ["state.json"]  # no temp file left behind


def test_write_fsyncs_file_and_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.isdir(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save_state(full_state(), tmp_path / "state.json")
    assert synced == [False, True]


def test_first_write_creates_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    save_state(RuntimeState(), path)
    assert load_state(path) == RuntimeState()


def test_version_1_bindings_are_dropped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A bare pid could be inherited by any later process: not trusted."""
    path = tmp_path / "state.json"
    path.write_text('{"version": 1, "bindings": {"42": "a"}}')
    assert load_state(path).bindings == {}
    assert "binding of pid 42 to a has no process start time" in caplog.text
