"""The metrics exporter: the process that renders and serves the text format.

``vgpud-metrics [options]``: one connection from the daemon, the one
systemd passes (vgpud-metrics.socket, Accept=yes: fd 3), whose peer must be
root; or ``--conn-fd N --daemon-pid P``, a child of the daemon on a
socketpair (vgpud.metrics.service). The daemon sends the listening socket
it bound first (vgpud.metrics.wire.HELLO with SCM_RIGHTS), then snapshots.
One thread, which never waits on a client: every socket is non-blocking in
one selector, and each round of the loop takes the connection's frames
first, then at most one new client. Each client connection gets
``--timeout`` seconds in all to send its request and take the answer (a
client that sends nothing, trickles or never reads is cut then, and holds
up no one meanwhile); at most MAX_CLIENTS are open at once, the oldest
closed for a new one, and a new one is answered at once if its request is
already there (as a scraper's is). http.server parses each request once it
is whole. A snapshot is rendered the first time it is scraped and the same
bytes are served until the next. A frame that does not decode is logged
and dropped; the last good snapshot stays. It exits at the connection's end
of stream (a child also with the daemon: PR_SET_PDEATHSIG). It makes no
socket of its own. Requests wait in the listen backlog until the first
snapshot.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import io
import logging
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from vgpud.host.systemd import passed_socket, peer_uid
from vgpud.metrics.families import families
from vgpud.metrics.listen import REQUEST_TIMEOUT
from vgpud.metrics.snapshot import Snapshot
from vgpud.metrics.wire import FrameReader, WireError, decode, decode_hello
from vgpud.wire import read_frame

__all__ = ["Exporter", "main"]

log = logging.getLogger("vgpud.metrics.exporter")

_PR_SET_PDEATHSIG = 1
_READ_SIZE = 1 << 20
HELLO_MAX = 64  # bytes of the first frame's body (HELLO's: 17)
NICE = 10  # below the daemon (0): see vgpud-metrics@.service
MAX_CLIENTS = 64  # client connections open at once
REQUEST_MAX = 16 << 10  # bytes of a request's line and headers


class Exporter:
    """The latest good snapshot, fed from the pipe, and its rendering."""

    def __init__(self) -> None:
        self.snapshot: Snapshot | None = None
        self._reader = FrameReader()
        self._rendered: tuple[Snapshot, bytes] | None = None

    def feed(self, data: bytes) -> None:
        """Bytes from the pipe: the newest whole frame that decodes becomes the
        snapshot; older ones (queued in the pipe while we served) are dropped."""
        skipped = self._reader.skipped
        for payload in reversed(self._reader.feed(data)):
            try:
                self.snapshot = decode(payload)
                break
            except WireError as exc:
                log.error("metrics exporter: dropped a malformed snapshot (%s)", exc)
        if self._reader.skipped != skipped:
            log.error("metrics exporter: skipped %d bytes that were no frame",
                      self._reader.skipped - skipped)

    def render(self) -> bytes:
        """The latest snapshot in the text format, rendered once per snapshot."""
        snapshot = self.snapshot
        assert snapshot is not None, "served before the first snapshot"
        rendered = self._rendered
        if rendered is None or rendered[0] is not snapshot:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Collector(snapshot))
            rendered = self._rendered = (snapshot, generate_latest(registry))
        return rendered[1]


class _Collector:
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        return families(self.snapshot)


class _Request(BaseHTTPRequestHandler):
    """http.server's parsing and answer for one whole request in memory:
    no socket, so nothing here can wait on the client."""

    def __init__(self, raw: bytes, peer: tuple[str, int], exporter: Exporter) -> None:
        # BaseRequestHandler's __init__ (which reads a socket) is skipped.
        self.exporter = exporter
        self.client_address = peer
        self.rfile = io.BytesIO(raw)
        self.answer = io.BytesIO()
        self.wfile = self.answer
        self.handle_one_request()

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "only /metrics here")
            return
        body = self.exporter.render()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("metrics: %s " + format, self.address_string(), *args)


class _Client:
    """One client connection: its request until the blank line, then the answer."""

    def __init__(self, sock: socket.socket, peer: tuple[str, int], deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.request = bytearray()
        self.answer: memoryview | None = None

    def step(self, exporter: Exporter) -> bool:
        """Reads or writes what the socket takes now; False when it is done."""
        try:
            if self.answer is None:
                data = self.sock.recv(4096)
                if not data:
                    return False
                self.request += data
                if b"\r\n\r\n" not in self.request and b"\n\n" not in self.request:
                    return len(self.request) <= REQUEST_MAX
                raw = bytes(self.request)
                self.answer = memoryview(_Request(raw, self.peer, exporter).answer.getvalue())
            sent = self.sock.send(self.answer)
            self.answer = self.answer[sent:]
            return len(self.answer) > 0
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False


class _Clients:
    """The open client connections in the selector, each until its deadline."""

    def __init__(self, sel: selectors.BaseSelector, exporter: Exporter, timeout: float) -> None:
        self._sel = sel
        self._exporter = exporter
        self._timeout = timeout
        self._open: dict[int, _Client] = {}

    def accept(self, listener: socket.socket) -> None:
        """One connection per round of the loop, so that the frames taken
        first in each round include any sent before the client connected."""
        try:
            sock, peer = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except ConnectionAbortedError:  # the peer gone first
            return
        except OSError as exc:  # EMFILE, ENFILE, ENOMEM: a client makes room
            log.warning("metrics exporter: accept: %s", exc)
            self._close_oldest()
            return
        if len(self._open) >= MAX_CLIENTS:
            self._close_oldest()
        sock.setblocking(False)
        self._open[sock.fileno()] = _Client(sock, peer[:2], time.monotonic() + self._timeout)
        self._sel.register(sock, selectors.EVENT_READ)
        # A scraper's request is there by now: it is answered before newer
        # connections can push it out.
        self.step(sock.fileno())

    def step(self, fd: int) -> None:
        client = self._open.get(fd)
        if client is None:
            return
        reading = client.answer is None
        if not client.step(self._exporter):
            self.close(client)
        elif reading and client.answer is not None:
            self._sel.modify(client.sock, selectors.EVENT_WRITE)

    def wait(self) -> float | None:
        """Seconds until the next deadline; None without clients."""
        if not self._open:
            return None
        return max(0.0, min(c.deadline for c in self._open.values()) - time.monotonic())

    def expire(self) -> None:
        now = time.monotonic()
        for client in [c for c in self._open.values() if c.deadline <= now]:
            log.debug("metrics: %s cut at its deadline", client.peer[0])
            self.close(client)

    def close(self, client: _Client) -> None:
        del self._open[client.sock.fileno()]
        self._sel.unregister(client.sock)
        client.sock.close()

    def _close_oldest(self) -> None:
        if self._open:
            self.close(min(self._open.values(), key=lambda c: c.deadline))

    def close_all(self) -> None:
        for client in list(self._open.values()):
            self.close(client)


class ProtocolError(Exception):
    """The connection did not start as the daemon's does."""


def receive_listener(conn: socket.socket) -> socket.socket:
    """The listening TCP socket the daemon sends first (HELLO, SCM_RIGHTS)."""
    fds: list[int] = []

    def recv(n: int) -> bytes:
        data, got, _, _ = socket.recv_fds(conn, n, 1, socket.MSG_CMSG_CLOEXEC)
        fds.extend(got)
        return data

    try:
        try:
            body = read_frame(recv, HELLO_MAX)
            if body is None:
                raise ProtocolError("the connection ended before its first frame")
            decode_hello(body)
        except WireError as exc:
            raise ProtocolError(f"expected HELLO with one descriptor: {exc}") from None
        if len(fds) != 1:
            raise ProtocolError(f"expected HELLO with one descriptor, got {len(fds)}")
    except ProtocolError:
        for fd in fds:
            os.close(fd)
        raise
    listener = socket.socket(fileno=fds[0])
    if (listener.type != socket.SOCK_STREAM
            or listener.family not in (socket.AF_INET, socket.AF_INET6)
            or not listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
        listener.close()
        raise ProtocolError("the descriptor is no listening TCP socket")
    return listener


def serve(listener: socket.socket, conn_fd: int, timeout: float) -> None:
    """Until end of stream on ``conn_fd``, the daemon's connection."""
    exporter = Exporter()
    listener.setblocking(False)  # accept is polled: a connection gone meanwhile is no hang
    os.set_blocking(conn_fd, False)
    with selectors.DefaultSelector() as sel:
        clients = _Clients(sel, exporter, timeout)
        sel.register(conn_fd, selectors.EVENT_READ)
        try:
            while True:
                if exporter.snapshot is not None and listener.fileno() not in sel.get_map():
                    sel.register(listener, selectors.EVENT_READ)
                ready = [key.fd for key, _ in sel.select(clients.wait())]
                if not _take_frames(conn_fd, exporter):
                    return
                for fd in ready:
                    if fd == listener.fileno():
                        clients.accept(listener)
                    elif fd != conn_fd:
                        clients.step(fd)
                clients.expire()
        finally:
            clients.close_all()


def _take_frames(conn_fd: int, exporter: Exporter) -> bool:
    """Everything the daemon's connection holds now (frames first: a scrape
    after a refresh sees its snapshot); False at its end of stream."""
    while True:
        try:
            data = os.read(conn_fd, _READ_SIZE)
        except BlockingIOError:
            return True
        if not data:
            return False
        exporter.feed(data)


def _die_with_parent() -> None:
    """SIGTERM when the thread that started us exits (the daemon's main thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("metrics exporter: prctl(PR_SET_PDEATHSIG): %s",
                    os.strerror(ctypes.get_errno()))


def _connection(conn_fd: int | None, daemon_pid: int | None) -> socket.socket | None:
    """The daemon's connection; None when the daemon is already gone."""
    if conn_fd is not None:
        # Scrapes yield to the daemon's upcalls on a busy CPU (as Nice= does
        # for vgpud-metrics@.service); refused under a filter of @resources.
        with contextlib.suppress(OSError):
            os.nice(NICE)
        if daemon_pid is not None:
            _die_with_parent()
            if os.getppid() != daemon_pid:  # the daemon died before prctl
                return None
        return socket.socket(fileno=conn_fd)
    conn = passed_socket("connection")
    if (uid := peer_uid(conn)) != 0:
        conn.close()
        raise ProtocolError(f"the peer is uid {uid}, not root")
    return conn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vgpud-metrics", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conn-fd", type=int, help="the daemon's connection (a child's socketpair "
                    "end), instead of the one systemd passes")
    ap.add_argument("--daemon-pid", type=int, help="exit with this parent (with --conn-fd)")
    ap.add_argument("--timeout", type=float, default=REQUEST_TIMEOUT,
                    help="seconds a client connection may last, its request and the answer "
                    "(default %(default)s)")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the daemon's to act on
    try:
        conn = _connection(args.conn_fd, args.daemon_pid)
        if conn is None:
            return 0
        with conn:
            listener = receive_listener(conn)
            serve(listener, conn.fileno(), args.timeout)
    except (LookupError, ProtocolError, OSError) as exc:
        log.error("metrics exporter: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
