"""The metrics adapter: a snapshot refreshed on the event loop, rendered and
served over HTTP by another process (vgpud.metrics.exporter).

The daemon binds the listening socket itself (a port it cannot bind is a
log line; the daemon serves upcalls without metrics) and sends it to the
exporter (SCM_RIGHTS) over a stream connection: a socketpair with a child
process, or, with ``helper``, a connection to vgpud-metrics.socket, whose
vgpud-metrics@.service runs the exporter as a dynamic user with no
capabilities and no network of its own (the HTTP parser then has none of
the daemon's CAP_NET_ADMIN, CAP_SYS_NICE nor root's files). The loop does
the cheap part: every ``interval`` it asks the module for its counters
(GET_STATS, the one await), copies the daemon's figures into a Snapshot
(vgpud.metrics.snapshot) and, when it differs from the last, sends it in
vgpud.metrics.wire's encoding. The send never blocks: the socket is
non-blocking, and while the exporter has not read one frame, a newer
snapshot replaces the one waiting behind it instead of queueing. Rendering
and HTTP take the exporter's CPU and GIL, never the loop's; the daemon loads
no HTTP server nor prometheus_client. The exporter reads the connection and
nothing else of the daemon: it exits at its end of stream (and a child with
the daemon, PR_SET_PDEATHSIG). When it is gone the daemon starts or
connects another after a back-off, the listening socket (and its backlog of
scrapers) kept meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from vgpud.kernel.channel import ChannelError
from vgpud.kernel.codec import DecodeError
from vgpud.kernel.uapi import Stats, Stats4
from vgpud.metrics.listen import REQUEST_TIMEOUT
from vgpud.metrics.snapshot import Snapshot
from vgpud.metrics.wire import HELLO, encode, frame

__all__ = ["MetricsService"]

log = logging.getLogger("vgpud.metrics")

REFRESH_INTERVAL = 1.0  # seconds between snapshots
RESTART_DELAY = 1.0  # first back-off before a lost exporter is started (connected) again
RESTART_DELAY_MAX = 60.0  # doubling up to this; reset once one has lived this long
STOP_TIMEOUT = 5.0  # seconds the exporter gets after SIGTERM, before SIGKILL
SEND_BUFFER = 1 << 20  # room for a snapshot of thousands of accounts (capped by wmem_max)
LISTEN_BACKLOG = 16
# systemd's words to the daemon alone: the exporter is no notifier nor watched.
_DAEMON_ONLY = frozenset({"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS",
                          "LISTEN_PID", "LISTEN_FDNAMES"})

Collect = Callable[[Stats | None, Stats4 | None], Snapshot]
GetCounters = Callable[[], Awaitable[tuple[Stats, Stats4 | None]]]


class MetricsService:
    """``collect`` makes a snapshot on the loop from the module's counters
    (None until GET_STATS answers); ``get_counters`` asks the module;
    ``helper``: the exporter is vgpud-metrics on this socket, not a child."""

    def __init__(self, host: str, port: int, collect: Collect, get_counters: GetCounters, *,
                 helper: Path | None = None, interval: float = REFRESH_INTERVAL,
                 request_timeout: float = REQUEST_TIMEOUT,
                 restart_delay: float = RESTART_DELAY) -> None:
        self.host, self.port = host, port
        self._helper = helper
        self._collect = collect
        self._get_counters = get_counters
        self._interval = interval
        self._request_timeout = request_timeout
        self._restart_delay = restart_delay
        self._delay = restart_delay
        self._module: tuple[Stats | None, Stats4 | None] = (None, None)
        self.latest: Snapshot = collect(None, None)
        self._payload = encode(self.latest)
        self._listener: socket.socket | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._module_failing = False
        self.exporter: _Link | None = None
        self._restart: asyncio.TimerHandle | None = None

    @property
    def address(self) -> tuple[str, int] | None:
        """Where it serves (the port bound), None when it does not."""
        if self._listener is None:
            return None
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> bool:
        """Bind and serve; False (logged) when the address cannot be bound."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(LISTEN_BACKLOG)
        except OSError as exc:
            listener.close()
            log.error("metrics: cannot listen on %s port %d (%s): running without metrics",
                      self.host, self.port, exc.strerror or exc)
            return False
        self._listener = listener
        self._spawn()
        self._refresher = asyncio.create_task(self._refresh_loop())
        host, port = listener.getsockname()[:2]
        log.info("metrics: serving http://%s/metrics", _url_host(str(host), int(port)))
        return True

    async def stop(self) -> None:
        refresher, self._refresher = self._refresher, None
        if refresher is not None:
            refresher.cancel()
            await asyncio.wait([refresher])
        if self._restart is not None:
            self._restart.cancel()
            self._restart = None
        child, self.exporter = self.exporter, None
        if child is not None:
            await child.stop()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    async def refresh(self) -> None:
        """Ask the module for its counters, take a snapshot, send it if new."""
        try:
            self._module = await self._get_counters()
            self._module_failing = False
        except (ChannelError, DecodeError) as exc:
            if not self._module_failing:
                log.warning("metrics: module counters unavailable (%s): keeping the last", exc)
            self._module_failing = True
        self.latest = self._collect(*self._module)
        payload = encode(self.latest)
        if payload != self._payload:
            self._payload = payload
            if self.exporter is not None:
                self.exporter.offer(frame(payload))

    async def _refresh_loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._interval)

    def _spawn(self) -> None:
        self._restart = None
        assert self._listener is not None
        try:
            link: _Link = (_Child(self._listener, self._request_timeout, self._lost)
                           if self._helper is None
                           else _Remote(self._listener, self._helper, self._lost))
        except OSError as exc:
            where = "the exporter" if self._helper is None else f"vgpud-metrics at {self._helper}"
            log.error("metrics: cannot start %s (%s)", where, exc)
            self._schedule_restart()
            return
        self.exporter = link
        link.offer(frame(self._payload))

    def _lost(self, link: _Link, why: str, lived: float) -> None:
        if link is not self.exporter:
            return
        self.exporter = None
        if lived >= RESTART_DELAY_MAX:
            self._delay = self._restart_delay
        log.warning("metrics: %s: restarting in %.1f s", why, self._delay)
        self._schedule_restart()

    def _schedule_restart(self) -> None:
        delay, self._delay = self._delay, min(self._delay * 2, RESTART_DELAY_MAX)
        self._restart = asyncio.get_running_loop().call_later(delay, self._spawn)


Lost = Callable[["_Link", str, float], None]


class _Link:
    """Our end of an exporter's connection: it is sent the listening socket
    first (HELLO with SCM_RIGHTS), then frames. The frame being written and
    the one after it are kept; a newer one replaces the second, never queues."""

    def __init__(self, conn: socket.socket, listener: socket.socket, lost: Lost) -> None:
        self._loop = asyncio.get_running_loop()
        self._conn = conn
        self._lost = lost
        self._started = time.monotonic()
        conn.setblocking(False)
        socket.send_fds(conn, [HELLO], [listener.fileno()])  # the first frame: room for it
        self._out: memoryview | None = None  # the frame being written
        self._next: bytes | None = None  # the one after it (replaced, never queued)
        self._writing = False

    def offer(self, data: bytes) -> None:
        """Send ``data`` (a whole frame) now, or after the frame in flight."""
        if self._conn.fileno() < 0:
            return
        if self._out is not None:
            self._next = data
            return
        self._out = memoryview(data)
        self._flush()

    def _flush(self) -> None:
        while self._out is not None:
            try:
                n = self._conn.send(self._out)
            except BlockingIOError:
                if not self._writing:
                    self._loop.add_writer(self._conn, self._flush)
                    self._writing = True
                return
            except OSError:  # EPIPE: it is gone; its end says so
                self._out = self._next = None
                break
            self._out = self._out[n:] if n < len(self._out) else None
            if self._out is None and self._next is not None:
                self._out, self._next = memoryview(self._next), None
        if self._writing:
            self._loop.remove_writer(self._conn)
            self._writing = False

    def _close(self) -> None:
        if self._writing:
            self._loop.remove_writer(self._conn)
            self._writing = False
        self._conn.close()

    def _ended(self, why: str) -> None:
        self._close()
        self._lost(self, why, time.monotonic() - self._started)

    async def stop(self) -> None:
        self._close()


class _Child(_Link):
    """An exporter process of ours on a socketpair; its exit is seen on a
    pidfd (no thread, no SIGCHLD handler)."""

    def __init__(self, listener: socket.socket, timeout: float, lost: Lost) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            level = logging.getLevelName(log.getEffectiveLevel())
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "vgpud.metrics.exporter", "--conn-fd", str(theirs.fileno()),
                 "--daemon-pid", str(os.getpid()), "--timeout", str(timeout),
                 "--log-level", level],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                env={k: v for k, v in os.environ.items() if k not in _DAEMON_ONLY})
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.pid = self._proc.pid
        try:
            super().__init__(ours, listener, lost)
            self._pidfd = os.pidfd_open(self.pid)
        except OSError:
            ours.close()
            self._proc.kill()
            self._proc.wait()
            raise
        self._loop.add_reader(self._pidfd, self._on_exit)

    def _reap(self) -> int:
        """Its exit status (it has exited); the pidfd closed."""
        os.close(self._pidfd)
        return self._proc.wait()

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        self._ended(f"exporter (pid {self.pid}) exited with status {self._reap()}")

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT; reaped when it returns."""
        self._loop.remove_reader(self._pidfd)
        if self._proc.poll() is None:
            self._proc.terminate()
            deadline = time.monotonic() + STOP_TIMEOUT
            while self._proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if self._proc.poll() is None:
                self._proc.kill()
        self._close()
        self._reap()


class _Remote(_Link):
    """vgpud-metrics (its own unit, socket-activated) on ``path``: connected
    once; it never writes, so our end turns readable only when it is gone."""

    def __init__(self, listener: socket.socket, path: Path, lost: Lost) -> None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Never waits: a unix socket is connected at once or refuses
            # (EAGAIN when its backlog is full), and the loop serves upcalls.
            conn.setblocking(False)
            conn.connect(str(path))
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            super().__init__(conn, listener, lost)
        except BaseException:
            conn.close()
            raise
        self._path = path
        self._loop.add_reader(conn, self._on_readable)

    def _on_readable(self) -> None:
        self._loop.remove_reader(self._conn)
        self._ended(f"vgpud-metrics at {self._path} closed the connection")

    async def stop(self) -> None:
        """Closing is its end of stream: it exits."""
        self._loop.remove_reader(self._conn)
        self._close()


def _url_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
