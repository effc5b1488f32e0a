"""The D-Bus API on a private system-like bus: dbus-fast, busctl and gdbus clients."""

from __future__ import annotations

import asyncio
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from dbus_fast import DBusError, Message, MessageType, Variant
from dbus_fast.introspection import Interface, Node

from tests.support.bus import (
    GIB,
    REPO,
    PrivateBus,
    ServiceThread,
    add_match,
    as_nobody,
    make_manager,
    properties_changed,
    write_config,
)
from tests.support.contexts import open_context
from vgpud.admin.auth import Caller, is_admin
from vgpud.admin.client import AdminClient
from vgpud.admin.dbus import introspection_xml, tenant_path
from vgpud.core.ledger import Denied
from vgpud.policy.events import QuotaExceeded

T = TypeVar("T")


def with_client(action: Callable[[AdminClient], Awaitable[T]]) -> T:
    return asyncio.run(AdminClient.run(action))


def call(member: str, signature: str = "", *body: Any) -> Any:
    return with_client(lambda c: c.call(member, signature, *body))


def tenant(name: str) -> dict[str, Any]:
    return with_client(lambda c: c.tenant_properties(tenant_path(name)))


def state_bytes(service: ServiceThread) -> bytes | None:
    path = service.manager.state_path
    return path.read_bytes() if path.exists() else None


def test_tenant_paths_escape_names() -> None:
    assert tenant_path("alice") == "/org/vgpud1/tenant/alice"
    assert tenant_path("bob.x-1") == "/org/vgpud1/tenant/bob_2ex_2d1"
    assert tenant_path("a_b") == "/org/vgpud1/tenant/a_5fb"


def test_busctl_lists_tenants(service: ServiceThread, system_bus: PrivateBus) -> None:
    out = subprocess.run(
        ["busctl", f"--address={system_bus.address}", "call", "org.vgpud1", "/org/vgpud1",
         "org.vgpud1.Manager", "ListTenants"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout
    assert out == ('a(so) 3 "alice" "/org/vgpud1/tenant/alice" "bob.x-1" '
                   '"/org/vgpud1/tenant/bob_2ex_2d1" "shared" "/org/vgpud1/tenant/shared"\n')


def test_gdbus_reads_properties(service: ServiceThread, system_bus: PrivateBus) -> None:
    out = subprocess.run(
        ["gdbus", "call", "--address", system_bus.address, "--dest", "org.vgpud1",
         "--object-path", tenant_path("bob.x-1"), "--method",
         "org.freedesktop.DBus.Properties.Get", "org.vgpud1.Tenant", "MemoryLimitBytes"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout
    assert out == "(<{uint32 0: uint64 0, 1: 42949672960}>,)\n"


def test_reads(service: ServiceThread) -> None:
    assert call("ListTenants")[0] == ("alice", "/org/vgpud1/tenant/alice")
    assert call("GetTenant", "s", "bob.x-1") == tenant_path("bob.x-1")
    assert call("GetGpus") == [(0, "NVIDIA H100 (sim)", 80 * GIB, 0),
                               (1, "NVIDIA H100 (sim)", 80 * GIB, 0)]
    assert with_client(lambda c: c.manager_properties()) == {
        "Version": "0.1.0", "DefaultTenant": "shared",
        "Probes": "off: not part of this daemon", "SchedMode": {},
    }
    assert tenant("alice") == {
        "Name": "alice", "MemoryLimit": "8GiB", "MemoryLimitBytes": {0: 8 * GIB, 1: 8 * GIB},
        "MemoryUsed": {0: 0, 1: 0}, "Contexts": 0, "Gpus": [0, 1], "Weight": 100, "Cap": 0,
        "Priority": "best-effort", "Uvm": "count", "Match": [{"uid": 1000}], "Pids": [],
        "Cgroups": [],
        "Share": {}, "MeasuredShare": {},  # no scheduler behind this service
        "Timeslices": {}, "Preemptions": {},
        "Limits": {"channel_groups": 256, "channels": 1024, "context_shares": 1024,
                   "va_spaces": 64, "buffers": 256},
    }


def test_every_change(service: ServiceThread) -> None:
    options = {"memory": Variant("s", "1GiB"), "match-cgroup": Variant("as", ["/pods/c*"]),
               "match-uid": Variant("au", [5]), "gpus": Variant("au", [1]),
               "uvm": Variant("s", "deny"), "weight": Variant("u", 10),
               "cap": Variant("u", 0), "priority": Variant("s", "priority")}
    assert call("CreateTenant", "sa{sv}", "c.d", options) == tenant_path("c.d")
    created = tenant("c.d")
    assert created["Match"] == [{"cgroup": "/pods/c*"}, {"uid": 5}]
    assert (created["MemoryLimitBytes"], created["Uvm"]) == ({0: 0, 1: GIB}, "deny")
    call("SetMemoryLimit", "ss", "c.d", "25%")
    call("SetWeight", "su", "c.d", 999)
    call("SetCap", "su", "c.d", 40)
    call("SetPriority", "ss", "c.d", "best-effort")
    call("BindProcess", "us", 4242, "c.d")
    changed = tenant("c.d")
    assert (changed["MemoryLimit"], changed["MemoryLimitBytes"][1]) == ("25%", 20 * GIB)
    assert (changed["Weight"], changed["Cap"], changed["Priority"]) == (999, 40, "best-effort")
    assert changed["Pids"] == [4242]
    call("UpdateTenant", "sa{sv}", "c.d", {"memory": Variant("s", ""),
                                           "cap": Variant("u", 0)})
    assert (tenant("c.d")["MemoryLimit"], tenant("c.d")["Cap"]) == ("", 0)
    # Object limits: the kinds given change, the others stay.
    call("UpdateTenant", "sa{sv}", "c.d", {"limits": Variant("a{su}", {"channel_groups": 4})})
    call("UpdateTenant", "sa{sv}", "c.d", {"limits": Variant("a{su}", {"va_spaces": 0})})
    limits = tenant("c.d")["Limits"]
    assert (limits["channel_groups"], limits["va_spaces"], limits["channels"]) == (4, 0, 1024)
    call("UnbindProcess", "u", 4242)
    assert tenant("c.d")["Pids"] == []
    call("DeleteTenant", "s", "c.d")
    with pytest.raises(DBusError) as error:
        tenant("c.d")
    assert error.value.type == "org.freedesktop.DBus.Error.UnknownObject"
    call("Reload")


@pytest.mark.parametrize(
    ("member", "signature", "body", "error"),
    [
        ("SetMemoryLimit", "ss", ["alice", "-1GiB"], "InvalidArgument"),
        ("SetMemoryLimit", "ss", ["alice", "99999999EiB"], "InvalidArgument"),
        ("SetMemoryLimit", "ss", ["alice", "8 GB of RAM"], "InvalidArgument"),
        ("SetMemoryLimit", "ss", ["alice", "8XiB"], "InvalidArgument"),
        ("SetMemoryLimit", "ss", ["nobody", "8GiB"], "NoSuchTenant"),
        ("SetMemoryLimit", "ss", ["../etc", "8GiB"], "InvalidArgument"),
        ("SetWeight", "su", ["alice", 0], "InvalidArgument"),
        ("SetWeight", "su", ["alice", 2**32 - 1], "InvalidArgument"),
        ("SetCap", "su", ["alice", 101], "InvalidArgument"),
        ("SetPriority", "ss", ["alice", "realtime"], "InvalidArgument"),
        ("UpdateTenant", "sa{sv}", ["alice", {"uvm": Variant("s", "deny")}], "InvalidArgument"),
        ("UpdateTenant", "sa{sv}", ["alice", {"weight": Variant("s", "5")}], "InvalidArgument"),
        ("UpdateTenant", "sa{sv}", ["alice", {}], "InvalidArgument"),
        ("UpdateTenant", "sa{sv}", ["alice", {"limits": Variant("a{su}", {"gpus": 1})}],
         "InvalidArgument"),
        ("UpdateTenant", "sa{sv}", ["alice", {"limits": Variant("a{su}",
                                                                {"channels": 1_000_001})}],
         "InvalidArgument"),
        ("UpdateTenant", "sa{sv}", ["alice", {"limits": Variant("a{st}", {"channels": 1})}],
         "InvalidArgument"),
        ("CreateTenant", "sa{sv}", ["carol", {"match-uid": Variant("au", [7]),
                                              "limits": Variant("a{su}", {"tsg": 1})}],
         "InvalidArgument"),
        ("CreateTenant", "sa{sv}", ["alice", {}], "InvalidArgument"),
        ("CreateTenant", "sa{sv}", ["Bad Name", {}], "InvalidArgument"),
        ("CreateTenant", "sa{sv}", ["carol", {"pids": Variant("au", [1])}], "InvalidArgument"),
        ("CreateTenant", "sa{sv}", ["carol", {"gpus": Variant("au", [999])}],
         "InvalidArgument"),
        ("DeleteTenant", "s", ["carol"], "NoSuchTenant"),
        ("DeleteTenant", "s", ["shared"], "InvalidArgument"),
        ("BindProcess", "us", [0, "alice"], "InvalidArgument"),
        ("BindProcess", "us", [42, "carol"], "NoSuchTenant"),
        ("UnbindProcess", "u", [42], "InvalidArgument"),
        ("GetTenant", "s", ["carol"], "NoSuchTenant"),
    ],
)
def test_bad_requests_change_nothing(
    service: ServiceThread, member: str, signature: str, body: list[Any], error: str
) -> None:
    call("SetWeight", "su", "shared", 7)  # a state file exists
    before = state_bytes(service), tenant("alice")
    with pytest.raises(DBusError) as raised:
        call(member, signature, *body)
    assert raised.value.type == f"org.vgpud1.Error.{error}"
    assert (state_bytes(service), tenant("alice")) == before


def test_busy_tenant(service: ServiceThread) -> None:
    service.call(open_context, service.manager, service.manager._ledger, 1, "alice")
    assert tenant("alice")["Contexts"] == 1
    with pytest.raises(DBusError) as raised:
        call("DeleteTenant", "s", "alice")
    assert raised.value.type == "org.vgpud1.Error.TenantBusy"


def test_reload_with_a_bad_config(service: ServiceThread) -> None:
    service.manager.config_path.write_text("[[tenant]]\nname = 7\n")
    with pytest.raises(DBusError) as raised:
        call("Reload")
    assert raised.value.type == "org.vgpud1.Error.InvalidConfig"
    assert "tenant[0].name" in raised.value.text
    assert len(call("ListTenants")) == 3


MUTATIONS = [
    ["CreateTenant", "carol", "{}"],
    ["DeleteTenant", "alice"],
    ["SetMemoryLimit", "alice", "1GiB"],
    ["SetWeight", "alice", "5"],
    ["SetCap", "alice", "5"],
    ["SetPriority", "alice", "priority"],
    ["UpdateTenant", "alice", "{'weight': <uint32 5>}"],
    ["BindProcess", "42", "alice"],
    ["UnbindProcess", "42"],
    ["Reload"],
]


def gdbus_as_nobody(address: str, member: str, *args: str) -> subprocess.CompletedProcess[str]:
    return as_nobody("gdbus", "call", "--address", address, "--dest", "org.vgpud1",
                     "--object-path", "/org/vgpud1", "--method", f"org.vgpud1.Manager.{member}",
                     *args)


def test_unprivileged_callers_are_refused(
    service: ServiceThread, system_bus: PrivateBus
) -> None:
    call("BindProcess", "us", 42, "shared")
    before = state_bytes(service)
    for member, *args in MUTATIONS:
        result = gdbus_as_nobody(system_bus.address, member, *args)
        assert result.returncode == 1, (member, result)
        assert "org.vgpud1.Error.PermissionDenied" in result.stderr, (member, result.stderr)
    assert state_bytes(service) == before
    # reads are open to everyone
    read = gdbus_as_nobody(system_bus.address, "GetTenant", "alice")
    assert read.stdout == "(objectpath '/org/vgpud1/tenant/alice',)\n"


def test_admin_group_members_may_change(system_bus: PrivateBus, tmp_path: Path) -> None:
    # setpriv --regid=65534 gives the caller group nogroup (65534)
    thread = ServiceThread(make_manager(write_config(tmp_path, admin_group="nogroup")))
    try:
        result = gdbus_as_nobody(system_bus.address, "SetWeight", "alice", "5")
        assert result.returncode == 0, result.stderr
        assert thread.manager.tenant("alice").weight == 5
    finally:
        thread.close()


def test_properties_changed_on_set_memory_limit(service: ServiceThread) -> None:
    async def run(client: AdminClient) -> Message:
        received = await properties_changed(client)
        await client.call("SetMemoryLimit", "ss", "alice", "2GiB")
        return await asyncio.wait_for(received.get(), 5)

    msg = with_client(run)
    assert msg.path == tenant_path("alice")
    interface, changed, invalidated = msg.body
    assert interface == "org.vgpud1.Tenant"
    assert {k: v.value for k, v in changed.items()} == {
        "MemoryLimit": "2GiB", "MemoryLimitBytes": {0: 2 * GIB, 1: 2 * GIB}
    }
    assert invalidated == []


def test_quota_exceeded_and_tenant_signals(service: ServiceThread) -> None:
    denied = Denied("alice", 1, 5 * GIB, 4 * GIB, 8 * GIB)

    async def run(client: AdminClient) -> list[tuple[str, list[Any]]]:
        received: asyncio.Queue[tuple[str, list[Any]]] = asyncio.Queue()

        def on_message(msg: Message) -> None:
            if msg.message_type == MessageType.SIGNAL and msg.interface == "org.vgpud1.Manager":
                received.put_nowait((msg.member or "", msg.body))

        client.bus.add_message_handler(on_message)
        await add_match(client, "type='signal',sender='org.vgpud1',"
                                "interface='org.vgpud1.Manager'")
        for _ in range(3):  # one signal per (tenant, GPU) and second
            service.call(service.quota.notify, QuotaExceeded(denied))
        await client.call("CreateTenant", "sa{sv}", "carol", {})
        await client.call("DeleteTenant", "s", "carol")
        return [await asyncio.wait_for(received.get(), 5) for _ in range(3)]

    assert with_client(run) == [
        ("QuotaExceeded", ["alice", 1, 5 * GIB, 4 * GIB, 8 * GIB]),
        ("TenantAdded", ["carol", tenant_path("carol")]),
        ("TenantRemoved", ["carol", tenant_path("carol")]),
    ]


def test_introspection_matches_docs(service: ServiceThread) -> None:
    documented = (REPO / "docs" / "org.vgpud1.xml").read_text()
    assert documented == introspection_xml(), (
        "docs/org.vgpud1.xml is stale: python -m vgpud.admin.dbus > docs/org.vgpud1.xml"
    )
    docs = {i.name: i for i in Node.parse(documented).interfaces}

    async def introspect(client: AdminClient) -> list[Node]:
        nodes = []
        for path in ("/org/vgpud1", tenant_path("alice")):
            reply = await client.bus.call(Message(
                destination="org.vgpud1", path=path,
                interface="org.freedesktop.DBus.Introspectable", member="Introspect",
            ))
            assert reply is not None
            nodes.append(Node.parse(reply.body[0]))
        return nodes

    manager, tenant = with_client(introspect)
    for node, name in ((manager, "org.vgpud1.Manager"), (tenant, "org.vgpud1.Tenant")):
        live = {i.name: i for i in node.interfaces}
        assert xml(live[name]) == xml(docs[name])


def xml(interface: Interface) -> str:
    return ET.tostring(interface.to_xml(), encoding="unicode")


def test_name_is_owned_once(service: ServiceThread, tmp_path: Path) -> None:
    (tmp_path / "second").mkdir()
    with pytest.raises(RuntimeError, match="already owned"):
        ServiceThread(make_manager(write_config(tmp_path / "second")))


@pytest.mark.parametrize(
    ("caller", "group", "allowed"),
    [
        (Caller(0, ()), "no-such-group", True),
        (Caller(65534, (65534,)), "nogroup", True),
        (Caller(65534, (100,)), "nogroup", False),  # the bus's groups are the truth
        (Caller(65534, None), "nogroup", True),  # nobody's primary group, from the database
        (Caller(65534, None), "root", False),
        (Caller(65534, (65534,)), "no-such-group", False),
        (Caller(4_000_000, None), "nogroup", False),  # no such user
    ],
)
def test_is_admin(caller: Caller, group: str, allowed: bool) -> None:
    assert is_admin(caller, group) is allowed
