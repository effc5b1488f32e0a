"""vgpud: the process lifecycle (startup -> run -> graceful drain) and ``main``.

Startup resolves the vgpu family, registers, installs the policy's filter,
logs ``registered with vgpu module (protocol vN)`` and sends READY=1 to
$NOTIFY_SOCKET. SIGTERM/SIGINT start a graceful drain (STOPPING=1, answer
what is queued, UNREGISTER; the filter stays for the module's fail policy);
a second signal skips the drain.

The upcalls go to a vgpud.policy.dispatch.Dispatcher over the policy. With
``--config`` (or ``--policy quota``) the policy is the quota daemon's, built
with the parts around it by vgpud.app (config, state, inventory, Manager,
Ledger, journal, scheduler, the admin API org.vgpud1 on the system bus, with
$DBUS_SYSTEM_BUS_ADDRESS honoured); an unreachable bus is a warning unless
``--require-dbus``. SIGHUP reloads the config (a bad file keeps the last good
one).

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
from typing import TYPE_CHECKING

import click
import uvloop

from vgpud.host.systemd import Notifier, watchdog_interval
from vgpud.kernel import uapi
from vgpud.kernel.channel import ChannelError, GenlChannel, UpcallHandler
from vgpud.kernel.uapi import Filter
from vgpud.lograte import RateLimit
from vgpud.policy.base import Policy
from vgpud.policy.dispatch import Dispatcher
from vgpud.policy.rules import parse_filter_spec
from vgpud.policy.simple import parse_policy

if TYPE_CHECKING:
    from vgpud.app import App

__all__ = ["Daemon", "main"]

log = logging.getLogger("vgpud")

EX_UNAVAILABLE = 69
EX_CONFIG = 78
DRAIN_TIMEOUT = 5.0

ChannelFactory = Callable[[UpcallHandler], Awaitable[GenlChannel]]


class Daemon:
    def __init__(
        self,
        dispatcher: Dispatcher,
        filt: Filter,
        *,
        open_channel: ChannelFactory = GenlChannel.open,
        notifier: Notifier | None = None,
        app: App | None = None,
    ) -> None:
        """``app``: the quota daemon's parts beyond the upcall path (vgpud.app)."""
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
        if self.app is not None:
            loop.add_signal_handler(signal.SIGHUP, self.app.reload)
        try:
            if self.app is not None and not await self.app.start():
                return EX_UNAVAILABLE
            return await self._serve_channel()
        finally:
            if self.app is not None:
                await self.app.stop_probes()
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
            if self.app is not None:
                self.app.start_scheduling(channel)
                self.app.start_probes()
                await self.app.start_metrics(self.dispatcher, channel)
                await self.app.start_fs(channel)
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
            if self.app is not None:
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
        if self.app is not None:
            await self.app.stop_reconfiguring()  # a reload's restart of the metrics
            await self.app.stop_metrics()  # before the channel its refresh asks closes
            await self.app.stop_fs()  # likewise; and before the signal handlers go
            await self.app.stop_probes()  # the vgpu module is not pinned past the stop
            await self.app.stop_scheduling()  # groups back on while the channel is up
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
              default=None, help="TOML config; enables the quota policy "
              "[default path with --policy quota: /etc/vgpud/vgpud.toml].")
@click.option("--policy", "policy_spec", default=None,
              help="quota (the default with --config) | allow (the default without) | "
              "deny-class:0x40[,0x3f] (a test policy).")
@click.option("--filter", "filter_specs", multiple=True, metavar="SPEC",
              help="Extra rules: open | alloc[+shadow]:CLASSES | control[+shadow]:CMDS "
              "(repeatable).")
@click.option("--on-error", type=click.Choice(["deny", "allow"]), default="deny",
              show_default=True, help="Verdict when the policy fails or an upcall is malformed.")
@click.option("--no-dbus", is_flag=True, help="Do not serve the admin API (quota policy).")
@click.option("--require-dbus", is_flag=True,
              help="Exit (69) when the admin API cannot start on the system bus.")
@click.option("--no-probes", is_flag=True,
              help="Do not load the latency probes (quota policy), whatever the config says.")
@click.option("--probes-helper", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Load the latency probes in vgpud-probes over this socket "
              "(no CAP_BPF needed here), whatever the config says.")
@click.option("--metrics-helper", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Serve the metrics ([metrics] enabled) from vgpud-metrics "
              "over this socket instead of a child process, whatever the config says.")
@click.option("--no-fs", is_flag=True,
              help="Do not mount the file view (quota policy), whatever the config says.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
def main(config_path: Path | None, policy_spec: str | None, filter_specs: tuple[str, ...],
         on_error: str, no_dbus: bool, require_dbus: bool, no_probes: bool,
         no_fs: bool, log_level: str, probes_helper: Path | None,
         metrics_helper: Path | None) -> None:
    """The vgpud daemon: answers the vgpu kernel module's upcalls."""
    # Refusals are logged one by one: bounded per kind and tenant (lograte).
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RateLimit())
    logging.basicConfig(level=log_level.upper(), handlers=[handler],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if no_dbus and require_dbus:
        raise click.UsageError("--no-dbus and --require-dbus exclude each other")
    if policy_spec is None:
        policy_spec = "quota" if config_path is not None else "allow"
    app = None
    policy: Policy
    try:
        if policy_spec == "quota":
            # Here, not at the top: the quota daemon's parts (pydantic, dbus-fast) add
            # about 0.6 s of imports on a host and over a minute in the TCG test VM,
            # which the other policies need not wait for.
            from vgpud.app import StartupError, build_quota

            dbus = "off" if no_dbus else "require" if require_dbus else "try"
            try:
                policy, app = build_quota(config_path, dbus, probes=not no_probes,
                                          fs=not no_fs, probes_helper=probes_helper,
                                          metrics_helper=metrics_helper)
            except StartupError as exc:
                log.error("%s", exc)
                sys.exit(EX_CONFIG)
        else:
            if config_path is not None:
                raise click.UsageError(f"--config goes with --policy quota, not {policy_spec}")
            policy = parse_policy(policy_spec)
        filt = policy.filter()
        for spec in filter_specs:
            filt = filt + parse_filter_spec(spec)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    dispatcher = Dispatcher(policy, fail_open=on_error == "allow")
    # uvloop: every upcall costs one wakeup of the loop, and libuv's is far
    # cheaper than the pure-Python selector loop (docs/performance.md).
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        sys.exit(runner.run(Daemon(dispatcher, filt, app=app).serve()))


if __name__ == "__main__":
    main()
