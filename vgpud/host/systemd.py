"""systemd's service protocol: sd_notify(3) states and the watchdog interval."""

from __future__ import annotations

import logging
import os
import socket

__all__ = ["Notifier", "watchdog_interval"]

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
