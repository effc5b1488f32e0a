"""The metrics exporter: the process that renders and serves the text format.

``vgpud-metrics [options]``: one connection from the daemon, the one
systemd passes (vgpud-metrics.socket, Accept=yes: fd 3), whose peer must be
root; or ``--conn-fd N --daemon-pid P``, a child of the daemon on a
socketpair (vgpud.metrics.service). The daemon sends the listening socket
it bound first (vgpud.metrics.wire.HELLO with SCM_RIGHTS), then snapshots.
One thread: it takes the connection's frames first, then answers one
request at a time (``--timeout`` bounds a client that sends nothing),
rendering a snapshot the first time it is scraped and serving the same
bytes until the next. A frame that does not decode is logged and dropped;
the last good snapshot stays. It exits at the connection's end of stream (a
child also with the daemon: PR_SET_PDEATHSIG). It makes no socket of its
own. Requests wait in the listen backlog until the first snapshot.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import selectors
import signal
import socket
import socketserver
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

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


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "only /metrics here")
            return
        body = self.server.exporter.render()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("metrics: %s " + format, self.address_string(), *args)


class _Server(HTTPServer):
    """One request at a time, on a socket bound (and listening) by the daemon.
    socketserver's own __init__ is skipped: it would make a socket (refused
    in vgpud-metrics@.service, whose only address family is AF_UNIX)."""

    def __init__(self, listener: socket.socket, exporter: Exporter, timeout: float) -> None:
        self.exporter = exporter
        handler = type("Handler", (_Handler,), {"timeout": timeout})
        socketserver.BaseServer.__init__(self, listener.getsockname(), handler)
        self.socket = listener


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
    server = _Server(listener, exporter, timeout)
    listener.setblocking(False)  # accept is polled: a connection gone meanwhile is no hang
    os.set_blocking(conn_fd, False)
    with selectors.DefaultSelector() as sel:
        sel.register(conn_fd, selectors.EVENT_READ)
        while True:
            if exporter.snapshot is not None and listener.fileno() not in sel.get_map():
                sel.register(listener, selectors.EVENT_READ)
            ready = {key.fd for key, _ in sel.select()}
            while True:  # frames first: a scrape after a refresh sees its snapshot
                try:
                    data = os.read(conn_fd, _READ_SIZE)
                except BlockingIOError:
                    break
                if not data:
                    return
                exporter.feed(data)
            if listener.fileno() in ready and exporter.snapshot is not None:
                server.handle_request()  # select(0) on the non-blocking listener, then one


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
                    help="seconds a client may take to send its request (default %(default)s)")
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
