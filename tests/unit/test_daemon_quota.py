"""The quota daemon wired up: config, inventory, Manager, QuotaPolicy, D-Bus admin
API on a private system bus, the fake kernel, SIGHUP reloads."""

from __future__ import annotations

import asyncio
import errno
import importlib
import logging
import os
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner
from dbus_fast import BusType
from dbus_fast.aio import MessageBus

from tests.support.daemon_world import QuotaWorld, inventory, write_config
from tests.support.fakekernel import FAMILY, make_context, post_event_msg, upcall_msg
from vgpud import daemon
from vgpud.admin.dbus import BUS_NAME
from vgpud.app import build_quota
from vgpud.kernel import codec
from vgpud.kernel.uapi import FILTER_OPEN, FILTER_UVM_MMAP, Cmd, UpcallKind, VerdictAction
from vgpud.nvidia import layouts as L
from vgpud.policy.dispatch import Dispatcher

GIB, MIB = 2**30, 2**20


def mem_alloc(size: int, status: int = 0, h_new: int = 0) -> tuple[bytes, bytes]:
    values = [0] * 23
    values[13] = size
    alloc = L.NV_MEMORY_ALLOCATION_PARAMS.struct.pack(*values)
    return L.NVOS21.struct.pack(1, 2, h_new, 0x40, 0x1000, len(alloc), status), alloc


def device_alloc(h_device: int = 2, device_id: int = 0) -> tuple[bytes, bytes]:
    """NVOS21 for NV01_DEVICE_0 under client 1 (memory is made under a device)."""
    alloc = L.NV0080_ALLOC_PARAMETERS.struct.pack(device_id, 0, 0, 0, 0, 0, 0, 0, 0)
    return L.NVOS21.struct.pack(1, 1, h_device, 0x80, 0x1000, len(alloc), 0), alloc


async def make_device(k, ctx: int, upcall_id: int) -> None:
    """Allocates device 2 of client 1 on GPU 0 through context `ctx`."""
    params, alloc = device_alloc()
    k.send(upcall_msg(params, alloc, id=upcall_id, ctx_id=ctx, nr=0x2B))
    assert (await k.verdicts.get())[:2] == (upcall_id, VerdictAction.ALLOW)
    k.send(post_event_msg(ctx, upcall_id, 0x2B, 0, params, alloc))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def memory_used(bus: MessageBus) -> dict[int, int]:
    path = "/org/vgpud1/tenant/a"
    intro = await bus.introspect(BUS_NAME, path)
    proxy = bus.get_proxy_object(BUS_NAME, path, intro)
    props = proxy.get_interface("org.freedesktop.DBus.Properties")
    return (await props.call_get("org.vgpud1.Tenant", "MemoryUsed")).value


def test_quota_daemon_on_the_bus(tmp_path: Path, system_bus) -> None:
    world = QuotaWorld(tmp_path, "require")

    async def main():
        serving = asyncio.create_task(world.daemon().serve())
        assert (await world.notification()).startswith("READY=1")
        assert world.kernel.filters[0].flags == FILTER_OPEN | FILTER_UVM_MMAP
        k = world.kernel
        k.send(upcall_msg(kind=UpcallKind.OPEN, id=1, ctx_id=7, uid=1000, cgroup="/"))
        assert (await k.verdicts.get())[:2] == (1, VerdictAction.ALLOW)
        await make_device(k, 7, 100)
        params, alloc = mem_alloc(GIB)
        k.send(upcall_msg(params, alloc, id=2, ctx_id=7, nr=0x2B))
        assert (await k.verdicts.get())[:2] == (2, VerdictAction.ALLOW)
        k.send(post_event_msg(7, 2, 0x2B, 0, mem_alloc(GIB, h_new=0x99)[0], alloc))
        params, alloc = mem_alloc(4096)
        k.send(upcall_msg(params, alloc, id=3, ctx_id=7, nr=0x2B))
        assert await k.verdicts.get() == (3, VerdictAction.FAIL_STATUS, 0, 0x51, 28, 0, 0)
        bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
        try:
            assert await memory_used(bus) == {0: GIB}
        finally:
            bus.disconnect()
        # SIGHUP: a new tenant appears; a broken file keeps the last good config
        write_config(tmp_path, '\n[[tenant]]\nname = "z"\n')
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(100):
            if len(world.admin.manager.tenants) == 2:
                break
            await asyncio.sleep(0.01)
        assert [t.name for t in world.admin.manager.tenants] == ["a", "z"]
        world.config.write_text("garbage = [")
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.sleep(0.05)
        assert len(world.admin.manager.tenants) == 2
        os.kill(os.getpid(), signal.SIGTERM)
        assert await serving == 0
        assert world.admin.service is None

    run(main())
    world.close()


def test_unreachable_bus_is_a_warning_unless_required(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/nobus")
    world = QuotaWorld(tmp_path, "try")

    async def main():
        serving = asyncio.create_task(world.daemon().serve())
        assert (await world.notification()).startswith("READY=1")
        os.kill(os.getpid(), signal.SIGTERM)
        assert await serving == 0

    run(main())
    assert any("running without it" in m for m in caplog.messages)
    world.close()
    (tmp_path / "2").mkdir()
    required = QuotaWorld(tmp_path / "2", "require")
    assert run(required.daemon().serve()) == daemon.EX_UNAVAILABLE
    required.close()


def test_bad_config_exits_78(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[tenant]]\nname = "a"\nmemory = "lots"\n')
    result = CliRunner().invoke(daemon.main, ["--config", str(bad), "--no-dbus"])
    assert result.exit_code == daemon.EX_CONFIG
    missing = CliRunner().invoke(daemon.main, ["--config", str(tmp_path / "none.toml")])
    assert missing.exit_code == daemon.EX_CONFIG


def test_dbus_options_exclude_each_other() -> None:
    both = CliRunner().invoke(daemon.main, ["--no-dbus", "--require-dbus"])
    assert both.exit_code == 2


def test_close_of_unknown_context_and_errno(tmp_path: Path) -> None:
    # sanity: a refused open answers EACCES through the whole daemon path
    policy, _admin = build_quota(write_config(tmp_path), "off", inventory)
    msg = upcall_msg(kind=UpcallKind.OPEN, id=1, ctx_id=1, uid=5, cgroup="/x")
    (upcall,) = codec.decode_datagram(msg, FAMILY)
    verdict = Dispatcher(policy).on_upcall(upcall)
    assert (verdict.action, verdict.error) == (VerdictAction.DENY, errno.EACCES)


async def _serve_and_allocate(world: QuotaWorld) -> None:
    """Contexts 7 and 8 of tenant a hold 512 and 256 MiB; then SIGTERM."""
    serving = asyncio.create_task(world.daemon().serve())
    assert (await world.notification()).startswith("READY=1")
    k = world.kernel
    for uid, (ctx, size, handle) in enumerate([(7, 512 * MIB, 0x97), (8, 256 * MIB, 0x98)]):
        k.send(upcall_msg(kind=UpcallKind.OPEN, id=10 * uid + 1, ctx_id=ctx, uid=1000,
                          cgroup="/"))
        assert (await k.verdicts.get())[1] == VerdictAction.ALLOW
        if uid == 0:
            await make_device(k, ctx, 100)
        params, alloc = mem_alloc(size)
        k.send(upcall_msg(params, alloc, id=10 * uid + 2, ctx_id=ctx, nr=0x2B))
        assert (await k.verdicts.get())[1] == VerdictAction.ALLOW
        k.send(post_event_msg(ctx, 10 * uid + 2, 0x2B, 0, mem_alloc(size, h_new=handle)[0]))
    os.kill(os.getpid(), signal.SIGTERM)  # the drain handles the queued events first
    assert await serving == 0


def test_restart_keeps_the_charges_of_live_contexts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    first = QuotaWorld(tmp_path, "off")
    assert not first.policy.inner.restored
    run(_serve_and_allocate(first))
    # Nothing restored, but the contexts opened before it are asked for (their
    # cgroup paths are found off the loop): none here.
    assert first.kernel.requests.count(Cmd.LIST_CONTEXTS) == 1
    assert first.admin.manager.usage("a")[0].charged == 768 * MIB
    first.close()
    (tmp_path / "notify").unlink()

    again = QuotaWorld(tmp_path, "off")
    assert again.policy.inner.restored == {7, 8}
    again.kernel.contexts = [make_context(7), make_context(9)]  # 8 closed while no daemon ran

    async def main():
        serving = asyncio.create_task(again.daemon().serve())
        assert (await again.notification()).startswith("READY=1")
        assert Cmd.LIST_CONTEXTS in again.kernel.requests
        assert again.admin.manager.usage("a")[0].charged == 512 * MIB
        assert again.admin.manager.contexts("a") == 1
        params, alloc = mem_alloc(600 * MIB)  # 512 + 600 MiB > 1 GiB: still refused
        again.kernel.send(upcall_msg(params, alloc, id=50, ctx_id=7, nr=0x2B))
        assert await again.kernel.verdicts.get() == (
            50, VerdictAction.FAIL_STATUS, 0, 0x51, 28, 0, 0)
        os.kill(os.getpid(), signal.SIGTERM)
        assert await serving == 0

    run(main())
    assert "1 closed while the daemon was down" in caplog.text
    again.close()


def test_restart_keeps_every_charge_when_the_module_cannot_list(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    first = QuotaWorld(tmp_path, "off")
    run(_serve_and_allocate(first))
    first.close()
    (tmp_path / "notify").unlink()
    again = QuotaWorld(tmp_path, "off")
    again.kernel.errors[Cmd.LIST_CONTEXTS] = errno.EOPNOTSUPP

    async def main():
        serving = asyncio.create_task(again.daemon().serve())
        assert (await again.notification()).startswith("READY=1")
        os.kill(os.getpid(), signal.SIGTERM)
        assert await serving == 0

    run(main())
    assert again.admin.manager.usage("a")[0].charged == 768 * MIB
    assert "every restored charge is kept" in caplog.text
    again.close()


def test_without_libfuse_the_view_is_off_and_the_daemon_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """mfusepy raises OSError at import where libfuse is not installed: a log
    line, not a daemon that dies at every start."""
    _policy, app = build_quota(write_config(tmp_path), "off", inventory)
    assert app.fs_wanted

    def no_libfuse(name: str) -> object:
        raise OSError("Unable to find libfuse")

    monkeypatch.setattr(importlib, "import_module", no_libfuse)
    run(app.start_fs(None))  # type: ignore[arg-type]  # not reached without the module
    assert app.fs is None
    assert "file view not mounted: Unable to find libfuse" in caplog.text


def test_the_watchdog_is_fed_while_the_file_view_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd counts WatchdogSec from READY=1: a file view whose start takes
    longer (a slow mount helper) must not get the daemon killed."""
    monkeypatch.setenv("WATCHDOG_USEC", "20000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    world = QuotaWorld(tmp_path, "off")
    mounted = asyncio.Event()

    async def slow_start_fs(channel: object) -> None:
        await mounted.wait()

    monkeypatch.setattr(world.admin, "start_fs", slow_start_fs)

    async def main() -> None:
        serving = asyncio.create_task(world.daemon().serve())
        assert (await world.notification()).startswith("READY=1")
        assert await world.notification() == "WATCHDOG=1"
        assert await world.notification() == "WATCHDOG=1"  # the view still not started
        mounted.set()
        os.kill(os.getpid(), signal.SIGTERM)
        while await world.notification() != "STOPPING=1":
            pass
        assert await serving == 0

    run(main())
    world.close()
