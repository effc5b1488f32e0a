"""The daemon in a fake world: a fake kernel (tests.support.fakekernel) on a
socketpair and a NOTIFY_SOCKET of our own; and the quota daemon wired up in it."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from tests.support.fakekernel import FAMILY, FakeKernel
from tests.support.policies import DenyClasses
from tests.support.testdaemon import NoServices
from vgpud.app import build_quota
from vgpud.daemon import Daemon
from vgpud.host.inventory import GpuInfo
from vgpud.host.systemd import Notifier
from vgpud.kernel.channel import GenlChannel
from vgpud.policy.dispatch import Dispatcher

GIB = 2**30
CONFIG = """\
[daemon]
state_path = "{state}"
charges_path = "{charges}"

[[tenant]]
name = "a"
memory = "1GiB"
match = [{{ uid = 1000 }}]
"""


def write_config(tmp: Path, extra: str = "") -> Path:
    path = tmp / "vgpud.toml"
    path.write_text(CONFIG.format(state=tmp / "state.json", charges=tmp / "run/charges")
                    + extra)
    return path


def inventory() -> list[GpuInfo]:
    return [GpuInfo(0, "sim", 4 * GIB)]


class World:
    """A fake kernel and a notify socket for one daemon."""

    def __init__(self, tmp_path: Path, **fake) -> None:
        self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.kernel = FakeKernel(theirs, **fake)
        self.notify_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify_path = str(tmp_path / "notify")
        self.notify_sock.bind(self.notify_path)
        self.notify_sock.setblocking(False)

    async def open_channel(self, handler) -> GenlChannel:
        self.kernel.start()
        channel = GenlChannel(self.ours, FAMILY, handler)
        channel.start()
        return channel

    def daemon(self) -> Daemon:
        policy = DenyClasses({0x40})
        return Daemon(Dispatcher(policy), policy.filter(), NoServices(),
                      open_channel=self.open_channel, notifier=Notifier(self.notify_path))

    async def notification(self) -> str:
        loop = asyncio.get_running_loop()
        return (await loop.sock_recv(self.notify_sock, 4096)).decode()

    def close(self) -> None:
        self.notify_sock.close()


class QuotaWorld(World):
    """The quota daemon (build_quota over the config above) on the fake kernel."""

    def __init__(self, tmp_path: Path, dbus: str) -> None:
        super().__init__(tmp_path)
        self.config = write_config(tmp_path)
        self.policy, self.admin = build_quota(self.config, dbus, inventory)

    def daemon(self) -> Daemon:
        return Daemon(Dispatcher(self.policy), self.policy.filter(), self.admin,
                      open_channel=self.open_channel, notifier=Notifier(self.notify_path))
