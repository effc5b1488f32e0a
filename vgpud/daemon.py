"""vgpud: lifecycle (startup -> run -> graceful drain) and the upcall dispatcher.

Startup resolves the vgpu family, registers, installs the policy's filter,
logs ``registered with vgpu module (protocol v1)`` and sends READY=1 to
$NOTIFY_SOCKET. SIGTERM/SIGINT start a graceful drain (STOPPING=1, empty
filter, answer what is queued, UNREGISTER); a second signal skips the drain.

With ``--config`` (or ``--policy quota``) the daemon enforces per-tenant GPU
memory quotas (vgpud.policy.quota.QuotaPolicy): it loads the config and the runtime
state, takes the GPU inventory (vgpud.host.inventory), builds the Manager over a
Ledger, and serves the admin API org.vgpud1 on the system bus
($DBUS_SYSTEM_BUS_ADDRESS honoured); an unreachable bus is a warning unless
``--require-dbus``. SIGHUP reloads the config (a bad file keeps the last good
one). The ledger's charges and the scheduler's channel groups are journaled
(vgpud.store.journal, daemon.charges_path): a restarted daemon replays them, then
asks the module which contexts are still open and drops the charges and
groups of the others. Contexts it has no record of are learned lazily from
upcall headers.

Exit status: 0 after a graceful stop, 1 after a forced one, 69 (EX_UNAVAILABLE)
when the module is missing or refuses the registration (or the bus, with
--require-dbus), 78 (EX_CONFIG) when the config or state file is bad.
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
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import click
import uvloop

from vgpud.kernel import uapi
from vgpud.kernel.channel import ChannelError, GenlChannel, UpcallHandler
from vgpud.kernel.codec import DecodeError, Event, Upcall
from vgpud.kernel.uapi import (
    ALLOW,
    VERDICT_F_POST,
    VERDICT_F_SCHED_OFF,
    Filter,
    MmapParams,
    Node,
    UpcallKind,
    Verdict,
    VerdictAction,
)
from vgpud.nvidia.escapes import Escape
from vgpud.nvidia.layouts import NVOS21, NVOS64, decode_call
from vgpud.policy.base import Decoded, Policy, Request
from vgpud.policy.rules import parse_filter_spec
from vgpud.policy.simple import parse_policy

if TYPE_CHECKING:
    from dbus_fast.aio import MessageBus

    from vgpud.admin.dbus import AdminService
    from vgpud.admin.manager import Manager
    from vgpud.sched.service import SchedulerService
    from vgpud.store.journal import ChargeJournal

__all__ = ["Counters", "Daemon", "Dispatcher", "Notifier", "main"]

log = logging.getLogger("vgpud")

EX_UNAVAILABLE = 69
EX_CONFIG = 78
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

    OPEN, IOCTL and MMAP upcalls go to ``policy.decide``, POST upcalls to
    ``policy.decide_post``; MMAP params are decoded as struct vgpu_mmap_params.

    It never raises. Failures are counted, logged and answered with a safe
    verdict, fail-closed unless ``fail_open``:
    - the policy raises or returns a verdict that does not fit the upcall:
      DENY(EIO) (fail-open: ALLOW); for a POST upcall always ALLOW (the call
      has happened: keep the driver's results);
    - an upcall does not decode but its id can be read: DENY(EPROTO)
      (fail-open: ALLOW); one whose id is unreadable cannot be answered, and
      the module's timeout and fail policy complete it;
    - RM params do not decode: the policy still decides, with ``call=None``
      (the driver itself rejects a malformed params block).

    The params are decoded when the policy first reads ``Request.call``.
    """

    def __init__(self, policy: Policy, *, fail_open: bool = False) -> None:
        self.policy = policy
        self.counters = Counters()
        self._on_policy_error = ALLOW if fail_open else Verdict.deny(errno.EIO)
        self._on_malformed = ALLOW if fail_open else Verdict.deny(errno.EPROTO)

    def on_upcall(self, upcall: Upcall) -> Verdict:
        counters = self.counters
        counters.upcalls += 1
        kind = upcall.kind
        try:
            if kind is _POST:
                verdict = self.policy.decide_post(Request(upcall, self._decode))
            else:
                verdict = self.policy.decide(Request(upcall, self._decode))
            if verdict is not ALLOW:
                _check(verdict, upcall)
        except Exception:
            counters.policy_errors += 1
            log.exception("policy failed on upcall %d", upcall.id)
            verdict = ALLOW if kind is _POST else self._on_policy_error
        counters.verdicts += 1
        return verdict

    def _decode(self, upcall: Upcall) -> Decoded:
        """The decode behind ``Request.call``, run when a policy first reads it."""
        kind = upcall.kind
        try:
            if (kind is _IOCTL or kind is _POST) and upcall.node is not _UVM:
                return decode_call(upcall.nr, upcall.params, upcall.data)
            if kind is _MMAP:
                return MmapParams.unpack(upcall.params)
        except DecodeError as exc:
            self.counters.call_errors += 1
            log.warning("upcall %d: %s params: %s", upcall.id,
                        "mmap" if kind is _MMAP else f"escape {upcall.nr:#x}", exc)
        return None

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


_IOCTL, _POST, _MMAP, _UVM = UpcallKind.IOCTL, UpcallKind.POST, UpcallKind.MMAP, Node.UVM
_ALLOC_SIZES = frozenset({NVOS21.size, NVOS64.size})  # RM_ALLOC params VERDICT_F_SCHED_OFF fits
# The actions each upcall kind may be answered with.
_ACTIONS = {
    UpcallKind.OPEN: frozenset({VerdictAction.ALLOW, VerdictAction.DENY}),
    UpcallKind.IOCTL: frozenset(VerdictAction),
    UpcallKind.POST: frozenset({VerdictAction.ALLOW, VerdictAction.REPLY}),
    UpcallKind.MMAP: frozenset({VerdictAction.ALLOW, VerdictAction.DENY}),
}


def _check(verdict: Verdict, upcall: Upcall) -> None:
    """Refuse verdicts the module would refuse (the caller would then wait in vain)."""
    if type(verdict) is not Verdict:
        raise TypeError(f"policy returned {verdict!r}, not a Verdict")
    action = verdict.action
    if action not in _ACTIONS[upcall.kind]:
        raise ValueError(f"{action!r} does not answer a {upcall.kind.name} upcall")
    flags = verdict.flags
    if flags & ~(VERDICT_F_POST | VERDICT_F_SCHED_OFF) or (
        flags and (action is not VerdictAction.ALLOW or upcall.kind is not _IOCTL)
    ) or (flags & VERDICT_F_SCHED_OFF and (upcall.nr != Escape.RM_ALLOC
                                          or len(upcall.params) not in _ALLOC_SIZES)):
        raise ValueError(f"verdict flags {flags:#x} do not fit the upcall")
    if action is VerdictAction.FAIL_STATUS and verdict.status_off + 4 > len(upcall.params):
        raise ValueError(f"FAIL_STATUS at {verdict.status_off} does not fit the upcall")
    params, data = verdict.params, verdict.data
    if action is VerdictAction.REPLY:
        if params is None and data is None:
            raise ValueError("REPLY without blocks")
        if params is not None and len(params) != len(upcall.params):
            raise ValueError(f"REPLY params of {len(params)} bytes, upcall's {len(upcall.params)}")
        if data is not None and (upcall.data is None or len(data) != len(upcall.data)):
            raise ValueError(f"REPLY data of {len(data)} bytes does not fit the upcall's")
    elif params is not None or data is not None:
        raise ValueError("blocks only go with REPLY")


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


class AdminUnavailable(Exception):
    """The admin API could not start and was required."""


class Admin:
    """The admin side of a quota daemon: the Manager, served on D-Bus, and the
    TDMA scheduler that follows it (vgpud.sched).

    ``dbus``: "off" (--no-dbus), "try" (an unreachable bus is a warning) or
    "require" (--require-dbus: the daemon does not start without it).
    """

    def __init__(self, manager: Manager, dbus: str = "try", *,
                 journal: ChargeJournal | None = None,
                 reconcile: Callable[[list[uapi.Context]], None] | None = None,
                 scheduler: SchedulerService | None = None) -> None:
        """``journal``: the charge journal (closed with the admin side);
        ``reconcile``: told the live contexts after registration, when charges
        of contexts were restored from it; ``scheduler``: the TDMA scheduler."""
        self.manager = manager
        self.dbus = dbus
        self.scheduler = scheduler
        self.service: AdminService | None = None
        self._bus: MessageBus | None = None
        self._journal = journal
        self._reconcile = reconcile

    async def attach(self, channel: GenlChannel) -> None:
        """Registered: drop the restored charges of contexts closed meanwhile."""
        if self._reconcile is None:
            return
        try:
            live = await channel.list_contexts()
        except (ChannelError, DecodeError) as exc:
            log.warning("cannot list the live contexts (%s): every restored charge is kept "
                        "until its context closes", exc)
            return
        self._reconcile(live)

    async def start(self) -> None:
        if self.dbus == "off":
            log.info("admin API off (--no-dbus)")
            return
        from dbus_fast import BusType
        from dbus_fast.aio import MessageBus

        from vgpud.admin.dbus import BUS_NAME, AdminService

        bus = None
        try:
            bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
            service = AdminService(self.manager, bus, self.scheduler)
            await service.start()
        except Exception as exc:
            if bus is not None:
                bus.disconnect()
            text = f"admin API {BUS_NAME} not available on the system bus: {exc}"
            if self.dbus == "require":
                raise AdminUnavailable(text) from exc
            log.warning("%s; running without it", text)
            return
        self._bus, self.service = bus, service
        log.info("admin API %s on the system bus", BUS_NAME)

    def start_scheduling(self, channel: GenlChannel) -> None:
        if self.scheduler is not None:
            from vgpud.sched.actuator import ModuleActuator

            self.scheduler.start(ModuleActuator(channel))

    async def stop_scheduling(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.stop()

    def reload(self) -> None:
        """SIGHUP: re-read the config; a bad one keeps the last good one."""
        from vgpud.admin.manager import AdminError

        try:
            self.manager.reload()
        except AdminError as exc:
            log.error("reload failed, keeping the last good config: %s", exc)
            return
        log.info("reloaded %s: %d tenants", self.manager.config_path,
                 len(self.manager.tenants))

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
            self.service = None
        if self._bus is not None:
            self._bus.disconnect()
            self._bus = None
        if self._journal is not None:
            self._journal.close()
            self._journal = None


class Daemon:
    def __init__(
        self,
        dispatcher: Dispatcher,
        filt: Filter,
        *,
        open_channel: ChannelFactory = GenlChannel.open,
        notifier: Notifier | None = None,
        admin: Admin | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.admin = admin
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
        if self.admin is not None:
            loop.add_signal_handler(signal.SIGHUP, self.admin.reload)
        try:
            if self.admin is not None:
                try:
                    await self.admin.start()
                except AdminUnavailable as exc:
                    log.error("%s", exc)
                    return EX_UNAVAILABLE
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
            if self.admin is not None:
                self.admin.start_scheduling(self.channel)
            await self._run(self.channel)
            await self._stop(self.channel)
            return 1 if self._force else 0
        finally:
            if self.admin is not None:
                self.admin.close()
                loop.remove_signal_handler(signal.SIGHUP)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def _start(self) -> GenlChannel:
        channel = await self._open_channel(self.dispatcher)
        try:
            await channel.register()
            await channel.set_filter(self.filter)
            if self.admin is not None:
                await self.admin.attach(channel)
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
        if self.admin is not None:
            await self.admin.stop_scheduling()  # groups back on while the channel is up
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


def cgroup_path_by_id(root: Path = Path("/sys/fs/cgroup")) -> Callable[[int], str | None]:
    """Finds a cgroup v2 path from its id (the inode number of its directory).

    For contexts opened before the daemon started (their upcalls carry the
    cgroup id, not the path); walks the hierarchy once per unknown id.
    """

    @lru_cache(maxsize=4096)
    def lookup(cgroup_id: int) -> str | None:
        try:
            if root.stat().st_ino == cgroup_id:
                return "/"
            for dirpath, _dirs, _files in os.walk(root):
                if os.stat(dirpath).st_ino == cgroup_id:
                    return "/" + os.path.relpath(dirpath, root)
        except OSError:
            pass
        return None

    return lookup


class StartupError(Exception):
    """Config, state or inventory that the daemon cannot start with (EX_CONFIG)."""


def build_quota(config_path: Path, dbus: str, inventory=None) -> tuple[Policy, Admin]:
    """Config, state, inventory, Manager, Ledger (with the charges of the journal),
    QuotaPolicy and the TDMA scheduler over it (vgpud.sched); StartupError on bad files."""
    from vgpud.admin.manager import Manager
    from vgpud.core.groups import GroupTracker
    from vgpud.core.ledger import Ledger
    from vgpud.host import inventory as inv
    from vgpud.host.procmem import ProcessMemory
    from vgpud.policy.quota import QuotaPolicy
    from vgpud.store.config import ConfigError, load_config
    from vgpud.store.journal import ChargeJournal
    from vgpud.store.state import StateError, load_state

    try:
        config = load_config(config_path)
        state = load_state(config.daemon.state_path)
    except (ConfigError, StateError) as exc:
        raise StartupError(str(exc)) from exc
    gpus = (inventory or inv.discover)()
    if not gpus:
        log.warning("no GPUs in the inventory: every charged allocation will be refused")
    ledger = Ledger()
    manager = Manager(config_path, config, state, ledger, gpus)
    log.info("config %s: %d tenants, %d GPUs", config_path, len(manager.tenants), len(gpus))
    tracker = GroupTracker()
    journal = ChargeJournal.resume(config.daemon.charges_path, ledger, groups=tracker)
    quota = QuotaPolicy(manager, ledger, cgroup_path=cgroup_path_by_id(),
                        memory=ProcessMemory())
    reconcile = None
    if quota.restored:
        def reconcile(live: list[uapi.Context]) -> None:
            for ctx in quota.reconcile(live):
                tracker.closed(ctx)
    from vgpud.sched.service import build as build_scheduling

    policy, scheduler = build_scheduling(manager, quota, tracker)
    return policy, Admin(manager, dbus, journal=journal, reconcile=reconcile,
                         scheduler=scheduler)


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
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True)
def main(config_path: Path | None, policy_spec: str | None, filter_specs: tuple[str, ...],
         on_error: str, no_dbus: bool, require_dbus: bool, log_level: str) -> None:
    """The vgpud daemon: answers the vgpu kernel module's upcalls."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if no_dbus and require_dbus:
        raise click.UsageError("--no-dbus and --require-dbus exclude each other")
    if policy_spec is None:
        policy_spec = "quota" if config_path is not None else "allow"
    admin = None
    try:
        if policy_spec == "quota":
            from vgpud.store.config import DEFAULT_CONFIG_PATH

            dbus = "off" if no_dbus else "require" if require_dbus else "try"
            try:
                policy, admin = build_quota(config_path or DEFAULT_CONFIG_PATH, dbus)
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
        sys.exit(runner.run(Daemon(dispatcher, filt, admin=admin).serve()))


if __name__ == "__main__":
    main()
