"""Issue 34, item 8: a local tenant cannot hold the metrics port.

The exporter served one request at a time with a 5 s timeout per recv, so
one local client sending nothing, or a byte every few seconds, held every
scrape behind it. Here the tenant (an unprivileged uid) keeps more
connections open than the exporter keeps (MAX_CLIENTS), half of them silent
and half trickling a header a byte at a time, reconnecting whatever is cut;
meanwhile root scrapes, as Prometheus would, and every scrape must be
answered with the daemon's figures.
"""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hostile import ONE_TENANT, spawn_tenant, start_daemon
from tests.support.vgpud_proc import Daemon
from vgpud.metrics.exporter import MAX_CLIENTS

pytestmark = pytest.mark.vm

SCRAPES = 10
HOLDERS = MAX_CLIENTS + 36

HOLDER = r"""
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
def connect():
    s = socket.create_connection(("127.0.0.1", port))
    s.setblocking(False)
    return s
conns = [connect() for _ in range(n)]
print("ready", flush=True)
while True:
    for i, s in enumerate(conns):
        try:
            if i % 2:
                s.send(b"X")  # a header that never ends
            elif s.recv(1) == b"":
                raise ConnectionError
        except BlockingIOError:
            pass
        except OSError:
            s.close()
            conns[i] = connect()
    time.sleep(0.2)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def metrics_daemon(vgpu: Path, daemon_factory, tmp_path: Path) -> Iterator[tuple[Daemon, int]]:
    port = free_port()
    tenants = f'[metrics]\nenabled = true\nlisten = "127.0.0.1:{port}"\n\n{ONE_TENANT}'
    d = start_daemon(daemon_factory, tmp_path, tenants)
    yield d, port
    print(d.log())


def scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        assert reply.status == 200
        return bytes(reply.read())


def test_a_tenant_holding_connections_delays_no_scrape(
        metrics_daemon: tuple[Daemon, int]) -> None:
    _, port = metrics_daemon
    assert b"vgpud_memory_limit_bytes" in scrape(port)
    holder = spawn_tenant(HOLDER.replace("sys.argv[1]", str(port))
                          .replace("sys.argv[2]", str(HOLDERS)))
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "ready", holder.stderr
        for _ in range(SCRAPES):
            assert b"vgpud_memory_limit_bytes" in scrape(port)
        assert holder.poll() is None, holder.communicate()[1]  # it held on throughout
    finally:
        holder.kill()
        holder.communicate()
    assert b"vgpud_memory_limit_bytes" in scrape(port)
