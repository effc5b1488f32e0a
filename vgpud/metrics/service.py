"""The metrics adapter: a snapshot refreshed on the event loop, served over
HTTP from a thread of its own.

The loop does the cheap part: every ``interval`` it asks the module for
its counters (GET_STATS, the one await) and copies the daemon's figures
into a Snapshot (vgpud.metrics.snapshot), one attribute assignment the
server thread then reads. The thread formats a snapshot the first time it
is scraped and serves the same bytes until the next one, so a scraper
polling faster than the refresh costs the loop nothing but the GIL for a
write; while it renders, the loop gets the GIL back within SWITCH_INTERVAL.
The server answers one request at a time with a socket timeout: a
local user holding connections open delays scrapes, never upcalls, and
makes no threads. A port it cannot bind is a log line; the daemon serves
upcalls without metrics.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from socket import AF_INET6

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from vgpud.kernel.channel import ChannelError
from vgpud.kernel.codec import DecodeError
from vgpud.kernel.uapi import Stats, Stats4
from vgpud.metrics.families import families
from vgpud.metrics.snapshot import Snapshot

__all__ = ["MetricsService"]

log = logging.getLogger("vgpud.metrics")

REFRESH_INTERVAL = 1.0  # seconds between snapshots
REQUEST_TIMEOUT = 5.0  # seconds a client may take to send its request
# The longest the server thread keeps the GIL from the event loop while it
# renders (CPython's default is 5 ms: an upcall's worth, or more, in a slow guest).
SWITCH_INTERVAL = 0.001

Collect = Callable[[Stats | None, Stats4 | None], Snapshot]
GetCounters = Callable[[], Awaitable[tuple[Stats, Stats4 | None]]]


class MetricsService:
    """``collect`` makes a snapshot on the loop from the module's counters
    (None until GET_STATS answers); ``get_counters`` asks the module."""

    def __init__(self, host: str, port: int, collect: Collect, get_counters: GetCounters, *,
                 interval: float = REFRESH_INTERVAL) -> None:
        self.host, self.port = host, port
        self._collect = collect
        self._get_counters = get_counters
        self._interval = interval
        self._module: tuple[Stats | None, Stats4 | None] = (None, None)
        self.latest: Snapshot = collect(None, None)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._module_failing = False
        self._rendered: tuple[Snapshot, bytes] | None = None
        self._render_lock = threading.Lock()

    @property
    def address(self) -> tuple[str, int] | None:
        """Where it serves (the port bound), None when it does not."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> bool:
        """Bind and serve; False (logged) when the address cannot be bound."""
        try:
            server = _Server(self.host, self.port, self)
        except OSError as exc:
            log.error("metrics: cannot listen on %s port %d (%s): running without metrics",
                      self.host, self.port, exc.strerror or exc)
            return False
        self._server = server
        if sys.getswitchinterval() > SWITCH_INTERVAL:
            sys.setswitchinterval(SWITCH_INTERVAL)
        self._thread = threading.Thread(target=server.serve_forever, name="vgpud-metrics",
                                        daemon=True)
        self._thread.start()
        self._refresher = asyncio.create_task(self._refresh_loop())
        host, port = server.server_address[:2]
        log.info("metrics: serving http://%s/metrics", _url_host(str(host), int(port)))
        return True

    async def stop(self) -> None:
        refresher, self._refresher = self._refresher, None
        if refresher is not None:
            refresher.cancel()
            await asyncio.wait([refresher])
        server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(server.shutdown)
            server.server_close()
        self._thread = None

    async def refresh(self) -> None:
        """Ask the module for its counters, then take a snapshot."""
        try:
            self._module = await self._get_counters()
            self._module_failing = False
        except (ChannelError, DecodeError) as exc:
            if not self._module_failing:
                log.warning("metrics: module counters unavailable (%s): keeping the last", exc)
            self._module_failing = True
        self.latest = self._collect(*self._module)

    async def _refresh_loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._interval)

    def render(self) -> bytes:
        """The latest snapshot in the text format (in the server thread):
        rendered once, then the same bytes until the next snapshot."""
        snapshot = self.latest
        with self._render_lock:
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
    timeout = REQUEST_TIMEOUT

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "only /metrics here")
            return
        body = self.server.metrics.render()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("metrics: %s " + format, self.address_string(), *args)


class _Server(HTTPServer):
    """One request at a time (no thread per connection)."""

    def __init__(self, host: str, port: int, metrics: MetricsService) -> None:
        if ":" in host:
            self.address_family = AF_INET6
        self.metrics = metrics
        super().__init__((host, port), _Handler)


def _url_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
