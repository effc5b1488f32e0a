"""The daemon's lifecycle in a fake world: a fake kernel on a socketpair, a
NOTIFY_SOCKET of our own, real signals; and the real entry point on this host,
which has no vgpu module."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support import testdaemon
from tests.support.daemon_world import World, write_config
from tests.support.fakekernel import upcall_msg
from tests.support.policies import DenyClasses
from vgpud import daemon
from vgpud.host.systemd import Notifier, watchdog_interval
from vgpud.kernel import uapi
from vgpud.kernel.uapi import Cmd, VerdictAction
from vgpud.nvidia import layouts as L

ROOT = Path(__file__).resolve().parents[2]

ALLOC21 = L.NVOS21.struct.pack(1, 2, 3, 0x40, 0, 0, 0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_ready_serve_and_graceful_stop(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    world = World(tmp_path)

    async def main():
        serving = asyncio.create_task(world.daemon().serve())
        assert await world.notification() == "READY=1\nSTATUS=serving upcalls"
        assert f"registered with vgpu module (protocol v{uapi.PROTO_VERSION})" in caplog.messages
        assert world.kernel.filters == [DenyClasses({0x40}).filter()]
        world.kernel.send(upcall_msg(ALLOC21, id=5, nr=0x2B))
        assert await world.kernel.verdicts.get() == (
            5, VerdictAction.FAIL_STATUS, 0, 0x51, 28, 0, 0)
        os.kill(os.getpid(), signal.SIGTERM)
        assert await world.notification() == "STOPPING=1"
        assert await serving == 0
        assert world.kernel.requests == [Cmd.REGISTER, Cmd.SET_FILTER, Cmd.GET_STATS,
                                         Cmd.UNREGISTER]
        assert len(world.kernel.filters) == 1  # the filter stays for the module's fail policy

    run(main())
    world.close()


def test_second_signal_forces_exit(tmp_path: Path) -> None:
    world = World(tmp_path)

    async def main():
        serving = asyncio.create_task(world.daemon().serve())
        assert (await world.notification()).startswith("READY=1")
        world.kernel.silent.add(Cmd.GET_STATS)  # the drain hangs
        os.kill(os.getpid(), signal.SIGINT)
        assert await world.notification() == "STOPPING=1"
        await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
        assert await serving == 1
        assert Cmd.UNREGISTER not in world.kernel.requests

    run(main())
    world.close()


def test_registration_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    world = World(tmp_path, errors={Cmd.REGISTER: errno.EBUSY})
    assert run(world.daemon().serve()) == daemon.EX_UNAVAILABLE
    assert "another vgpud is registered with the vgpu module" in caplog.text
    world.close()


def test_lost_channel_ends_the_run(tmp_path: Path) -> None:
    world = World(tmp_path)

    async def main():
        serving = asyncio.create_task(world.daemon().serve())
        assert (await world.notification()).startswith("READY=1")
        world.kernel.send(b"")  # the stand-in peer hangs up
        assert await serving == 0

    run(main())
    world.close()


def test_watchdog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "20000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    world = World(tmp_path)

    async def main():
        serving = asyncio.create_task(world.daemon().serve())
        assert (await world.notification()).startswith("READY=1")
        assert await world.notification() == "WATCHDOG=1"
        assert await world.notification() == "WATCHDOG=1"
        os.kill(os.getpid(), signal.SIGTERM)
        while await world.notification() != "STOPPING=1":
            pass
        assert await serving == 0

    run(main())
    world.close()


def test_watchdog_interval() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "2000000"}) == 1.0
    assert watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "x"}) is None
    assert watchdog_interval({}) is None


def test_notifier_abstract_address_and_absence() -> None:
    name = f"vgpud-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        Notifier("@" + name).send("READY=1")
        assert sock.recv(64) == b"READY=1"
    Notifier(None).send("READY=1")  # no NOTIFY_SOCKET: nothing happens
    Notifier("/nonexistent/socket").send("READY=1")  # logged, not raised


@pytest.mark.parametrize("entry", ["vgpud.daemon", "tests.support.testdaemon"])
def test_entry_point_without_the_module(tmp_path: Path, entry: str) -> None:
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "none"))
    args = (["--config", str(write_config(tmp_path)), "--no-dbus", "--no-probes", "--no-fs"]
            if entry == "vgpud.daemon" else ["--policy", "deny-class:0x40"])
    proc = subprocess.run([sys.executable, "-m", entry, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == daemon.EX_UNAVAILABLE, proc.stderr
    assert "generic netlink family 'vgpu' not found: is vgpu.ko loaded?" in proc.stderr


@pytest.mark.parametrize("args", [["--policy", "nope"], ["--filter", "alloc:"]])
def test_bad_test_daemon_options(args: list[str]) -> None:
    result = CliRunner().invoke(testdaemon.main, args)
    assert result.exit_code == 2 and "Error:" in result.output


@pytest.mark.parametrize("option", ["--policy", "--filter"])
def test_vgpud_runs_no_test_policy(option: str) -> None:
    result = CliRunner().invoke(daemon.main, [option, "allow"])
    assert result.exit_code == 2 and "No such option" in result.output


def test_signal_during_startup(tmp_path: Path) -> None:
    world = World(tmp_path, silent={Cmd.REGISTER})

    async def main():
        serving = asyncio.create_task(world.daemon().serve())
        while Cmd.REGISTER not in world.kernel.requests:
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)
        assert await serving == 0

    run(main())
    world.close()
