"""vgpuctl cdi: generate (from the daemon's tenants) and bind (the hook)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tests.support.bus import REPO, PrivateBus, ServiceThread
from vgpud import cli
from vgpud.cdi.spec import SPEC_FILE

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
    (hook,) = bob["hooks"]
    assert hook["args"] == ["vgpuctl", "cdi", "bind", "bob.x-1"]
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


def test_bind_binds_the_container_process_of_the_state(service: ServiceThread) -> None:
    result = vgpuctl("cdi", "bind", "bob.x-1", stdin=STATE.format(pid=4242))
    assert result.exit_code == 0, result.output
    assert 4242 in pids(service, "bob.x-1")


@pytest.mark.parametrize(("args", "stdin", "message"), [
    (["bob.x-1"], "not json", "not JSON"),
    (["bob.x-1"], '{"pid": 0}', "no container process"),
    (["nosuch"], STATE.format(pid=4242), "(NoSuchTenant)"),
])
def test_bind_refuses_clearly_and_binds_nothing(service: ServiceThread, args: list[str],
                                                stdin: str, message: str) -> None:
    result = vgpuctl("cdi", "bind", *args, stdin=stdin)
    assert result.exit_code == cli.EX_ERROR
    assert message in result.output
    assert 4242 not in pids(service, "bob.x-1")


def test_bind_needs_the_rights_of_bind(service: ServiceThread) -> None:
    # A rootless runtime runs the hook as its user: refused, the container does not start.
    result = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         "from vgpud.cli import main; main()", "cdi", "bind", "alice"],
        input=STATE.format(pid=4242), capture_output=True, text=True, timeout=30,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == cli.EX_NOPERM, result.stderr
    assert 4242 not in pids(service, "alice")
