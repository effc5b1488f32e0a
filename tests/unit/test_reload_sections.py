"""SIGHUP with a changed [metrics], [cdi], [fs] or [probes]: the quota daemon
(build_quota, the admin API on a private system bus) on the fake kernel.
The metrics move to a new address, stop and start again; the CDI spec moves
to a new directory and goes away; the two sections that take a restart say
so. A reload is SIGHUP or D-Bus Reload (vgpuctl reload) alike."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests.support.aio import until
from tests.support.bus import PrivateBus
from tests.support.daemon_world import World, inventory, write_config
from tests.support.fakekernel import make_stats
from tests.unit.test_metrics_service import free_port, get, values
from vgpud.app import App, build_quota
from vgpud.cdi.spec import SPEC_FILE
from vgpud.daemon import Daemon
from vgpud.host.systemd import Notifier
from vgpud.policy.dispatch import Dispatcher


def metrics(port: int | None) -> str:
    enabled = "false" if port is None else "true"
    return f'\n[metrics]\nenabled = {enabled}\nlisten = "127.0.0.1:{port or 9}"\n'


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def run_daemon(tmp_path: Path, extra: str, dbus: str,
               body: Callable[[App, Path], Awaitable[None]]) -> None:
    """Serve the config of ``extra``; ``body`` rewrites it and sends SIGHUPs."""
    config = write_config(tmp_path, extra)
    world = World(tmp_path, stats=make_stats())
    policy, app = build_quota(config, dbus, inventory, probes=False, fs=False)
    daemon = Daemon(Dispatcher(policy), policy.filter(), app, open_channel=world.open_channel,
                    notifier=Notifier(world.notify_path))

    async def main() -> None:
        serving = asyncio.create_task(daemon.serve())
        assert (await world.notification()).startswith("READY=1")
        await body(app, config)
        os.kill(os.getpid(), signal.SIGTERM)
        assert await serving == 0

    asyncio.run(asyncio.wait_for(main(), 60))
    world.close()


def test_a_reload_moves_stops_and_starts_the_metrics(tmp_path: Path) -> None:
    first, second = free_port(), free_port()

    async def body(app: App, config: Path) -> None:
        await until("serving", lambda: app.metrics is not None)
        assert app.metrics is not None and app.metrics.address == ("127.0.0.1", first)
        config.write_text(write_config(tmp_path, metrics(second)).read_text())
        os.kill(os.getpid(), signal.SIGHUP)
        await until("moved", lambda: app.metrics is not None
                    and app.metrics.address == ("127.0.0.1", second))
        status, text = await asyncio.to_thread(get, f"http://127.0.0.1:{second}/metrics")
        assert status == 200 and values(text, "vgpud_memory_limit_bytes") == {"a": 2**30}
        assert refused(first)
        write_config(tmp_path, metrics(None))
        os.kill(os.getpid(), signal.SIGHUP)
        await until("stopped", lambda: app.metrics is None and refused(second))
        denied = app.denied
        write_config(tmp_path, metrics(first))
        os.kill(os.getpid(), signal.SIGHUP)
        await until("started again", lambda: app.metrics is not None)
        assert app.denied is denied  # counted since the first start
        status, _ = await asyncio.to_thread(get, f"http://127.0.0.1:{first}/metrics")
        assert status == 200

    run_daemon(tmp_path, metrics(first), "off", body)


def test_a_reload_that_turns_the_metrics_on_serves_them(tmp_path: Path) -> None:
    port = free_port()

    async def body(app: App, config: Path) -> None:
        await asyncio.sleep(0.1)
        assert app.metrics is None and app.denied is None
        write_config(tmp_path, metrics(port))
        os.kill(os.getpid(), signal.SIGHUP)
        await until("serving", lambda: app.metrics is not None)
        status, text = await asyncio.to_thread(get, f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and values(text, "vgpud_memory_limit_bytes") == {"a": 2**30}

    run_daemon(tmp_path, "", "off", body)


def cdi(where: Path | None) -> str:
    if where is None:
        return "\n[cdi]\nenabled = false\n"
    return f'\n[cdi]\nspec_dir = "{where}"\n'


def test_a_reload_moves_and_removes_the_cdi_spec(tmp_path: Path,
                                                 system_bus: PrivateBus) -> None:
    first, second = tmp_path / "cdi-1", tmp_path / "cdi-2"

    async def body(app: App, config: Path) -> None:
        await until("written", (first / SPEC_FILE).exists)
        write_config(tmp_path, cdi(second))
        os.kill(os.getpid(), signal.SIGHUP)
        await until("moved", lambda: (second / SPEC_FILE).exists())
        assert not (first / SPEC_FILE).exists()
        assert '"vgpud.io/tenant"' in (second / SPEC_FILE).read_text()
        write_config(tmp_path, cdi(None))
        done = await asyncio.to_thread(  # D-Bus Reload, on the private system bus
            subprocess.run, [sys.executable, "-m", "vgpud.cli", "reload"],
            capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        await until("removed", lambda: not (second / SPEC_FILE).exists())
        assert app.cdi is None

    run_daemon(tmp_path, cdi(first), "require", body)


def test_a_reload_says_which_sections_take_a_restart(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "vgpud")

    async def body(app: App, config: Path) -> None:
        write_config(tmp_path, '\n[fs]\nmountpoint = "/run/elsewhere"\n'
                     '\n[probes]\ninterval_ms = 2000\n')
        os.kill(os.getpid(), signal.SIGHUP)
        await until("said", lambda: "[probes] changed" in caplog.text)

    run_daemon(tmp_path, "", "off", body)
    for name in ("fs", "probes"):
        assert (f"reload: [{name}] changed: it applies at the next restart "
                "(systemctl restart vgpud)") in caplog.text
    assert "[metrics] changed" not in caplog.text
