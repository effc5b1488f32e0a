"""The metrics exporter as its own socket-activated service (vgpud-metrics):
systemd's own systemd-socket-activate --accept plays vgpud-metrics.socket,
starting one real exporter per connection with it at fd 3. The daemon's side
connects, sends the port it bound and its snapshots, reconnects when the
exporter is gone; the exporter refuses a peer that is not root and a first
message that is not the daemon's."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.aio import until
from tests.unit.test_metrics_service import Figures, get, module_counters, values
from vgpud.metrics.service import MetricsService
from vgpud.metrics.wire import HELLO, encode, frame

pytestmark = pytest.mark.skipif(shutil.which("systemd-socket-activate") is None,
                                reason="systemd-socket-activate not installed (package systemd)")

NOBODY = 65534


class Activator:
    """systemd-socket-activate --accept on ``path``, running vgpud-metrics."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc = subprocess.Popen(
            ["systemd-socket-activate", "--accept", "-l", str(path), "--",
             sys.executable, "-m", "vgpud.metrics.exporter", "--timeout", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not path.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "not listening"
            time.sleep(0.01)

    def exporters(self) -> list[int]:
        """The exporters it started that still run."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in children.read_text().split()]

    def stop(self) -> str:
        """Its stderr (the exporters' logs)."""
        self.proc.terminate()
        return self.proc.communicate(timeout=30)[1]


@pytest.fixture
def activator(tmp_path: Path) -> Iterator[Activator]:
    a = Activator(tmp_path / "metrics.sock")
    yield a
    if a.proc.poll() is None:
        a.stop()


def test_served_by_the_socket_activated_exporter(activator: Activator) -> None:
    """The daemon's side connects once; the exporter systemd started serves
    the port the daemon bound, with its snapshots; stop() ends it."""
    figures = Figures()

    async def main() -> None:
        metrics = MetricsService("127.0.0.1", 0, figures, module_counters, interval=3600,
                                 helper=activator.path)
        assert metrics.start()
        assert metrics.address is not None
        url = f"http://127.0.0.1:{metrics.address[1]}/metrics"
        try:
            await until("an exporter", lambda: len(activator.exporters()) == 1)
            (pid,) = activator.exporters()
            await asyncio.sleep(0)  # the refresh task's first round
            assert values((await asyncio.to_thread(get, url))[1],
                          "vgpud_memory_used_bytes") == {"t": 0}
            figures.used = 8192
            await metrics.refresh()
            status, body = await asyncio.to_thread(get, url)
            assert status == 200 and values(body, "vgpud_memory_used_bytes") == {"t": 8192}
        finally:
            await metrics.stop()
        await until("its exit at end of stream", lambda: pid not in activator.exporters())

    asyncio.run(asyncio.wait_for(main(), 60))
    assert "ERROR" not in activator.stop()


def test_a_lost_exporter_is_connected_again(activator: Activator,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """SIGKILL to the exporter: the daemon's end turns readable, it says so
    and connects again after the back-off; scrapes waiting in the backlog of
    the port it kept are served by the next exporter."""
    figures = Figures()
    caplog.set_level(logging.WARNING, "vgpud.metrics")

    async def main() -> None:
        metrics = MetricsService("127.0.0.1", 0, figures, module_counters, interval=3600,
                                 helper=activator.path, restart_delay=0.2)
        assert metrics.start() and metrics.address is not None
        url = f"http://127.0.0.1:{metrics.address[1]}/metrics"
        try:
            await until("an exporter", lambda: len(activator.exporters()) == 1)
            (first,) = activator.exporters()
            os.kill(first, signal.SIGKILL)
            await until("the loss seen", lambda: metrics.exporter is None)
            figures.used = 4096
            await metrics.refresh()  # kept for the next one
            status, body = await asyncio.to_thread(get, url)  # waits in the backlog
            assert status == 200 and values(body, "vgpud_memory_used_bytes") == {"t": 4096}
            assert activator.exporters() != [first]
        finally:
            await metrics.stop()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert f"vgpud-metrics at {activator.path} closed the connection: restarting in 0.2 s" \
        in caplog.text


def test_an_unreachable_helper_is_logged_and_tried_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No socket yet (vgpud-metrics.socket not started): a log line, the
    upcalls go on, and the daemon connects once the socket is there."""
    path = tmp_path / "metrics.sock"
    figures = Figures()

    async def main() -> Activator:
        metrics = MetricsService("127.0.0.1", 0, figures, module_counters, interval=3600,
                                 helper=path, restart_delay=0.2)
        assert metrics.start() and metrics.address is not None
        try:
            assert metrics.exporter is None
            activator = Activator(path)
            await until("a connection", lambda: metrics.exporter is not None)
            status, body = await asyncio.to_thread(
                get, f"http://127.0.0.1:{metrics.address[1]}/metrics")
            assert status == 200 and values(body, "vgpud_memory_used_bytes") == {"t": 0}
        finally:
            await metrics.stop()
        return activator

    activator = asyncio.run(asyncio.wait_for(main(), 60))
    activator.stop()
    assert f"metrics: cannot start vgpud-metrics at {path}" in caplog.text


def send_first(conn: socket.socket, kind: str) -> None:
    """What a client other than the daemon might send first."""
    if kind == "no descriptor":
        conn.sendall(HELLO)
    elif kind == "the old hello":  # one byte b"L", then a frame
        socket.send_fds(conn, [b"L" + frame(b"x")], [conn.fileno()])
    elif kind == "a frame":
        conn.sendall(frame(b"x"))
    else:
        family, sock_type = ((socket.AF_INET, socket.SOCK_DGRAM) if kind == "udp"
                             else (socket.AF_UNIX, socket.SOCK_STREAM))
        with socket.socket(family, sock_type) as other:
            if kind == "unix listener":
                other.bind(f"\0vgpud-test-{os.getpid()}")
                other.listen()
            socket.send_fds(conn, [HELLO], [other.fileno()])


@pytest.mark.parametrize(("kind", "says"), [
    ("no descriptor", "expected HELLO with one descriptor, got 0"),
    ("a frame", "expected HELLO with one descriptor: not a JSON body"),
    ("the old hello", "expected HELLO with one descriptor: no frame header"),
    ("udp", "the descriptor is no listening TCP socket"),
    ("unix listener", "the descriptor is no listening TCP socket"),
])
def test_a_connection_that_starts_otherwise_is_refused(kind: str, says: str) -> None:
    ours, theirs = socket.socketpair()
    with ours:
        proc = subprocess.Popen([sys.executable, "-m", "vgpud.metrics.exporter",
                                 "--conn-fd", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), stderr=subprocess.PIPE, text=True)
        theirs.close()
        send_first(ours, kind)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and says in err, err


def test_a_peer_that_is_not_root_is_refused() -> None:
    """The socket's mode is the first guard (0600 in vgpud-metrics.socket);
    the exporter checks its peer's uid (SO_PEERCRED) again."""
    with tempfile.TemporaryDirectory() as where, socket.socket() as listener:
        os.chmod(where, 0o755)  # pytest's tmp_path is root's alone
        activator = Activator(Path(where) / "metrics.sock")
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = ("import socket, sys\n"
                  "c = socket.socket(socket.AF_UNIX)\n"
                  "c.connect(sys.argv[1])\n"
                  "socket.send_fds(c, [b'L'], [int(sys.argv[2])])\n"
                  "c.sendall(sys.stdin.buffer.read())\n"
                  "try:\n"
                  "    print(c.recv(1) == b'')\n"
                  "except ConnectionResetError:\n"
                  "    print(True)\n")
        os.chmod(activator.path, 0o666)
        try:
            done = subprocess.run(
                [sys.executable, "-c", client, str(activator.path), str(listener.fileno())],
                pass_fds=(listener.fileno(),), user=NOBODY,
                input=frame(encode(Figures()(None, None))), capture_output=True, timeout=60)
        finally:
            logs = activator.stop()
    assert done.returncode == 0 and done.stdout == b"True\n", done  # closed on it
    assert "metrics exporter: the peer is uid 65534, not root" in logs


def test_a_helper_that_does_not_accept_never_blocks_the_loop(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A socket whose backlog is full (a helper's socket nobody accepts on):
    start() returns at once, says why, and tries again later; the event loop,
    which serves upcalls, never waits on the connect."""
    path = tmp_path / "stuck.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stuck:
        stuck.bind(str(path))
        stuck.listen(0)
        queued = []
        while True:  # fill its backlog
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            queued.append(c)
            try:
                c.connect(str(path))
            except BlockingIOError:
                break

        async def main() -> None:
            metrics = MetricsService("127.0.0.1", 0, Figures(), module_counters,
                                     interval=3600, helper=path, restart_delay=0.2)
            t0 = time.monotonic()
            assert metrics.start()
            assert time.monotonic() - t0 < 1 and metrics.exporter is None
            await metrics.stop()

        try:
            asyncio.run(asyncio.wait_for(main(), 30))
        finally:
            for c in queued:
                c.close()
    assert f"metrics: cannot start vgpud-metrics at {path}" in caplog.text
    assert "Resource temporarily unavailable" in caplog.text
