"""vgpud: lifecycle (startup -> run -> graceful drain) and the upcall dispatcher.

Startup resolves the vgpu family, registers, installs the policy's filter,
logs ``registered with vgpu module (protocol v1)`` and sends READY=1 to
$NOTIFY_SOCKET. SIGTERM/SIGINT start a graceful drain (STOPPING=1, empty
filter, answer what is queued, UNREGISTER); a second signal skips the drain.

Exit status: 0 after a graceful stop, 1 after a forced one, 69 (EX_UNAVAILABLE)
when the module is missing or refuses the registration.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import click

from vgpud.kernel import uapi
from vgpud.kernel.channel import ChannelError, GenlChannel, UpcallHandler
from vgpud.kernel.codec import DecodeError, Event, Upcall
from vgpud.kernel.uapi import ALLOW, Filter, Node, UpcallKind, Verdict, VerdictAction
from vgpud.nvidia.layouts import decode_call
from vgpud.nvidia.rules import parse_filter_spec
from vgpud.policy import Policy, Request, parse_policy

__all__ = ["Counters", "Daemon", "Dispatcher", "Notifier", "main"]

log = logging.getLogger("vgpud")

EX_UNAVAILABLE = 69
DRAIN_TIMEOUT = 5.0


@dataclass(slots=True)
class Counters:
    upcalls: int = 0
    verdicts: int = 0
    events: int = 0
    malformed: int = 0  # messages that did not decode
    unanswered: int = 0  # malformed upcalls whose id was unreadable
    call_errors: int = 0  # RM params that did not decode (the policy saw call=None)
    policy_errors: int = 0  # policy raised or gave an unusable verdict


class Dispatcher:
    """Sans-I/O core of the upcall path: typed messages in, verdicts out.

    It never raises. Failures are counted, logged and answered with a safe
    verdict, fail-closed unless ``fail_open``:
    - the policy raises or returns a verdict that does not fit the upcall:
      DENY(EIO) (fail-open: ALLOW);
    - an upcall does not decode but its id can be read: DENY(EPROTO)
      (fail-open: ALLOW); one whose id is unreadable cannot be answered, and
      the module's timeout and fail policy complete it;
    - RM params do not decode: the policy still decides, with ``call=None``
      (the driver itself rejects a malformed params block).
    """

    def __init__(self, policy: Policy, *, fail_open: bool = False) -> None:
        self.policy = policy
        self.counters = Counters()
        self._on_policy_error = ALLOW if fail_open else Verdict.deny(errno.EIO)
        self._on_malformed = ALLOW if fail_open else Verdict.deny(errno.EPROTO)

    def on_upcall(self, upcall: Upcall) -> Verdict:
        counters = self.counters
        counters.upcalls += 1
        call = None
        if upcall.kind is _IOCTL and upcall.node is not _UVM:
            try:
                call = decode_call(upcall.nr, upcall.params, upcall.data)
            except DecodeError as exc:
                counters.call_errors += 1
                log.warning("upcall %d: escape %#x params: %s", upcall.id, upcall.nr, exc)
        try:
            verdict = self.policy.decide(Request(upcall, call))
            _check(verdict, upcall)
        except Exception:
            counters.policy_errors += 1
            log.exception("policy failed on upcall %d", upcall.id)
            verdict = self._on_policy_error
        counters.verdicts += 1
        return verdict

    def on_event(self, event: Event) -> None:
        self.counters.events += 1
        try:
            self.policy.on_event(event)
        except Exception:
            self.counters.policy_errors += 1
            log.exception("policy failed on %s", type(event).__name__)

    def on_malformed(self, error: DecodeError) -> Verdict | None:
        self.counters.malformed += 1
        if error.upcall_id is None:
            self.counters.unanswered += 1
            log.warning("malformed message: %s", error)
            return None
        log.warning("malformed upcall %d: %s", error.upcall_id, error)
        self.counters.verdicts += 1
        return self._on_malformed


_IOCTL, _UVM = UpcallKind.IOCTL, Node.UVM


def _check(verdict: Verdict, upcall: Upcall) -> None:
    """Refuse verdicts the module would refuse (the caller would then wait in vain)."""
    if verdict is ALLOW:
        return
    if type(verdict) is not Verdict:
        raise TypeError(f"policy returned {verdict!r}, not a Verdict")
    if verdict.action is VerdictAction.FAIL_STATUS and (
        upcall.kind is not UpcallKind.IOCTL or verdict.status_off + 4 > len(upcall.params)
    ):
        raise ValueError(f"FAIL_STATUS at {verdict.status_off} does not fit the upcall")


class Notifier:
    """sd_notify over a plain AF_UNIX datagram; a no-op without $NOTIFY_SOCKET."""

    def __init__(self, address: str | None) -> None:
        if address and address.startswith("@"):
            address = "\0" + address[1:]
        self._address = address or None

    @classmethod
    def from_env(cls) -> Notifier:
        return cls(os.environ.get("NOTIFY_SOCKET"))

    def notify(self, *states: str) -> None:
        if self._address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto("\n".join(states).encode(), self._address)
        except OSError as exc:
            log.warning("sd_notify %s: %s", states, exc)


def watchdog_interval(env: dict[str, str] | os._Environ[str] = os.environ) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None."""
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None


ChannelFactory = Callable[[UpcallHandler], Awaitable[GenlChannel]]


class Daemon:
    def __init__(
        self,
        dispatcher: Dispatcher,
        filt: Filter,
        *,
        open_channel: ChannelFactory = GenlChannel.open,
        notifier: Notifier | None = None,
    ) -> None:
        self.dispatcher = dispatcher
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
        try:
            try:
                self._startup = asyncio.create_task(self._start())
                self.channel = await self._startup
            except asyncio.CancelledError:
                if not self._exit.is_set():
                    raise  # cancelled from outside, not by a signal
                return 1 if self._force else 0
            except ChannelError as exc:
                log.error("%s", exc)
                return EX_UNAVAILABLE
            finally:
                self._startup = None
            await self._run(self.channel)
            await self._stop(self.channel)
            return 1 if self._force else 0
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def _start(self) -> GenlChannel:
        channel = await self._open_channel(self.dispatcher)
        try:
            await channel.register()
            await channel.set_filter(self.filter)
        except BaseException:
            channel.close()
            raise
        log.info("filter: flags %#x, %d rules", self.filter.flags, len(self.filter.rules))
        log.info("registered with vgpu module (protocol v%d)", uapi.PROTO_VERSION)
        self._notifier.notify("READY=1", "STATUS=serving upcalls")
        return channel

    async def _run(self, channel: GenlChannel) -> None:
        assert self._exit is not None
        waits = [asyncio.create_task(self._exit.wait()),
                 asyncio.create_task(channel.wait_closed())]
        interval = watchdog_interval()
        if interval:
            waits.append(asyncio.create_task(self._watchdog(interval)))
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        if waits[1] in done:
            log.error("lost the netlink channel")

    async def _watchdog(self, interval: float) -> None:
        while True:
            self._notifier.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def _stop(self, channel: GenlChannel) -> None:
        self._notifier.notify("STOPPING=1")
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
@click.option("--policy", "policy_spec", default="allow", show_default=True,
              help="allow | deny-class:0x40[,0x3f] (a test policy).")
@click.option("--filter", "filter_specs", multiple=True, metavar="SPEC",
              help="Extra rules: open | alloc:CLASSES | control:CMDS (repeatable).")
@click.option("--on-error", type=click.Choice(["deny", "allow"]), default="deny",
              show_default=True, help="Verdict when the policy fails or an upcall is malformed.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
def main(policy_spec: str, filter_specs: tuple[str, ...], on_error: str, log_level: str) -> None:
    """The vgpud daemon: answers the vgpu kernel module's upcalls."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        policy = parse_policy(policy_spec)
        filt = policy.filter()
        for spec in filter_specs:
            filt = filt + parse_filter_spec(spec)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    dispatcher = Dispatcher(policy, fail_open=on_error == "allow")
    sys.exit(asyncio.run(Daemon(dispatcher, filt).serve()))


if __name__ == "__main__":
    main()
