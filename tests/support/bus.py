"""A private system-like bus and vgpud's admin service on it.

The bus is a real dbus-daemon with the system bus's default-deny policy plus
our own dbus/org.vgpud1.conf, listening on a socket in a world-accessible
directory with <allow user="*"/>, so that clients running as another uid
(setpriv) can connect. The service (Manager + AdminService on a dbus-fast
connection) runs in a thread with its own event loop, so that tests can use
blocking clients (busctl, gdbus, vgpuctl through CliRunner) against it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest
from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus

from vgpud.admin.client import AdminClient
from vgpud.admin.dbus import AdminService
from vgpud.admin.manager import Manager
from vgpud.core.ledger import Ledger
from vgpud.core.observers import Topic
from vgpud.policy.events import QuotaEvent
from vgpud.store.config import load_config
from vgpud.store.state import load_state

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "dbus" / "org.vgpud1.conf"
GIB = 2**30
GPUS = [(0, "NVIDIA H100 (sim)", 80 * GIB), (1, "NVIDIA H100 (sim)", 80 * GIB)]

CONFIG = """\
[daemon]
default_tenant = "shared"
admin_group = "{admin_group}"
state_path = "{state_path}"

[[tenant]]
name = "alice"
memory = "8GiB"
match = [{{ uid = 1000 }}]

[[tenant]]
name = "bob.x-1"
memory = "50%"
gpus = [1]
weight = 300

[[tenant]]
name = "shared"
"""

# The system bus's default policy (as in /usr/share/dbus-1/system.conf),
# open to every user, and our policy file included as installed.
BUS_CONFIG = """\
<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus"
           send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus"
           send_interface="org.freedesktop.DBus.Properties"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Peer"/>
  </policy>
  <include>{policy}</include>
</busconfig>
"""


class PrivateBus:
    """dbus-daemon on a socket in a fresh world-accessible directory."""

    def __init__(self) -> None:
        dbus_daemon = shutil.which("dbus-daemon")
        if dbus_daemon is None:
            pytest.skip("dbus-daemon is not installed (apt-get install dbus-daemon)")
        self.directory = Path(tempfile.mkdtemp(prefix="vgpud-bus-"))
        self.directory.chmod(0o755)
        config = self.directory / "bus.conf"
        config.write_text(BUS_CONFIG.format(socket=self.directory / "bus", policy=POLICY))
        self.process = subprocess.Popen(
            [dbus_daemon, f"--config-file={config}", "--nofork", "--print-address=1"],
            stdout=subprocess.PIPE, text=True,
        )
        assert self.process.stdout is not None
        self.address = self.process.stdout.readline().strip()
        if not self.address:
            self.close()
            raise RuntimeError("dbus-daemon did not start")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class ServiceThread:
    """Manager + AdminService on the system bus, served by a thread's event loop."""

    def __init__(self, manager: Manager, scheduler: Any = None, probes: Any = None) -> None:
        self.manager = manager
        self.scheduler = scheduler
        self.probes = probes
        self.quota: Topic[QuotaEvent] = Topic()  # what the quota policy would publish
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._started: Future[None] = Future()
        self._thread = threading.Thread(target=self._main, name="vgpud-admin", daemon=True)
        self._thread.start()
        self._started.result(timeout=10)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the service's loop (the manager is not thread-safe)."""

        async def run() -> T:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    def close(self) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def _main(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:
            if self._started.done():
                raise
            self._started.set_exception(e)  # raised by __init__
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
        try:
            service = AdminService(self.manager, bus, self.scheduler, self.probes)
            await service.start()
            self.manager.observers.subscribe(service)  # as vgpud.app does
            self.quota.subscribe(service)
            if self.scheduler is not None:
                self.scheduler.observers.subscribe(service)
            self._started.set_result(None)
            await self._stop.wait()
            self.manager.observers.unsubscribe(service)
            self.quota.unsubscribe(service)
            service.close()
        finally:
            bus.disconnect()


def write_config(directory: Path, admin_group: str = "vgpu-admin") -> Path:
    path = directory / "vgpud.toml"
    path.write_text(
        CONFIG.format(admin_group=admin_group, state_path=directory / "state.json")
    )
    return path


BOOT_ID = "boot-1"


def fake_start(pid: int) -> int | None:
    """A process table where every pid below 100000 runs, started at 10000 + pid."""
    return 10_000 + pid if pid < 100_000 else None


def make_manager(config_path: Path) -> Manager:
    config = load_config(config_path)
    return Manager(
        config_path, config, load_state(config.daemon.state_path), Ledger(), GPUS,
        process_start=fake_start, boot_id=BOOT_ID,
    )


def as_nobody(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run argv as uid/gid 65534 with no supplementary groups."""
    return subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv],
        capture_output=True, text=True, timeout=30, env={**os.environ, **(env or {})},
    )


async def properties_changed(client: AdminClient) -> asyncio.Queue[Message]:
    """The PropertiesChanged signals vgpud emits from now on."""
    received: asyncio.Queue[Message] = asyncio.Queue()

    def on_message(msg: Message) -> None:
        if msg.message_type == MessageType.SIGNAL and msg.member == "PropertiesChanged":
            received.put_nowait(msg)

    client.bus.add_message_handler(on_message)
    await add_match(client, "type='signal',sender='org.vgpud1',"
                            "interface='org.freedesktop.DBus.Properties'")
    return received


async def add_match(client: AdminClient, rule: str) -> None:
    await client.bus.call(Message(
        destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
        interface="org.freedesktop.DBus", member="AddMatch", signature="s", body=[rule],
    ))
