"""RemoteProbes: LatencyProbes' surface over the vgpud-probes helper's socket.

Chosen by ``[probes] helper`` (or ``vgpud --probes-helper``): the daemon then
needs no CAP_BPF or CAP_PERFMON. One connection per load; the helper
detaches the probes when it closes. Blocking, like LatencyProbes (ProbeService
calls it in worker threads); a lock keeps one request in flight. When the
connection is lost (the helper was restarted or killed) ``stale`` says so and
``reattach`` connects and loads again: the helper's new map starts from zero
(``maps_made`` counts up), so ProbeService keeps what the live contexts had
counted in the old one (LatencyBook.new_map) and adds the new map's counts.
What they counted between the old map's last read and its loss is lost.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from vgpud.probes.bcc_probes import ProbesUnavailable
from vgpud.probes.histograms import CountKey
from vgpud.probes.wire import (
    DELETE_MAX,
    REPLY_MAX,
    REQUEST_MAX,
    Op,
    Reply,
    Request,
    Status,
    WireError,
    decode_reply,
    encode_request,
)
from vgpud.wire import frame, read_frame

__all__ = ["RemoteProbes", "helper_reason"]

CONNECT_TIMEOUT_S = 5.0
# A LOAD compiles (seconds; 15-20 s in a TCG guest, more when loaded).
LOAD_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 60.0
# A stop waits this long for the helper to detach (vgpud.service's
# TimeoutStopSec is 15 s for the whole stop).
CLOSE_WAIT_S = 5.0


class HelperError(Exception):
    """The helper refused a request (ERR), or the connection broke."""


def helper_reason(path: Path) -> str | None:
    """Why the helper cannot be asked (None: try it)."""
    if not path.is_socket():
        return (f"no probe helper listening at {path} "
                "(systemctl enable --now vgpud-probes.socket)")
    return None


class RemoteProbes:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.attach_points: list[str] = []
        self.maps_made = 0
        self.waiting = "waiting for the vgpu tracepoints (module unloaded)"
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(str(self.path))
        except OSError as exc:
            sock.close()
            raise ProbesUnavailable(f"cannot reach the probe helper at {self.path}: "
                                    f"{exc.strerror or exc}") from exc
        return sock

    def _call(self, req: Request, timeout: float = CALL_TIMEOUT_S) -> Reply:
        """One request and its reply; HelperError on ERR or a broken connection
        (which is then dropped: ``stale`` turns True)."""
        with self._lock:
            sock = self._sock
            if sock is None:
                raise HelperError(f"not connected to the probe helper at {self.path}")
            try:
                sock.settimeout(timeout)
                sock.sendall(frame(encode_request(req), REQUEST_MAX))
                body = read_frame(sock.recv, REPLY_MAX)
                if body is None:
                    raise ConnectionResetError("the probe helper closed the connection")
                reply = decode_reply(req.op, body)
            except (OSError, WireError) as exc:
                self._drop()
                raise HelperError(f"the probe helper at {self.path}: {exc}") from exc
        if reply.status is Status.OFF:
            raise ProbesUnavailable(f"{reply.text} (probe helper)")
        if reply.status is Status.ERR:
            raise HelperError(f"the probe helper refused {req.op.name}: {reply.text}")
        return reply

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def load(self) -> list[str]:
        sock = self._connect()
        with self._lock:
            self._drop()
            self._sock = sock
        try:
            _, points = _points(self._call(Request(Op.LOAD), LOAD_TIMEOUT_S))
        except (HelperError, ProbesUnavailable) as exc:
            with self._lock:
                self._drop()
            raise ProbesUnavailable(str(exc)) from exc
        self.attach_points = list(points)
        self.maps_made += 1
        return self.attach_points

    def stale(self) -> bool:
        if self._sock is None:
            return True
        try:
            return bool(self._call(Request(Op.STALE)).value)
        except HelperError:
            return True

    def reattach(self) -> bool:
        if self._sock is None:
            try:
                self.load()
            except ProbesUnavailable as exc:
                self.waiting = f"the probe helper was lost: {exc}"
                return False
            return True
        self.waiting = "waiting for the vgpu tracepoints (module unloaded)"
        try:
            ok, points = _points(self._call(Request(Op.REATTACH)))
        except (HelperError, ProbesUnavailable) as exc:
            self.waiting = f"the probe helper failed to attach again: {exc}"
            return False
        if ok:
            self.attach_points = points
        return ok

    def read(self) -> Mapping[CountKey, Sequence[int]]:
        value = self._call(Request(Op.READ)).value
        if not isinstance(value, dict):
            raise HelperError(f"READ answered {value!r:.80}")
        return value

    def delete(self, keys: Iterable[CountKey]) -> None:
        todo = list(keys)
        for i in range(0, len(todo), DELETE_MAX):
            self._call(Request(Op.DELETE, tuple(todo[i:i + DELETE_MAX])))

    def dropped(self) -> int:
        value = self._call(Request(Op.DROPPED)).value
        if not isinstance(value, int):
            raise HelperError(f"DROPPED answered {value!r:.80}")
        return value

    def close(self) -> None:
        """Disconnect. With no request in flight, wait up to CLOSE_WAIT_S for the
        helper to detach (it closes its end once it has), so that when a
        daemon's stop returns its probes no longer pin the vgpu module; a
        request in flight (a LOAD that never ends) fails at once instead."""
        if self._lock.acquire(blocking=False):
            try:
                if self._sock is not None:
                    _wait_detached(self._sock)
                self._drop()
            finally:
                self._lock.release()
            return
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._drop()


def _wait_detached(sock: socket.socket) -> None:
    """Send end of stream; wait (up to CLOSE_WAIT_S) for the helper's."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + CLOSE_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                return


def _points(reply: Reply) -> tuple[bool, list[str]]:
    if not isinstance(reply.value, tuple):
        raise HelperError(f"no attach points in {reply.value!r:.80}")
    return reply.value

