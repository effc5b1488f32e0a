"""vgpud: the process lifecycle (startup -> run -> graceful drain) and ``main``.

Startup serves the admin API, resolves the vgpu family, registers, installs
the policy's filter, logs ``registered with vgpu module (protocol vN)`` and
sends READY=1 to $NOTIFY_SOCKET; then the services around the upcall path
start in their declared order (vgpud.app). SIGTERM/SIGINT start a graceful
drain (STOPPING=1, the services stopped in reverse, answer what is queued,
UNREGISTER; the filter stays for the module's fail policy); a second signal
skips the drain. SIGHUP reloads the config (a bad file keeps the last good
one).

The upcalls go to a vgpud.policy.dispatch.Dispatcher over the quota policy,
built with the parts around it by vgpud.app (config, state, inventory,
Manager, Ledger, journal, scheduler, the admin API org.vgpud1 on the system
bus, with $DBUS_SYSTEM_BUS_ADDRESS honoured); an unreachable bus is a warning
unless ``--require-dbus``.

Exit status: 0 after a graceful stop, 1 after a forced one, 69 (EX_UNAVAILABLE)
when the module is missing or refuses the registration (or the bus, with
--require-dbus), 78 (EX_CONFIG) when the config or state file is bad.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

import click
import uvloop

from vgpud.host.systemd import Notifier, watchdog_interval
from vgpud.kernel import uapi
from vgpud.kernel.channel import ChannelError, GenlChannel, UpcallHandler
from vgpud.kernel.uapi import Filter
from vgpud.lograte import RateLimit
from vgpud.policy.dispatch import Dispatcher

__all__ = ["Daemon", "Services", "main"]

log = logging.getLogger("vgpud")

EX_UNAVAILABLE = 69
EX_CONFIG = 78
DRAIN_TIMEOUT = 5.0

ChannelFactory = Callable[[UpcallHandler], Awaitable[GenlChannel]]


class Services(Protocol):
    """What runs around the upcall path (vgpud.app.App), at each step of the
    lifecycle."""

    async def start(self) -> bool:
        """Before the channel (the admin API); False: exit EX_UNAVAILABLE."""
        ...

    async def attach(self, channel: GenlChannel) -> None:
        """Registered, before READY=1."""
        ...

    async def serve(self, dispatcher: Dispatcher, channel: GenlChannel) -> None:
        """After READY=1: start each service, in their declared order."""
        ...

    async def stop(self) -> None:
        """Stop what ``serve`` started, in reverse, the channel still up (idempotent)."""
        ...

    def reload(self) -> None: ...

    def close(self) -> None: ...


class Daemon:
    def __init__(
        self,
        dispatcher: Dispatcher,
        filt: Filter,
        app: Services,
        *,
        open_channel: ChannelFactory = GenlChannel.open,
        notifier: Notifier | None = None,
    ) -> None:
        """``app``: the parts beyond the upcall path (vgpud.app)."""
        self.dispatcher = dispatcher
        self.app = app
        self.filter = filt
        self._open_channel = open_channel
        self._notifier = notifier or Notifier.from_env()
        self._exit: asyncio.Event | None = None
        self._force = False
        self._startup: asyncio.Task[GenlChannel] | None = None
        self._drain: asyncio.Task[None] | None = None
        self.channel: GenlChannel | None = None

    def handle_exit(self, sig: int) -> None:
        """First signal: graceful stop. Second: skip the drain."""
        name = signal.Signals(sig).name
        assert self._exit is not None
        if self._exit.is_set():
            log.warning("%s again: forcing exit", name)
            self._force = True
            if self._drain is not None:
                self._drain.cancel()
            return
        log.info("%s: shutting down", name)
        self._exit.set()
        if self._startup is not None:
            self._startup.cancel()

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        self._exit = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.handle_exit, sig)
        loop.add_signal_handler(signal.SIGHUP, self.app.reload)
        try:
            if not await self.app.start():
                return EX_UNAVAILABLE
            return await self._serve_channel()
        finally:
            await self.app.stop()  # what a failure left running
            self.app.close()
            loop.remove_signal_handler(signal.SIGHUP)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def _serve_channel(self) -> int:
        assert self._exit is not None
        try:
            self._startup = asyncio.create_task(self._start())
            self.channel = channel = await self._startup
        except asyncio.CancelledError:
            if not self._exit.is_set():
                raise  # cancelled from outside, not by a signal
            return 1 if self._force else 0
        except ChannelError as exc:
            log.error("%s", exc)
            return EX_UNAVAILABLE
        finally:
            self._startup = None
        # From READY=1 on, systemd expects WATCHDOG=1 within WatchdogSec, and
        # the file view's start can take longer than that in a slow guest.
        interval = watchdog_interval()
        pinger = asyncio.create_task(self._watchdog(interval)) if interval else None
        try:
            await self.app.serve(self.dispatcher, channel)
            await self._run(channel)
        finally:
            if pinger is not None:
                pinger.cancel()
        await self._stop(channel)
        return 1 if self._force else 0

    async def _start(self) -> GenlChannel:
        channel = await self._open_channel(self.dispatcher)
        try:
            await channel.register()
            await channel.set_filter(self.filter)
            await self.app.attach(channel)
        except BaseException:
            channel.close()
            raise
        log.info("filter: flags %#x, %d rules", self.filter.flags, len(self.filter.rules))
        log.info("registered with vgpu module (protocol v%d)", uapi.PROTO_VERSION)
        self._notifier.send("READY=1", "STATUS=serving upcalls")
        return channel

    async def _run(self, channel: GenlChannel) -> None:
        """Serve until a signal or the channel's loss."""
        assert self._exit is not None
        async with asyncio.TaskGroup() as tasks:
            stopped = tasks.create_task(self._exit.wait())
            lost = tasks.create_task(channel.wait_closed())
            await asyncio.wait([stopped, lost], return_when=asyncio.FIRST_COMPLETED)
            for task in (stopped, lost):
                task.cancel()
        if not lost.cancelled():
            log.error("lost the netlink channel")

    async def _watchdog(self, interval: float) -> None:
        while True:
            self._notifier.send("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def _stop(self, channel: GenlChannel) -> None:
        self._notifier.send("STOPPING=1")
        await self.app.stop()  # while the channel is up: groups back on, refreshes done
        if not self._force:
            self._drain = asyncio.create_task(self._drain_channel(channel))
            try:
                await asyncio.wait_for(self._drain, DRAIN_TIMEOUT)
            except asyncio.CancelledError:
                log.warning("drain skipped")
            except (ChannelError, TimeoutError) as exc:
                log.warning("drain incomplete: %s", exc)
            finally:
                self._drain = None
        channel.close()
        log.info("stopped: %s; channel %s", asdict(self.dispatcher.counters),
                 asdict(channel.stats))

    @staticmethod
    async def _drain_channel(channel: GenlChannel) -> None:
        """Answer what is queued, then unregister; the filter stays installed.

        The reader handles messages in order, so when the GET_STATS reply
        arrives every upcall queued before it has been answered. The filter
        is left in place on purpose: while no daemon is registered the
        module's fail policy (fail-closed or fail-open) governs those calls,
        rather than an emptied filter silently opening them.
        """
        await channel.get_stats()
        await channel.unregister()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="TOML config [default: /etc/vgpud/vgpud.toml].")
@click.option("--on-error", type=click.Choice(["deny", "allow"]), default="deny",
              show_default=True, help="Verdict when the policy fails or an upcall is malformed.")
@click.option("--no-dbus", is_flag=True, help="Do not serve the admin API.")
@click.option("--require-dbus", is_flag=True,
              help="Exit (69) when the admin API cannot start on the system bus.")
@click.option("--no-probes", is_flag=True,
              help="Do not load the latency probes, whatever the config says.")
@click.option("--probes-helper", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Load the latency probes in vgpud-probes over this socket "
              "(no CAP_BPF needed here), whatever the config says.")
@click.option("--metrics-helper", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Serve the metrics ([metrics] enabled) from vgpud-metrics "
              "over this socket instead of a child process, whatever the config says.")
@click.option("--no-fs", is_flag=True,
              help="Do not mount the file view, whatever the config says.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
def main(config_path: Path | None, on_error: str, no_dbus: bool, require_dbus: bool,
         no_probes: bool, no_fs: bool, log_level: str, probes_helper: Path | None,
         metrics_helper: Path | None) -> None:
    """The vgpud daemon: answers the vgpu kernel module's upcalls."""
    configure_logging(log_level)
    if no_dbus and require_dbus:
        raise click.UsageError("--no-dbus and --require-dbus exclude each other")
    # Here, not at the top: the quota daemon's parts (pydantic, dbus-fast) take
    # seconds to import in the TCG test VM, which --help need not wait for.
    from vgpud.app import StartupError, build_quota

    dbus = "off" if no_dbus else "require" if require_dbus else "try"
    try:
        policy, app = build_quota(config_path, dbus, probes=not no_probes, fs=not no_fs,
                                  probes_helper=probes_helper, metrics_helper=metrics_helper)
    except StartupError as exc:
        log.error("%s", exc)
        sys.exit(EX_CONFIG)
    run(Daemon(Dispatcher(policy, fail_open=on_error == "allow"), policy.filter(), app))


def configure_logging(level: str) -> None:
    # Refusals are logged one by one: bounded per kind and tenant (lograte).
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RateLimit())
    logging.basicConfig(level=level.upper(), handlers=[handler],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run(daemon: Daemon) -> None:
    """Serve until stopped, and exit with the daemon's status."""
    # uvloop: every upcall costs one wakeup of the loop, and libuv's is far
    # cheaper than the pure-Python selector loop (docs/bench-log.md, 2026-11-30).
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        sys.exit(runner.run(daemon.serve()))


if __name__ == "__main__":
    main()
