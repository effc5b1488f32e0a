"""systemd's service protocol: sd_notify(3) states, the watchdog interval, and
the sockets it passes to the helpers (and whose peer they check)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct

__all__ = ["SD_LISTEN_FDS_START", "Notifier", "listen_unix", "passed_socket", "peer_uid",
           "watchdog_interval"]

log = logging.getLogger("vgpud")


class Notifier:
    """sd_notify over a plain AF_UNIX datagram; a no-op without $NOTIFY_SOCKET."""

    def __init__(self, address: str | None) -> None:
        if address and address.startswith("@"):
            address = "\0" + address[1:]
        self._address = address or None

    @classmethod
    def from_env(cls) -> Notifier:
        return cls(os.environ.get("NOTIFY_SOCKET"))

    def send(self, *states: str) -> None:
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


SD_LISTEN_FDS_START = 3


def passed_socket(what: str) -> socket.socket:
    """The one socket systemd passed (sd_listen_fds(3): fd 3, $LISTEN_FDS=1
    for this pid); ``what`` names it in the error: "socket" or "connection"."""
    if os.environ.get("LISTEN_FDS") != "1" or os.environ.get("LISTEN_PID") != str(os.getpid()):
        raise LookupError(f"no {what} from systemd (LISTEN_FDS): use --listen")
    return socket.socket(fileno=SD_LISTEN_FDS_START)


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def listen_unix(path: str) -> socket.socket:
    """A stream socket listening at ``path``, mode 0600 (root's helpers)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        server.bind(path)
    except OSError:
        server.close()
        raise
    finally:
        os.umask(old)
    server.listen(8)
    return server
