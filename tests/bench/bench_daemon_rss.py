"""Memory of the whole quota daemon with 64 tenants and 10,000 live allocations.

The real daemon (build_quota: config, Manager, Ledger, charge journal,
QuotaPolicy, the D-Bus service on a private system bus, uvloop) runs as a
process of its own; its netlink socket is one end of a socketpair whose other
end plays the kernel (tests/support/fakekernel.py): registration, filter, then the
workload of tests/bench/bench_quota.py (64 tenants on 8 GPUs, 256 contexts
with a client, device and subdevice each, 10,000 allocations), every upcall
answered before the next is sent. Then every tenant is read over D-Bus, the
steady alloc/free mix runs for a while, and the daemon's VmRSS and VmHWM are
read from /proc.

    .venv/bin/python tests/bench/bench_daemon_rss.py [--ops N]

Target: RSS < 80 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

# Run as a script: the repository root on sys.path, for tests.support.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_quota import GPUS, TENANTS, Kernel, config_text

from tests.support.bus import PrivateBus
from tests.support.fakekernel import FAMILY, NLMSG_HDR, FakeKernel
from vgpud.kernel import uapi

GiB, MiB = 2**30, 2**20
_UPCALL = uapi.Cmd.UPCALL


def serve(fd: int, config: Path) -> None:
    """The daemon process: vgpud's own startup, on an inherited socket."""
    import uvloop

    from vgpud.app import build_quota
    from vgpud.daemon import Daemon
    from vgpud.host.inventory import GpuInfo
    from vgpud.kernel.channel import GenlChannel, UpcallHandler
    from vgpud.policy.dispatch import Dispatcher

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    policy, admin = build_quota(config, "require", lambda: [
        GpuInfo(g, "NVIDIA H100 (sim)", 80 * GiB) for g in range(GPUS)])
    sock = socket.socket(fileno=fd)

    async def open_channel(handler: UpcallHandler) -> GenlChannel:
        channel = GenlChannel(sock, FAMILY, handler)
        channel.start()
        return channel

    daemon = Daemon(Dispatcher(policy), policy.filter(), admin, open_channel=open_channel)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        sys.exit(runner.run(daemon.serve()))


def status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


async def drive(kernel: FakeKernel, datagrams: list[bytes]) -> None:
    """Send in order; wait for each upcall's verdict before the next datagram."""
    for buf in datagrams:
        kernel.send(buf)
        if buf[NLMSG_HDR.size] == _UPCALL:
            await kernel.verdicts.get()


async def tenants_used(address: str) -> int:
    """Bytes used by every tenant, read over D-Bus."""
    from dbus_fast import BusType
    from dbus_fast.aio import MessageBus

    from vgpud.admin.dbus import BUS_NAME, tenant_path

    bus = await MessageBus(bus_address=address, bus_type=BusType.SYSTEM).connect()
    total = 0
    try:
        for t in range(TENANTS):
            path = tenant_path(f"tenant-{t}")
            intro = await bus.introspect(BUS_NAME, path)
            props = bus.get_proxy_object(BUS_NAME, path, intro).get_interface(
                "org.freedesktop.DBus.Properties")
            used = await props.call_get("org.vgpud1.Tenant", "MemoryUsed")
            total += sum(used.value.values())
    finally:
        bus.disconnect()
    return total


async def run(args: argparse.Namespace, tmp: Path, bus: PrivateBus) -> None:
    config = tmp / "vgpud.toml"
    config.write_text(config_text(str(tmp / "state.json"), str(tmp / "run" / "charges")))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    for s in (ours, theirs):  # room for bursts of POST events
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MiB)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MiB)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp / "notify"))
    notify.setblocking(False)
    env = dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=bus.address, NOTIFY_SOCKET=str(tmp / "notify"))
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(theirs.fileno()),
                             str(config)], pass_fds=[theirs.fileno()], env=env)
    theirs.close()
    kernel = FakeKernel(ours)
    kernel.start()
    loop = asyncio.get_running_loop()
    try:
        while b"READY=1" not in await asyncio.wait_for(loop.sock_recv(notify, 4096), 60):
            pass
        idle = status(proc.pid)
        workload = Kernel(seed=1)
        workload.setup()
        await drive(kernel, workload.take())
        used = await tenants_used(bus.address)
        loaded = status(proc.pid)
        for i in range(args.ops):
            workload.op(i)
        await drive(kernel, workload.take())
        used_after = await tenants_used(bus.address)
        churned = status(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await loop.run_in_executor(None, proc.wait)
        kernel.stop()
        notify.close()
    print(f"daemon pid {proc.pid}, exit {code}; tenants {TENANTS} on {GPUS} GPUs, "
          f"contexts {len(workload.contexts)}")
    print(f"ready, idle:                       VmRSS {idle['VmRSS'] / 1024:6.1f} MiB")
    print(f"10,000 live allocations ({used / GiB:.1f} GiB):  VmRSS "
          f"{loaded['VmRSS'] / 1024:6.1f} MiB")
    print(f"after {args.ops} more alloc/free ops ({used_after / GiB:.1f} GiB): VmRSS "
          f"{churned['VmRSS'] / 1024:6.1f} MiB, peak (VmHWM) {churned['VmHWM'] / 1024:.1f} MiB "
          "(target < 80)")


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[2]), Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20_000, help="alloc/free ops after setup")
    args = parser.parse_args()
    bus = PrivateBus()
    try:
        with tempfile.TemporaryDirectory(prefix="vgpud-rss-") as tmp:
            asyncio.run(run(args, Path(tmp), bus))
    finally:
        bus.close()


if __name__ == "__main__":
    main()
