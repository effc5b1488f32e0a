"""vgpuctl cdi: generate (from the daemon's tenants), bind and unbind (the
hooks); vgpuctl bind-cgroup and unbind-cgroup."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tests.support.bus import (
    BOOT_ID,
    GPUS,
    REPO,
    PrivateBus,
    ServiceThread,
    fake_start,
    write_config,
)
from vgpud import cli
from vgpud.admin.manager import Manager
from vgpud.cdi.spec import SPEC_FILE
from vgpud.core.ledger import Ledger
from vgpud.core.tenants import Opener, resolve
from vgpud.store.config import load_config
from vgpud.store.state import load_state

STATE = '{{"ociVersion":"1.0","id":"c1","pid":{pid},"bundle":"/b","status":"created"}}'


def vgpuctl(*args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(cli.main, list(args), input=stdin)


def pids(service: ServiceThread, tenant: str) -> tuple[int, ...]:
    return service.call(service.manager.pids, tenant)


def test_generate_prints_one_device_per_tenant_on_the_daemons_bus(
        service: ServiceThread, system_bus: PrivateBus) -> None:
    result = vgpuctl("cdi", "generate")
    assert result.exit_code == 0, result.output
    spec = json.loads(result.output)
    assert (spec["cdiVersion"], spec["kind"]) == ("0.5.0", "vgpud.io/tenant")
    assert [d["name"] for d in spec["devices"]] == ["alice", "bob.x-1", "shared"]
    bob = spec["devices"][1]["containerEdits"]
    assert [n["hostPath"] for n in bob["deviceNodes"]] == [
        "/dev/vgpu/nvidiactl", "/dev/vgpu/nvidia-uvm", "/dev/vgpu/nvidia1"]
    hook, unbind = bob["hooks"]
    assert hook["args"] == ["vgpuctl", "cdi", "bind", "bob.x-1"]
    assert unbind["args"] == ["vgpuctl", "cdi", "unbind"]
    assert hook["path"] == str(Path(sys.executable).parent / "vgpuctl")
    assert hook["env"] == [f"DBUS_SYSTEM_BUS_ADDRESS={system_bus.address}"]


def test_generate_writes_into_a_directory_and_warns_of_skipped_tenants(
        service: ServiceThread, tmp_path: Path) -> None:
    assert vgpuctl("tenant", "create", "odd-").exit_code == 0
    result = vgpuctl("cdi", "generate", "--output", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert "tenant 'odd-' has no CDI device" in result.stderr
    spec = json.loads((tmp_path / SPEC_FILE).read_text())
    assert [d["name"] for d in spec["devices"]] == ["alice", "bob.x-1", "shared"]


CGROUP = "/machine.slice/libpod-c1.scope"


class Host:
    """A fake /proc (the container's process 4242 in CGROUP, this hook in
    the runtime's cgroup) and cgroup2 tree, world-readable so that a hook
    run as another uid reads them too, and the hook's record directory."""

    def __init__(self, top: Path) -> None:
        self.top, self.proc, self.cgroup = top, top / "proc", top / "cgroup"
        self.records = top / "records"
        self.set_cgroup(4242, CGROUP)
        self.set_cgroup("self", "/user.slice/podman.scope")
        (self.cgroup / CGROUP.lstrip("/") / "sub").mkdir(parents=True)
        for d, _, files in os.walk(top):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644)

    def set_cgroup(self, pid: int | str, path: str) -> None:
        (self.proc / str(pid)).mkdir(parents=True, exist_ok=True)
        (self.proc / str(pid) / "cgroup").write_text(f"1:name=systemd:/x\n0::{path}\n")


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    top = Path(tempfile.mkdtemp(prefix="vgpud-cdi-"))
    h = Host(top)
    monkeypatch.setattr(cli, "PROC", h.proc)
    monkeypatch.setattr(cli, "CDI_RECORDS", h.records)
    yield h
    shutil.rmtree(top)


@pytest.fixture
def service(system_bus: PrivateBus, tmp_path: Path, host: Host) -> Iterator[ServiceThread]:
    """The admin service of tests.support.bus, its cgroup2 tree the host's."""
    config_path = write_config(tmp_path)
    config = load_config(config_path)
    thread = ServiceThread(Manager(config_path, config, load_state(config.daemon.state_path),
                                   Ledger(), GPUS, process_start=fake_start, boot_id=BOOT_ID,
                                   cgroup_root=host.cgroup))
    yield thread
    thread.close()


def cgroups(service: ServiceThread, tenant: str) -> tuple[str, ...]:
    return service.call(service.manager.cgroups, tenant)


def test_bind_binds_the_containers_cgroup_and_unbind_removes_it(
        service: ServiceThread, host: Host) -> None:
    result = vgpuctl("cdi", "bind", "bob.x-1", stdin=STATE.format(pid=4242))
    assert result.exit_code == 0, result.output
    assert cgroups(service, "bob.x-1") == (CGROUP,)
    assert pids(service, "bob.x-1") == ()  # the cgroup, not the process
    assert (host.records / "c1").read_text() == CGROUP
    assert (host.records.stat().st_mode & 0o777, (host.records / "c1").stat().st_mode & 0o777) \
        == (0o700, 0o600)
    # poststop: the process is gone, the state has the id.
    stopped = '{"ociVersion":"1.0","id":"c1","pid":0,"bundle":"/b","status":"stopped"}'
    result = vgpuctl("cdi", "unbind", stdin=stopped)
    assert result.exit_code == 0, result.output
    assert cgroups(service, "bob.x-1") == ()
    assert not (host.records / "c1").exists()
    # Nothing recorded (another container, or unbound already): nothing to do.
    assert vgpuctl("cdi", "unbind", stdin=stopped).exit_code == 0


def test_unbind_of_a_binding_the_daemon_dropped_is_done(service: ServiceThread,
                                                        host: Host) -> None:
    assert vgpuctl("cdi", "bind", "alice", stdin=STATE.format(pid=4242)).exit_code == 0
    assert vgpuctl("unbind-cgroup", CGROUP).exit_code == 0
    result = vgpuctl("cdi", "unbind", stdin='{"id":"c1","pid":0}')
    assert result.exit_code == 0, result.output
    assert not (host.records / "c1").exists()


def test_a_forked_process_of_the_container_is_the_tenants(service: ServiceThread,
                                                          host: Host) -> None:
    """What the quota policy resolves an opener below the bound cgroup to."""
    assert vgpuctl("cdi", "bind", "bob.x-1", stdin=STATE.format(pid=4242)).exit_code == 0
    sub = host.cgroup / CGROUP.lstrip("/") / "sub"
    forked = Opener(pid=7, tgid=7, uid=0, gid=0, cgroup_id=sub.stat().st_ino,
                    cgroup_path=f"{CGROUP}/sub", start=1)
    m = service.manager
    assert service.call(lambda: resolve(forked, m.tenants, m.bindings, m.default_tenant,
                                        m.cgroup_bindings, m.cgroup_id_of)) == "bob.x-1"


@pytest.mark.parametrize(("args", "stdin", "message"), [
    (["bob.x-1"], "not json", "not JSON"),
    (["bob.x-1"], '{"id": "c1", "pid": 0}', "no container process"),
    (["bob.x-1"], '{"pid": 4242}', "no container id"),
    (["bob.x-1"], '{"id": "../c1", "pid": 4242}', "plain name"),
    (["bob.x-1"], STATE.format(pid=4343), "No such file"),  # no such process
    (["nosuch"], STATE.format(pid=4242), "(NoSuchTenant)"),
])
def test_bind_refuses_clearly_and_binds_nothing(service: ServiceThread, host: Host,
                                                args: list[str], stdin: str,
                                                message: str) -> None:
    result = vgpuctl("cdi", "bind", *args, stdin=stdin)
    assert result.exit_code == cli.EX_ERROR
    assert message in result.output
    assert cgroups(service, "bob.x-1") == ()
    assert not host.records.exists()


@pytest.mark.parametrize(("container", "hook", "message"), [
    ("/", "/user.slice/podman.scope", "root cgroup"),
    ("/machine.slice/gone", "/user.slice/podman.scope", "(InvalidArgument)"),
    ("/machine.slice/x (deleted)", "/user.slice/podman.scope", "being removed"),
    # A runtime that made the container no cgroup of its own: binding the
    # runtime's (or an ancestor of it) would bind the runtime and its siblings.
    ("/user.slice", "/user.slice/podman.scope", "holds this hook"),
    ("/user.slice/podman.scope", "/user.slice/podman.scope", "holds this hook"),
])
def test_bind_refuses_a_cgroup_that_is_not_the_containers_own(
        service: ServiceThread, host: Host, container: str, hook: str, message: str) -> None:
    host.set_cgroup(4242, container)
    host.set_cgroup("self", hook)
    result = vgpuctl("cdi", "bind", "alice", stdin=STATE.format(pid=4242))
    assert result.exit_code == cli.EX_ERROR
    assert message in result.output
    assert cgroups(service, "alice") == ()


def test_bind_cgroup_and_unbind_cgroup(service: ServiceThread) -> None:
    assert vgpuctl("bind-cgroup", CGROUP, "alice").exit_code == 0
    assert cgroups(service, "alice") == (CGROUP,)
    shown = vgpuctl("tenant", "show", "alice", "--json")
    assert json.loads(shown.output)["cgroups"] == [CGROUP]
    for args, message in ((["bind-cgroup", "/a/../b", "alice"], "(InvalidArgument)"),
                          (["bind-cgroup", CGROUP, "nosuch"], "(NoSuchTenant)"),
                          (["unbind-cgroup", "/machine.slice"], "not bound")):
        result = vgpuctl(*args)
        assert result.exit_code == cli.EX_ERROR and message in result.output, result.output
    assert vgpuctl("unbind-cgroup", CGROUP).exit_code == 0
    assert cgroups(service, "alice") == ()


def test_bind_needs_the_rights_of_bind(service: ServiceThread, host: Host) -> None:
    # A rootless runtime runs the hook as its user: refused, the container does not start.
    code = (f"from pathlib import Path; import vgpud.cli as c; c.PROC = Path({str(host.proc)!r})"
            f"; c.CDI_RECORDS = Path({str(host.records)!r}); c.main()")
    for args in (["cdi", "bind", "alice"], ["bind-cgroup", CGROUP, "alice"]):
        result = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
             "-c", code, *args],
            input=STATE.format(pid=4242), capture_output=True, text=True, timeout=30,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        assert result.returncode == cli.EX_NOPERM, result.stderr
    assert cgroups(service, "alice") == ()
    assert not host.records.exists()
