"""The CDI spec of the tenants: exact content, CDI's own rules, names, the hook's input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpud.cdi.hook import (
    MAX_STATE_BYTES,
    ContainerState,
    cgroup_v2_path,
    container_pid,
    container_state,
    record_name,
    within,
)
from vgpud.cdi.spec import (
    Hook,
    InvalidDeviceName,
    build_spec,
    device_name,
    render,
    tenant_gpus,
)
from vgpud.core.tenants import validate_name

HOOK = Hook("/usr/bin/vgpuctl")

# --- CDI 0.5's rules, written from the spec and container-device-interface
# 0.5 (what podman 4.3.1 vendors), independently of vgpud.cdi.spec ---
CDI_VERSIONS = {"0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0"}
OCI_HOOKS = {"prestart", "createRuntime", "createContainer", "startContainer", "poststart",
             "poststop"}
_VENDOR = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*[A-Za-z0-9]")
_CLASS = re.compile(r"[A-Za-z][A-Za-z0-9_-]*[A-Za-z0-9]")
_DEVICE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")


def cdi_problems(spec: dict[str, Any]) -> list[str]:
    """What a CDI 0.5 consumer would reject in ``spec`` (empty: nothing)."""
    problems = []
    if spec.get("cdiVersion") not in CDI_VERSIONS:
        problems.append(f"cdiVersion {spec.get('cdiVersion')!r}")
    vendor, _, cls = str(spec.get("kind", "")).partition("/")
    if not _VENDOR.fullmatch(vendor) or not _CLASS.fullmatch(cls):
        problems.append(f"kind {spec.get('kind')!r}")
    names = [d.get("name", "") for d in spec.get("devices", [])]
    if len(set(names)) != len(names):
        problems.append("duplicate device names")
    for device in spec.get("devices", []):
        if not _DEVICE.fullmatch(device.get("name", "")):
            problems.append(f"device name {device.get('name')!r}")
        edits = device.get("containerEdits", {})
        if not edits:
            problems.append(f"device {device.get('name')!r} edits nothing")
        for node in edits.get("deviceNodes", []):
            for key in ("path", "hostPath"):
                if key in node and not node[key].startswith("/"):
                    problems.append(f"node {key} {node[key]!r}")
            if "hostPath" in node and spec.get("cdiVersion") < "0.5.0":
                problems.append("hostPath before 0.5.0")
        for hook in edits.get("hooks", []):
            if hook.get("hookName") not in OCI_HOOKS or not hook.get("path", "").startswith("/"):
                problems.append(f"hook {hook!r}")
            if any("=" not in e for e in hook.get("env", [])):
                problems.append(f"hook env {hook['env']!r}")
    return problems


def test_the_spec_of_two_tenants_exactly() -> None:
    spec = build_spec([("alice", (0, 1)), ("bob.x-1", (1,))],
                      Hook("/usr/bin/vgpuctl", ("DBUS_SYSTEM_BUS_ADDRESS=unix:path=/b",)))
    hook = {"path": "/usr/bin/vgpuctl", "env": ["DBUS_SYSTEM_BUS_ADDRESS=unix:path=/b"]}
    unbind = {**hook, "hookName": "poststop", "args": ["vgpuctl", "cdi", "unbind"]}

    def bind(tenant: str) -> dict[str, object]:
        return {**hook, "hookName": "createRuntime", "args": ["vgpuctl", "cdi", "bind", tenant]}

    def node(name: str) -> dict[str, str]:
        return {"path": f"/dev/{name}", "hostPath": f"/dev/vgpu/{name}"}

    assert spec.skipped == ()
    assert json.loads(render(spec)) == spec.content == {
        "cdiVersion": "0.5.0",
        "kind": "vgpud.io/tenant",
        "devices": [
            {"name": "alice", "containerEdits": {
                "deviceNodes": [node("nvidiactl"), node("nvidia-uvm"), node("nvidia0"),
                                node("nvidia1")],
                "hooks": [bind("alice"), unbind]}},
            {"name": "bob.x-1", "containerEdits": {
                "deviceNodes": [node("nvidiactl"), node("nvidia-uvm"), node("nvidia1")],
                "hooks": [bind("bob.x-1"), unbind]}},
        ],
    }
    assert cdi_problems(spec.content) == []
    assert render(spec).endswith(b"}\n")


def test_without_a_bus_address_the_hooks_have_no_environment() -> None:
    hooks = build_spec([("a", (0,))], HOOK).content["devices"][0]["containerEdits"]["hooks"]
    assert [h["hookName"] for h in hooks] == ["createRuntime", "poststop"]
    assert all("env" not in hook for hook in hooks)


def test_tenants_without_a_device_are_skipped_with_the_reason() -> None:
    spec = build_spec([("a-", (0,)), ("idle", ()), ("ok", (2,))], HOOK)
    assert [d["name"] for d in spec.content["devices"]] == ["ok"]
    assert [name for name, _ in spec.skipped] == ["a-", "idle"]
    assert "ends with a letter or digit" in spec.skipped[0][1]
    assert "may use no GPU" in spec.skipped[1][1]


@given(st.from_regex(r"[a-z0-9][a-z0-9._-]{0,31}", fullmatch=True))
def test_every_tenant_name_is_its_device_or_refused(name: str) -> None:
    validate_name(name)
    try:
        assert device_name(name) == name  # one tenant, one device: never renamed
    except InvalidDeviceName:
        assert name[-1] in "._-"
        return
    assert cdi_problems(build_spec([(name, (0,))], HOOK).content) == []


@given(st.text(max_size=40))
def test_hostile_names_never_make_an_invalid_spec(name: str) -> None:
    spec = build_spec([(name, (0,))], HOOK)
    assert cdi_problems(spec.content) == []
    assert len(spec.content["devices"]) + len(spec.skipped) == 1


@pytest.mark.parametrize("name", ["", "a/b", "a=b", "../x", "a b", "a\n", "é", "-a", "a."])
def test_names_a_consumer_would_misread_are_refused(name: str) -> None:
    with pytest.raises(InvalidDeviceName):
        device_name(name)


@pytest.mark.parametrize(("path", "env"), [("vgpuctl", ()), ("/usr/bin/vgpuctl", ("X",)),
                                           ("/usr/bin/vgpuctl", ("=x",))])
def test_a_bad_hook_is_refused(path: str, env: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="hook"):
        Hook(path, env)


def test_tenant_gpus_are_those_of_the_inventory() -> None:
    assert tenant_gpus("all", [1, 0]) == (0, 1)
    assert tenant_gpus((1, 5), [0, 1]) == (1,)
    assert tenant_gpus((5,), [0, 1]) == ()


# --- the hook's input: the OCI state ---


def test_the_container_pid_from_a_real_state() -> None:
    # As crun handed it to a createRuntime hook under podman 4.3.1.
    state = (b'{"ociVersion":"1.0","id":"9964","pid":305,"root":"/r","bundle":"/b",'
             b'"status":"created","annotations":{"io.container.manager":"libpod"}}')
    assert container_pid(state) == 305


@pytest.mark.parametrize("state", [
    b"", b"[]", b"null", b'"305"', b'{"pid": "305"}', b'{"pid": 0}', b'{"pid": -1}',
    b'{"pid": true}', b'{"pid": 1.5}', b'{"pid": 4194305}', b"{}", b"\xff\xfe",
    b'{"pid": 1' + b" " * MAX_STATE_BYTES + b"}",
])
def test_a_state_without_a_container_process_is_refused(state: bytes) -> None:
    with pytest.raises(ValueError, match="OCI state"):
        container_pid(state)


@given(st.binary(max_size=200))
def test_any_input_is_a_pid_or_a_clear_refusal(state: bytes) -> None:
    try:
        pid = container_pid(state)
    except ValueError as exc:
        assert "OCI state" in str(exc)
    else:
        assert 0 < pid <= 1 << 22


def test_the_state_at_poststop_has_an_id_and_no_process() -> None:
    # crun at poststop: the process is gone (pid 0), the id is what is left.
    stopped = b'{"ociVersion":"1.0","id":"9964","pid":0,"bundle":"/b","status":"stopped"}'
    assert container_state(stopped) == ContainerState("9964", None)
    assert container_state(b'{"id":"c1","status":"stopped"}') == ContainerState("c1", None)
    assert container_state(b'{"id":"c1","pid":305}') == ContainerState("c1", 305)
    for bad in (b'{"pid": 305}', b'{"id": "", "pid": 305}', b'{"id": 7}',
                b'{"id": "c1", "pid": -1}', b'{"id": "c1", "pid": "305"}'):
        with pytest.raises(ValueError, match="OCI state"):
            container_state(bad)


# --- the container's cgroup: /proc/PID/cgroup ---

HYBRID = "12:pids:/machine.slice/x\n1:name=systemd:/machine.slice/x\n0::/machine.slice/x\n"


@pytest.mark.parametrize(("text", "path"), [
    ("0::/libpod_parent/libpod-9964\n", "/libpod_parent/libpod-9964"),
    (HYBRID, "/machine.slice/x"),
    ("0::/a b/c:d\n", "/a b/c:d"),  # a path is any bytes but '/' and NUL per component
])
def test_the_cgroup_v2_line_is_the_containers_cgroup(text: str, path: str) -> None:
    assert cgroup_v2_path(text) == path


@pytest.mark.parametrize(("text", "problem"), [
    ("", "no single"),
    ("1:name=systemd:/x\n", "no single"),  # cgroup v1 only
    ("0::/a\n0::/b\n", "no single"),
    ("0::/\n", "root cgroup"),
    ("0::/../../machine.slice/x\n", "namespace"),  # read from inside a cgroup namespace
    ("0::/a//b\n", "namespace"),
    ("0::relative\n", "namespace"),
    ("0::/machine.slice/x (deleted)\n", "being removed"),
])
def test_a_cgroup_that_cannot_be_bound_is_refused(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        cgroup_v2_path(text)


@given(st.text(max_size=100))
def test_any_cgroup_text_is_a_path_below_the_root_or_a_refusal(text: str) -> None:
    try:
        path = cgroup_v2_path(text)
    except ValueError:
        return
    assert f"0::{path}" in text.split("\n")
    assert path.startswith("/") and path != "/" and not path.endswith("/")
    assert not {".", ".."} & set(path.split("/"))


def test_within_is_by_component() -> None:
    assert within("/a/b", "/a/b") and within("/a/b/c", "/a/b") and within("/a", "/")
    assert not within("/a/bc", "/a/b") and not within("/a", "/a/b")


@pytest.mark.parametrize("cid", ["", ".x", "../x", "a/b", "a\0", "x" * 257, "a b"])
def test_a_container_id_that_is_no_plain_name_has_no_record(cid: str) -> None:
    with pytest.raises(ValueError, match="plain name"):
        record_name(cid)
    assert record_name("9964abcdef" * 6) == "9964abcdef" * 6


def test_the_spec_and_the_hooks_input_are_pure() -> None:
    code = ("import sys, vgpud.cdi.spec, vgpud.cdi.hook\n"
            "print(' '.join(sorted(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                            text=True).stdout.split()
    io = ("asyncio", "subprocess", "dbus_fast", "vgpud.admin", "vgpud.store", "vgpud.cdi.files",
          "vgpud.cdi.keeper")
    assert [m for m in loaded if m.split(".")[0] in io or m.startswith(io)] == []
