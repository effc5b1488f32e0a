"""vgpuctl against the admin service on a private bus: output, --json, exit codes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from tests.support.bus import (
    GIB,
    REPO,
    PrivateBus,
    ServiceThread,
    as_nobody,
)
from vgpud import cli

NOT_RUNNING = "vgpud is not running (org.vgpud1 not on the system bus)"


def vgpuctl(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args), env={"COLUMNS": "160"})


def ok_json(*args: str) -> Any:
    result = vgpuctl(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_read_commands(service: ServiceThread) -> None:
    status = ok_json("status")
    assert (status["version"], status["default_tenant"]) == ("0.1.0", "shared")
    assert status["gpus"] == ok_json("gpus") == [
        {"index": 0, "name": "NVIDIA H100 (sim)", "total": 80 * GIB, "used": 0},
        {"index": 1, "name": "NVIDIA H100 (sim)", "total": 80 * GIB, "used": 0},
    ]
    tenants = ok_json("tenant", "list")
    assert status["tenants"] == tenants
    assert [t["name"] for t in tenants] == ["alice", "bob.x-1", "shared"]
    bob = ok_json("tenant", "show", "bob.x-1")
    assert bob == tenants[1]
    assert bob["memory_limit_bytes"] == {"0": 0, "1": 40 * GIB}
    assert (bob["memory_limit"], bob["gpus"], bob["weight"]) == ("50%", [1], 300)
    for args in (["status"], ["gpus"], ["tenant", "list"], ["tenant", "show", "alice"]):
        result = vgpuctl(*args)
        assert result.exit_code == 0, result.output
        assert "alice" in result.output or "H100" in result.output
    assert "8.0 GiB" in vgpuctl("tenant", "list").output


def test_changes(service: ServiceThread) -> None:
    create = vgpuctl("tenant", "create", "carol", "--memory", "512MiB", "--match-cgroup",
                     "/pods/carol*", "--match-uid", "1001", "--gpus", "0", "--weight", "20",
                     "--limit", "channel_groups=8")
    assert create.exit_code == 0, create.output
    carol = ok_json("tenant", "show", "carol")
    assert carol["match"] == [{"cgroup": "/pods/carol*"}, {"uid": 1001}]
    assert (carol["memory_limit_bytes"], carol["weight"]) == ({"0": 512 * 2**20, "1": 0}, 20)
    assert (carol["limits"]["channel_groups"], carol["limits"]["channels"]) == (8, 1024)
    result = vgpuctl("tenant", "set", "carol", "--memory", "50%", "--cap", "30",
                     "--priority", "priority", "--limit", "channels=16", "--limit", "buffers=0")
    assert result.exit_code == 0, result.output
    carol = ok_json("tenant", "show", "carol")
    assert (carol["memory_limit"], carol["cap"], carol["priority"]) == ("50%", 30, "priority")
    assert carol["limits"] == {"channel_groups": 8, "channels": 16, "context_shares": 1024,
                               "va_spaces": 64, "buffers": 0}
    assert vgpuctl("bind", "4242", "carol").exit_code == 0
    assert ok_json("tenant", "show", "carol")["pids"] == [4242]
    assert vgpuctl("unbind", "4242").exit_code == 0
    assert vgpuctl("tenant", "delete", "carol").exit_code == 0
    assert vgpuctl("reload").exit_code == 0
    assert [t["name"] for t in ok_json("tenant", "list")] == ["alice", "bob.x-1", "shared"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tenant", "show", "carol"], "no tenant named 'carol' (NoSuchTenant)"),
        (["tenant", "delete", "carol"], "(NoSuchTenant)"),
        (["tenant", "set", "alice", "--memory", "8 parsecs"], "unknown unit"),
        (["tenant", "set", "alice", "--memory", "-1GiB"], "negative"),
        (["tenant", "set", "alice", "--weight", "0", "--memory", "1GiB"], "weight"),
        (["tenant", "set", "alice", "--limit", "tsgs=1"], "tsgs"),
        (["tenant", "set", "alice", "--weight", "5", "--limit", "channels=1000001"],
         "channels"),
        (["tenant", "create", "Bad", "--memory", "1GiB"], "(InvalidArgument)"),
        (["bind", "1", "carol"], "(NoSuchTenant)"),
    ],
)
def test_daemon_errors_exit_1(service: ServiceThread, args: list[str], message: str) -> None:
    before = ok_json("tenant", "show", "alice")
    result = vgpuctl(*args)
    assert result.exit_code == cli.EX_ERROR
    assert message in result.output
    assert ok_json("tenant", "show", "alice") == before  # all or nothing


@pytest.mark.parametrize(
    "args",
    [
        ["tenant", "set", "alice"],
        ["tenant", "set", "alice", "--weight", "-1"],
        ["tenant", "set", "alice", "--limit", "channels"],
        ["tenant", "set", "alice", "--limit", "channels=-1"],
        ["tenant", "create", "carol", "--gpus", "zero"],
        ["bind", "pid", "alice"],
        ["tenant", "frobnicate"],
    ],
)
def test_usage_errors_exit_2(service: ServiceThread, args: list[str]) -> None:
    assert vgpuctl(*args).exit_code == 2


def test_permission_denied_exits_77(service: ServiceThread, system_bus: PrivateBus) -> None:
    result = as_nobody(sys.executable, "-c", "from vgpud.cli import main; main()",
                       "tenant", "set", "alice", "--weight", "5",
                       env={"PYTHONPATH": str(REPO)})
    assert result.returncode == cli.EX_NOPERM, result.stderr
    assert "(PermissionDenied)" in result.stderr
    assert ok_json("tenant", "show", "alice")["weight"] == 100


def test_daemon_not_running_exits_69(system_bus: PrivateBus) -> None:
    for args in (["status"], ["tenant", "list", "--json"], ["tenant", "delete", "alice"]):
        result = vgpuctl(*args)
        assert result.exit_code == cli.EX_UNAVAILABLE
        assert result.output == f"vgpuctl: {NOT_RUNNING}\n"


def test_no_system_bus_exits_69(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/nothing")
    result = vgpuctl("gpus")
    assert result.exit_code == cli.EX_UNAVAILABLE
    assert result.output.startswith(f"vgpuctl: {NOT_RUNNING}: cannot connect to the system bus")
