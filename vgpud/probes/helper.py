"""vgpud-probes: loads the latency probes for a daemon without CAP_BPF.

The deciding daemon (vgpud.service) keeps CAP_NET_ADMIN alone; this helper
(vgpud-probes.service, socket-activated by vgpud-probes.socket) holds what
bcc needs, compiles and attaches ebpf/vgpu_latency.bpf.c for each connection
and answers that connection's requests (vgpud.probes.wire): LOAD, STALE,
REATTACH, READ, DELETE, DROPPED. A connection's probes are detached when it
closes (the vgpu module is then no longer pinned). The peer must be uid 0
(SO_PEERCRED). A malformed request is answered ERR and changes nothing (a
frame over REQUEST_MAX is read and dropped, so the stream stays in step; a
header that is not vgpud.wire's is answered, then the connection closed); no
request ends the helper. Under systemd it exits once no connection has been
open for ``--idle-exit`` seconds; systemd starts it again on the next
connection. ``--listen PATH`` serves a socket itself (tests, systems without
systemd).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import click

from vgpud.host.systemd import listen_unix, passed_socket, peer_uid
from vgpud.probes.bcc_probes import (
    LatencyProbes,
    Probes,
    ProbesUnavailable,
    find_source,
    unavailable_reason,
)
from vgpud.probes.histograms import CountKey
from vgpud.probes.wire import (
    REPLY_MAX,
    REQUEST_MAX,
    Op,
    Reply,
    Status,
    WireError,
    decode_request,
    encode_reply,
)
from vgpud.wire import HEADER_SIZE, Oversized, body_length, frame

__all__ = ["Session", "main", "serve", "serve_connection"]

log = logging.getLogger("vgpud-probes")

MAX_CONNECTIONS = 4  # one per daemon; more only while one restarts
BODY_TIMEOUT_S = 30.0  # for the rest of a frame once its header came


class Session:
    """One connection's probes: loaded by its first LOAD, closed with it."""

    def __init__(self, make: Callable[[Path], Probes] = LatencyProbes,
                 reason: Callable[[], str | None] = unavailable_reason,
                 source: Callable[[], Path] = find_source) -> None:
        self._make = make
        self._reason = reason
        self._source = source
        self.probes: Probes | None = None

    def answer(self, body: bytes) -> bytes:
        """The reply body to one request body. Never raises."""
        try:
            req = decode_request(body)
        except WireError as exc:
            log.error("malformed request: %s", exc)
            return encode_reply(Op.LOAD, Reply(Status.ERR, text=f"malformed request: {exc}"))
        try:
            reply = self._do(req.op, req.keys)
        except ProbesUnavailable as exc:
            reply = Reply(Status.OFF, text=str(exc))
        except Exception as exc:  # bcc raises bare Exceptions; the helper lives on
            log.exception("%s failed", req.op.name)
            reply = Reply(Status.ERR, text=f"{req.op.name} failed: {exc}")
        try:
            return encode_reply(req.op, reply)
        except WireError as exc:  # what the probes returned does not fit a reply
            log.error("%s: %s", req.op.name, exc)
            return encode_reply(req.op, Reply(Status.ERR, text=f"{req.op.name}: {exc}"))

    def _do(self, op: Op, keys: tuple[CountKey, ...]) -> Reply:
        if op is Op.LOAD:
            return Reply(Status.OK, (True, self._load()))
        probes = self.probes
        if probes is None:
            return Reply(Status.ERR, text=f"{op.name} before LOAD")
        match op:
            case Op.STALE:
                return Reply(Status.OK, probes.stale())
            case Op.REATTACH:
                ok = probes.reattach()
                return Reply(Status.OK, (ok, list(probes.attach_points) if ok else []))
            case Op.READ:
                return Reply(Status.OK, {k: list(v) for k, v in probes.read().items()})
            case Op.DELETE:
                probes.delete(keys)
                return Reply(Status.OK)
            case _:
                return Reply(Status.OK, probes.dropped())

    def _load(self) -> list[str]:
        if self.probes is not None:
            return list(self.probes.attach_points)
        why = self._reason()
        if why is not None:
            raise ProbesUnavailable(why)
        probes = self._make(self._source())
        try:
            points = probes.load()
        except ProbesUnavailable:
            probes.close()
            raise
        self.probes = probes
        log.info("attached: %s", ", ".join(points))
        return points

    def close(self) -> None:
        if self.probes is not None:
            self.probes.close()
            self.probes = None
            log.info("detached")


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None at end of stream."""
    chunks, got = [], 0
    while got < n:
        chunk = conn.recv(min(n - got, 1 << 16))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _discard(conn: socket.socket, n: int) -> bool:
    """Read and drop ``n`` bytes (an oversized frame); False at end of stream."""
    while n:
        chunk = conn.recv(min(n, 1 << 16))
        if not chunk:
            return False
        n -= len(chunk)
    return True


REFUSE_DRAIN_S = 1.0


def _refuse(conn: socket.socket, why: str) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(frame(encode_reply(Op.LOAD, Reply(Status.ERR, text=why)), REPLY_MAX))


def _turn_away(conn: socket.socket, why: str) -> None:
    """Answer ERR, then read what the peer sent (for at most REFUSE_DRAIN_S)
    before the caller closes: closing a Unix socket with its request unread
    resets the peer, whose reply may then be lost (ECONNRESET, no reason)."""
    _refuse(conn, why)
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + REFUSE_DRAIN_S
        while (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            if not conn.recv(4096):
                break


def serve_connection(conn: socket.socket, session: Session) -> None:
    """Answer requests until the peer closes; then detach its probes."""
    try:
        uid = peer_uid(conn)
        if uid != 0:
            log.error("refused a connection from uid %d", uid)
            _turn_away(conn, f"uid {uid} is not root")
            return
        while True:
            conn.settimeout(None)  # the daemon asks every probes.interval_ms
            header = _recv_exact(conn, HEADER_SIZE)
            if header is None:
                return
            conn.settimeout(BODY_TIMEOUT_S)
            try:
                n = body_length(header, REQUEST_MAX)
            except Oversized as exc:  # ours, but too long: dropped, in step
                log.error("malformed request: %s", exc)
                if not _discard(conn, exc.length):
                    return
                _refuse(conn, f"malformed request: {exc}")
                continue
            except WireError as exc:  # not a frame of ours: out of step
                log.error("malformed request: %s; closing the connection", exc)
                _turn_away(conn, f"malformed request: {exc}")
                return
            body = _recv_exact(conn, n)
            if body is None:
                return
            conn.sendall(frame(session.answer(body), REPLY_MAX))
    except OSError as exc:
        log.warning("connection ended: %s", exc)
    finally:
        session.close()
        conn.close()


def serve(server: socket.socket, make_session: Callable[[], Session] = Session,
          idle_exit: float | None = None) -> None:
    """Accept connections, each on a thread, at most MAX_CONNECTIONS at once;
    return once none has been open for ``idle_exit`` seconds (None: never),
    or once ``server`` is closed."""
    active: set[threading.Thread] = set()
    lock = threading.Lock()
    last = time.monotonic()
    server.settimeout(1.0)

    def run(conn: socket.socket) -> None:
        nonlocal last
        try:
            serve_connection(conn, make_session())
        finally:
            with lock:
                active.discard(threading.current_thread())
                last = time.monotonic()

    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            with lock:
                if idle_exit is not None and not active and time.monotonic() - last > idle_exit:
                    return
            continue
        except OSError:
            if server.fileno() == -1:
                return
            raise
        with lock:
            if len(active) >= MAX_CONNECTIONS:
                _refuse(conn, f"{MAX_CONNECTIONS} connections are open already")
                conn.close()
                continue
            thread = threading.Thread(target=run, args=(conn,), daemon=True,
                                      name="probes connection")
            active.add(thread)
        thread.start()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--listen", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Serve this socket (mode 0600) until killed, instead of the "
              "listening socket systemd passes (fd 3).")
@click.option("--idle-exit", type=click.FloatRange(min=1), default=30.0, show_default=True,
              help="Under systemd: exit once no connection has been open this long.")
def main(listen: Path | None, idle_exit: float) -> None:
    """Load vgpud's latency probes (eBPF) for the daemon (a privileged helper)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(name)s: %(levelname)s %(message)s")
    if listen is None:
        try:
            passed = passed_socket("socket")
        except LookupError as exc:
            raise click.UsageError(str(exc)) from None
        with passed:
            serve(passed, idle_exit=idle_exit)
        return
    with listen_unix(str(listen)) as server:
        serve(server)
