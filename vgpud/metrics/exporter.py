"""The metrics exporter: the process that renders and serves the text format.

``python -m vgpud.metrics.exporter LISTEN_FD PIPE_FD DAEMON_PID [options]``,
started by vgpud.metrics.service with the daemon's listening socket and the
read end of a pipe on which the daemon writes snapshots (vgpud.metrics.wire).
One thread: it takes the pipe's frames first, then answers one request at
a time (``--timeout`` bounds a client that sends nothing), rendering a
snapshot the first time it is scraped and serving the same bytes until the
next. A frame that does not decode is logged and dropped; the last good
snapshot stays. It exits when the daemon does: PR_SET_PDEATHSIG, and EOF on
the pipe. Requests wait in the listen backlog until the first snapshot.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import selectors
import signal
import socket
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from vgpud.metrics.families import families
from vgpud.metrics.snapshot import Snapshot
from vgpud.metrics.wire import FrameReader, WireError, decode

__all__ = ["Exporter", "main"]

log = logging.getLogger("vgpud.metrics.exporter")

_PR_SET_PDEATHSIG = 1
_READ_SIZE = 1 << 20


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
    """One request at a time, on a socket bound (and listening) by the daemon."""

    def __init__(self, listener: socket.socket, exporter: Exporter, timeout: float) -> None:
        self.address_family = listener.family
        self.exporter = exporter
        handler = type("Handler", (_Handler,), {"timeout": timeout})
        super().__init__(listener.getsockname(), handler, bind_and_activate=False)
        self.socket.close()
        self.socket = listener


def serve(listener: socket.socket, pipe_fd: int, timeout: float) -> None:
    """Until EOF on the pipe."""
    exporter = Exporter()
    server = _Server(listener, exporter, timeout)
    listener.setblocking(False)  # accept is polled: a connection gone meanwhile is no hang
    os.set_blocking(pipe_fd, False)
    with selectors.DefaultSelector() as sel:
        sel.register(pipe_fd, selectors.EVENT_READ)
        while True:
            if exporter.snapshot is not None and listener.fileno() not in sel.get_map():
                sel.register(listener, selectors.EVENT_READ)
            ready = {key.fd for key, _ in sel.select()}
            while True:  # the pipe first: a scrape after a refresh sees its snapshot
                try:
                    data = os.read(pipe_fd, _READ_SIZE)
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


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="vgpud.metrics.exporter", description=__doc__)
    ap.add_argument("listen_fd", type=int)
    ap.add_argument("pipe_fd", type=int)
    ap.add_argument("daemon_pid", type=int)
    ap.add_argument("--timeout", type=float, required=True,
                    help="seconds a client may take to send its request")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _die_with_parent()
    if os.getppid() != args.daemon_pid:  # the daemon died before prctl
        return 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the daemon's to act on
    serve(socket.socket(fileno=args.listen_fd), args.pipe_fd, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
