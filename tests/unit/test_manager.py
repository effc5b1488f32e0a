"""Manager: validation, persistence before application, reload, ledger limits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.bus import GIB, fake_start, make_manager, write_config
from tests.support.contexts import close_context, open_context, usage_changed
from vgpud.admin.manager import (
    BINDINGS,
    CONTEXTS,
    USAGE,
    AdminError,
    InvalidArgument,
    InvalidConfig,
    Manager,
    ManagerEvent,
    NoSuchTenant,
    SettingsChanged,
    TenantBusy,
    TenantChanged,
    TenantsChanged,
    cgroup2_mount,
)
from vgpud.core.ledger import Denied, Key, Ledger, Reservation, UnknownTenant
from vgpud.core.tenants import Binding, CgroupBinding, Opener, resolve
from vgpud.store.config import load_config
from vgpud.store.state import load_state


class Recorder:
    """An observer of the Manager that records what it hears."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def notify(self, event: ManagerEvent) -> None:
        match event:
            case TenantsChanged(added, removed):
                self.events.append(("tenants", list(added), list(removed)))
            case TenantChanged(name, fields):
                self.events.append(("tenant", name, fields))
            case SettingsChanged():
                self.events.append(("settings",))


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    return write_config(tmp_path)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def manager(config_path: Path, recorder: Recorder) -> Manager:
    manager = make_manager(config_path)
    manager.observers.subscribe(recorder)
    return manager


def snapshot(manager: Manager) -> tuple[object, ...]:
    """Everything a failed change must leave alone."""
    state = manager.state_path.read_bytes() if manager.state_path.exists() else None
    ledger = manager._ledger.snapshot()
    return state, manager.tenants, manager.bindings, ledger, manager.config


def test_ledger_limits_follow_tenants(manager: Manager) -> None:
    assert manager.limits("alice") == {0: 8 * GIB, 1: 8 * GIB}
    assert manager.limits("bob.x-1") == {0: 0, 1: 40 * GIB}  # 50% of GPU 1 only
    assert manager.limits("shared") == {0: 80 * GIB, 1: 80 * GIB}
    assert manager.default_tenant == "shared"


def test_update_persists_then_applies(manager: Manager, recorder: Recorder) -> None:
    manager.update_tenant("alice", {"memory": "4GiB", "weight": 500, "cap": 20})
    assert manager.limits("alice") == {0: 4 * GIB, 1: 4 * GIB}
    alice = manager.tenant("alice")
    assert (alice.weight, alice.cap) == (500, 20)
    assert recorder.events == [("tenant", "alice", frozenset({"memory", "weight", "cap"}))]
    # the state file has it: a restarted daemon sees the same tenants
    assert load_state(manager.state_path).changed == {
        "alice": {"memory": "4GiB", "weight": 500, "cap": 20}
    }
    assert make_manager(manager.config_path).tenants == manager.tenants


def test_object_limits_change_by_kind_and_persist(manager: Manager,
                                                  recorder: Recorder) -> None:
    manager.update_tenant("alice", {"limits": {"channel_groups": 2}})
    manager.update_tenant("alice", {"limits": {"buffers": 0}})
    limits = manager.tenant("alice").limits
    assert (limits.channel_groups, limits.buffers, limits.channels) == (2, 0, 1024)
    assert recorder.events[-1] == ("tenant", "alice", frozenset({"limits"}))
    assert load_state(manager.state_path).changed["alice"]["limits"]["channel_groups"] == 2
    assert make_manager(manager.config_path).tenant("alice").limits == limits
    before = snapshot(manager)
    for bad in ({"channel_groups": -1}, {"tsgs": 1}, {"channels": "8"}):
        with pytest.raises(InvalidArgument):
            manager.update_tenant("alice", {"limits": bad})
    assert snapshot(manager) == before


def test_memory_none_is_the_whole_device(manager: Manager) -> None:
    manager.update_tenant("alice", {"memory": None})
    assert manager.limits("alice") == {0: 80 * GIB, 1: 80 * GIB}


@pytest.mark.parametrize(
    ("name", "changes", "error"),
    [
        ("alice", {"weight": 0}, InvalidArgument),
        ("alice", {"weight": 1001}, InvalidArgument),
        ("alice", {"cap": 101}, InvalidArgument),
        ("alice", {"memory": "-1GiB"}, InvalidArgument),
        ("alice", {"memory": "20EiB"}, InvalidArgument),  # over 2**64-1
        ("alice", {"memory": "8XB"}, InvalidArgument),
        ("alice", {"memory": "150%"}, InvalidArgument),
        ("alice", {"priority": "urgent"}, InvalidArgument),
        ("alice", {"uvm": "deny"}, InvalidArgument),  # not changeable at runtime
        ("alice", {}, InvalidArgument),
        ("Alice", {"weight": 5}, InvalidArgument),
        ("carol", {"weight": 5}, NoSuchTenant),
    ],
)
def test_bad_update_changes_nothing(
    manager: Manager, recorder: Recorder, name: str, changes: dict[str, Any],
    error: type[Exception],
) -> None:
    manager.update_tenant("shared", {"weight": 7})  # a state file exists
    before = snapshot(manager)
    recorder.events.clear()
    with pytest.raises(error):
        manager.update_tenant(name, changes)
    assert snapshot(manager) == before
    assert recorder.events == []


def test_create_and_delete(manager: Manager, recorder: Recorder) -> None:
    fields = {"memory": "1GiB", "gpus": [0], "match": [{"cgroup": "/pods/c*"}, {"uid": 5}]}
    carol = manager.create_tenant("carol", fields)
    assert manager.tenants[-1] == carol
    assert manager.limits("carol") == {0: GIB, 1: 0}
    assert recorder.events == [("tenants", ["carol"], [])]
    manager.delete_tenant("carol")
    assert all(t.name != "carol" for t in manager.tenants)
    with pytest.raises(UnknownTenant):
        manager._ledger.usage("carol", 0)
    assert recorder.events[-1] == ("tenants", [], ["carol"])
    assert load_state(manager.state_path).created == ()


@pytest.mark.parametrize(
    ("name", "fields", "error"),
    [
        ("alice", {}, "exists"),
        ("Carol", {}, "invalid tenant name"),
        ("-carol", {}, "invalid tenant name"),
        ("carol", {"memory": "1 parsec"}, "unknown unit"),
        ("carol", {"pids": [1]}, "unknown tenant fields"),
        ("carol", {"gpus": [-1]}, "GPU index"),
        ("carol", {"match": [{}]}, "needs cgroup or uid"),
    ],
)
def test_bad_create_changes_nothing(
    manager: Manager, name: str, fields: dict[str, Any], error: str
) -> None:
    before = snapshot(manager)
    with pytest.raises(InvalidArgument, match=error):
        manager.create_tenant(name, fields)
    assert snapshot(manager) == before


def test_delete_refuses_default_and_busy_tenants(manager: Manager) -> None:
    with pytest.raises(InvalidArgument, match="default tenant"):
        manager.delete_tenant("shared")
    open_context(manager, manager._ledger, 7, "alice")
    with pytest.raises(TenantBusy, match="1 open contexts"):
        manager.delete_tenant("alice")
    close_context(manager, manager._ledger, 7)
    manager.delete_tenant("alice")
    with pytest.raises(NoSuchTenant):
        manager.delete_tenant("alice")


def test_lowering_a_limit_below_usage(manager: Manager, recorder: Recorder) -> None:
    ledger = manager._ledger
    open_context(manager, manager._ledger, 1, "alice")
    reservation = ledger.reserve(1, 0, 6 * GIB)
    assert isinstance(reservation, Reservation)
    ledger.commit(reservation, Key(1, 2))
    usage_changed(manager, "alice")
    manager.update_tenant("alice", {"memory": "4GiB"})  # accepted, frees nothing
    usage = manager.usage("alice")[0]
    assert (usage.used, usage.limit, usage.free) == (6 * GIB, 4 * GIB, 0)
    denied = ledger.reserve(1, 0, 1)
    assert denied == Denied("alice", 0, 1, 6 * GIB, 4 * GIB)
    ledger.free(Key(1, 2))
    assert isinstance(ledger.reserve(1, 0, 4 * GIB), Reservation)
    assert ("tenant", "alice", frozenset({USAGE})) in recorder.events


def test_contexts(manager: Manager, recorder: Recorder) -> None:
    open_context(manager, manager._ledger, 1, "bob.x-1")
    open_context(manager, manager._ledger, 2, "bob.x-1")
    assert manager.contexts("bob.x-1") == 2
    close_context(manager, manager._ledger, 1)
    assert manager.contexts("bob.x-1") == 1
    assert recorder.events[0] == ("tenant", "bob.x-1", frozenset({CONTEXTS}))
    assert recorder.events[-1] == ("tenant", "bob.x-1", frozenset({CONTEXTS, USAGE}))


def test_bindings(manager: Manager, recorder: Recorder) -> None:
    manager.bind(4242, "alice")
    assert manager.bindings == {4242: Binding("alice", fake_start(4242))}
    assert manager.pids("alice") == (4242,)
    manager.bind(4242, "shared")  # rebinding tells both tenants
    assert recorder.events[-2:] == [
        ("tenant", "alice", frozenset({BINDINGS})), ("tenant", "shared", frozenset({BINDINGS})),
    ]
    before = snapshot(manager)
    with pytest.raises(InvalidArgument, match="invalid pid"):
        manager.bind(0, "alice")
    with pytest.raises(InvalidArgument, match="not bound"):
        manager.unbind(1)
    with pytest.raises(NoSuchTenant):
        manager.bind(1, "carol")
    with pytest.raises(InvalidArgument, match="no process 100001"):
        manager.bind(100_001, "alice")
    assert snapshot(manager) == before
    manager.unbind(4242)
    assert manager.bindings == {}


def test_a_binding_names_one_process(config_path: Path) -> None:
    """The pid of a process that exited, given to another, is not bound; nor
    is a pid after a reboot. Bindings of processes gone are dropped."""
    table = {42: 500, 43: 600}
    config = load_config(config_path)

    def manager(boot: str) -> Manager:
        return Manager(config_path, config, load_state(config.daemon.state_path), Ledger(),
                       (), process_start=table.get, boot_id=boot)

    m = manager("boot-1")
    m.bind(42, "alice")
    m.bind(43, "alice")
    assert m.bindings == {42: Binding("alice", 500), 43: Binding("alice", 600)}
    assert manager("boot-1").bindings == m.bindings  # kept across a daemon restart
    assert manager("boot-2").bindings == {}  # not across a reboot
    table[42] = 900  # 42 exited; a new process got its pid
    m.bind(43, "shared")
    assert m.bindings == {43: Binding("shared", 600)}


def cgroup_manager(config_path: Path, root: Path, boot: str = "boot-1") -> Manager:
    config = load_config(config_path)
    return Manager(config_path, config, load_state(config.daemon.state_path), Ledger(), (),
                   process_start=fake_start, boot_id=boot, cgroup_root=root)


def opener_in(path: str, cgroup_id: int) -> Opener:
    return Opener(pid=9, tgid=9, uid=5, gid=5, cgroup_id=cgroup_id, cgroup_path=path, start=1)


def tenant_of(manager: Manager, path: str, cgroup_id: int) -> str | None:
    """What the quota policy resolves an opener in `path` to."""
    return resolve(opener_in(path, cgroup_id), manager.tenants, manager.bindings,
                   manager.default_tenant, manager.cgroup_bindings, manager.cgroup_id_of)


def test_cgroup_bindings(config_path: Path, tmp_path: Path, recorder: Recorder) -> None:
    """A bound cgroup's id is the daemon's own stat of it; the binding holds
    for it and its subtree, is kept across restarts, not across reboots."""
    root = tmp_path / "cgroup"
    ctr = root / "machine.slice" / "libpod-c1.scope"
    (ctr / "sub").mkdir(parents=True)
    m = cgroup_manager(config_path, root)
    m.observers.subscribe(recorder)
    m.bind_cgroup("/machine.slice/libpod-c1.scope", "alice")
    ino = ctr.stat().st_ino
    assert m.cgroup_bindings == {"/machine.slice/libpod-c1.scope": CgroupBinding(
        "alice", "/machine.slice/libpod-c1.scope", ino)}
    assert m.cgroups("alice") == ("/machine.slice/libpod-c1.scope",)
    assert recorder.events[-1] == ("tenant", "alice", frozenset({BINDINGS}))
    assert tenant_of(m, "/machine.slice/libpod-c1.scope", ino) == "alice"
    assert tenant_of(m, "/machine.slice/libpod-c1.scope/sub", (ctr / "sub").stat().st_ino) \
        == "alice"
    assert tenant_of(m, "/machine.slice", 1) == "shared"
    assert cgroup_manager(config_path, root).cgroup_bindings == m.cgroup_bindings  # restart
    assert cgroup_manager(config_path, root, "boot-2").cgroup_bindings == {}  # reboot
    # Rebinding the path moves it, and tells both tenants.
    m.bind_cgroup("/machine.slice/libpod-c1.scope", "bob.x-1")
    assert m.cgroups("alice") == () and m.cgroups("bob.x-1") == (
        "/machine.slice/libpod-c1.scope",)
    assert recorder.events[-2:] == [("tenant", "alice", frozenset({BINDINGS})),
                                    ("tenant", "bob.x-1", frozenset({BINDINGS}))]
    m.unbind_cgroup("/machine.slice/libpod-c1.scope")
    assert m.cgroup_bindings == {}
    assert tenant_of(m, "/machine.slice/libpod-c1.scope", ino) == "shared"


def test_a_removed_cgroup_is_not_bound_when_remade(config_path: Path, tmp_path: Path) -> None:
    """The binding names the cgroup (its id), not the path: a new cgroup made
    at the same path, and its subtree, are not bound; the next binding
    drops the stale one."""
    root = tmp_path / "cgroup"
    (root / "old").mkdir(parents=True)
    (root / "other").mkdir()
    m = cgroup_manager(config_path, root)
    m.bind_cgroup("/old", "alice")
    (root / "old").rename(root / "kept")  # holds the old inode, so the new one differs
    (root / "old" / "sub").mkdir(parents=True)
    new = (root / "old").stat().st_ino
    assert tenant_of(m, "/old", new) == "shared"
    assert tenant_of(m, "/old/sub", (root / "old" / "sub").stat().st_ino) == "shared"
    m.bind_cgroup("/other", "bob.x-1")
    assert list(m.cgroup_bindings) == ["/other"]
    assert load_state(m.state_path).cgroup_bindings.keys() == {"/other"}


def test_cgroup_bindings_of_a_removed_tenant_stop_applying(config_path: Path,
                                                           tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (root / "c").mkdir(parents=True)
    m = cgroup_manager(config_path, root)
    m.create_tenant("carol", {})
    m.bind_cgroup("/c", "carol")
    assert tenant_of(m, "/c", (root / "c").stat().st_ino) == "carol"
    m.delete_tenant("carol")
    assert m.cgroup_bindings == {}
    assert tenant_of(m, "/c", (root / "c").stat().st_ino) == "shared"
    m.create_tenant("carol", {})  # a new tenant of the same name is not bound
    assert m.cgroup_bindings == {}


@pytest.mark.parametrize(("path", "problem"), [
    ("/", "invalid cgroup path"),
    ("", "invalid cgroup path"),
    ("machine.slice", "invalid cgroup path"),
    ("/machine.slice/", "invalid cgroup path"),
    ("//machine.slice", "invalid cgroup path"),
    ("/a/../machine.slice", "invalid cgroup path"),
    ("/a/./b", "invalid cgroup path"),
    ("/a\0b", "invalid cgroup path"),
    ("/nosuch", "no cgroup /nosuch"),
    ("/file", "no cgroup /file"),  # not a directory
])
def test_bad_cgroup_paths_are_refused(config_path: Path, tmp_path: Path, path: str,
                                      problem: str) -> None:
    root = tmp_path / "cgroup"
    (root / "a" / "b").mkdir(parents=True)
    (root / "machine.slice").mkdir()
    (root / "file").write_text("")
    m = cgroup_manager(config_path, root)
    before = snapshot(m)
    with pytest.raises(InvalidArgument, match=problem):
        m.bind_cgroup(path, "alice")
    with pytest.raises(NoSuchTenant):
        m.bind_cgroup("/machine.slice", "carol")
    with pytest.raises(InvalidArgument, match="not bound"):
        m.unbind_cgroup("/machine.slice")
    assert snapshot(m) == before and m.cgroup_bindings == {}


def test_the_cgroup2_mount_is_found_on_a_hybrid_host(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "35 24 0:30 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
        "36 35 0:31 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
        "37 35 0:32 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,name=systemd\n")
    assert cgroup2_mount(mountinfo) == Path("/sys/fs/cgroup/unified")
    mountinfo.write_text("30 1 0:26 / /sys/fs/cgroup rw shared:4 - cgroup2 cgroup2 rw\n")
    assert cgroup2_mount(mountinfo) == Path("/sys/fs/cgroup")
    assert cgroup2_mount(tmp_path / "nosuch") == Path("/sys/fs/cgroup")


def test_reload_applies_the_new_config(manager: Manager, recorder: Recorder) -> None:
    text = manager.config_path.read_text()
    text = text.replace('weight = 300', 'weight = 30').replace('"shared"\n', '"alice"\n', 1)
    manager.config_path.write_text(text + '\n[[tenant]]\nname = "dave"\n')
    manager.reload()
    assert manager.tenant("bob.x-1").weight == 30
    assert manager.default_tenant == "alice"
    assert ("tenants", ["dave"], []) in recorder.events
    assert ("tenant", "bob.x-1", frozenset({"weight"})) in recorder.events
    assert ("settings",) in recorder.events
    assert manager.limits("dave") == {0: 80 * GIB, 1: 80 * GIB}


@pytest.mark.parametrize(
    "text",
    [
        "[[tenant]\n",  # not TOML
        '[[tenant]]\nname = "a"\n[[tenant]]\nname = "a"\n',  # duplicate
        '[daemon]\ndefault_tenant = "nobody"\n',  # missing default
        '[[tenant]]\nname = "a"\nmemory = "8 bananas"\n',
    ],
)
def test_reload_keeps_the_last_good_config(manager: Manager, text: str) -> None:
    manager.update_tenant("alice", {"weight": 9})
    before = snapshot(manager)
    manager.config_path.write_text(text)
    with pytest.raises(InvalidConfig):
        manager.reload()
    assert snapshot(manager) == before


def test_reload_refuses_to_drop_a_busy_tenant(manager: Manager) -> None:
    open_context(manager, manager._ledger, 1, "bob.x-1")
    text = manager.config_path.read_text()
    manager.config_path.write_text(text.replace('name = "bob.x-1"', 'name = "robert"'))
    before = snapshot(manager)
    with pytest.raises(TenantBusy):
        manager.reload()
    assert snapshot(manager) == before


def test_a_failed_save_changes_nothing(manager: Manager) -> None:
    manager.state_path = manager.state_path.parent / "missing" / "state.json"
    before = snapshot(manager)
    with pytest.raises(AdminError, match="cannot save"):
        manager.update_tenant("alice", {"weight": 5})
    with pytest.raises(AdminError, match="cannot save"):
        manager.create_tenant("carol", {})
    assert snapshot(manager) == before


def test_no_gpus(config_path: Path) -> None:
    manager = make_manager(config_path)
    empty = Manager(config_path, manager.config, load_state(manager.state_path),
                    Ledger(), ())
    assert empty.limits("alice") == {}
    empty.create_tenant("carol", {})
    empty.delete_tenant("carol")

