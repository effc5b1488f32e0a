"""Manager: validation, persistence before application, reload, ledger limits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.bus import GIB, fake_start, make_manager, write_config
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
    QuotaExceeded,
    SettingsChanged,
    TenantBusy,
    TenantChanged,
    TenantsChanged,
)
from vgpud.core.ledger import Denied, Key, Ledger, Reservation, UnknownTenant
from vgpud.core.tenants import Binding
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
            case QuotaExceeded(denied):
                self.events.append(("quota", denied))


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
    manager.open_context(7, "alice")
    with pytest.raises(TenantBusy, match="1 open contexts"):
        manager.delete_tenant("alice")
    manager.close_context(7)
    manager.delete_tenant("alice")
    with pytest.raises(NoSuchTenant):
        manager.delete_tenant("alice")


def test_lowering_a_limit_below_usage(manager: Manager, recorder: Recorder) -> None:
    ledger = manager._ledger
    manager.open_context(1, "alice")
    reservation = ledger.reserve(1, 0, 6 * GIB)
    assert isinstance(reservation, Reservation)
    ledger.commit(reservation, Key(1, 2))
    manager.usage_changed("alice")
    manager.update_tenant("alice", {"memory": "4GiB"})  # accepted, frees nothing
    usage = manager.usage("alice")[0]
    assert (usage.used, usage.limit, usage.free) == (6 * GIB, 4 * GIB, 0)
    denied = ledger.reserve(1, 0, 1)
    assert denied == Denied("alice", 0, 1, 6 * GIB, 4 * GIB)
    manager.quota_exceeded(denied)
    ledger.free(Key(1, 2))
    assert isinstance(ledger.reserve(1, 0, 4 * GIB), Reservation)
    assert ("quota", denied) in recorder.events
    assert ("tenant", "alice", frozenset({USAGE})) in recorder.events


def test_contexts(manager: Manager, recorder: Recorder) -> None:
    manager.open_context(1, "bob.x-1")
    manager.open_context(2, "bob.x-1")
    assert manager.contexts("bob.x-1") == 2
    manager.close_context(1)
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
    manager.open_context(1, "bob.x-1")
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

