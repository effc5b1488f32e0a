"""Mounting without CAP_SYS_ADMIN: the daemon's side of vgpud-fsmount, and
the libc calls both sides use.

The daemon opens /dev/fuse itself (mode 0666: no privilege needed), sends
the descriptor over /run/vgpud-fsmount.sock (SCM_RIGHTS) with the one-line
request ``mount``, and serves libfuse on ``/dev/fd/N`` once the helper
answered ``OK`` (libfuse >= 3.3 takes an already-mounted descriptor so).
``umount`` asks it to detach the view when the daemon stops.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import os
import socket
from pathlib import Path

__all__ = ["HELPER_SOCKET", "HelperError", "has_cap_sys_admin", "mount", "open_fuse_device",
           "request", "umount_detach"]

HELPER_SOCKET = Path("/run/vgpud-fsmount.sock")
CAP_SYS_ADMIN = 21
MNT_DETACH = 2
REPLY_MAX = 512

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class HelperError(Exception):
    """vgpud-fsmount is unreachable or refused the request."""


def has_cap_sys_admin(status: Path = Path("/proc/self/status")) -> bool:
    """Whether this process may mount (CAP_SYS_ADMIN in its effective set)."""
    for line in status.read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    return False


def mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags),
                   data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def umount_detach(target: str) -> bool:
    """Lazily unmount ``target``; False when nothing is mounted there."""
    if _libc.umount2(target.encode(), MNT_DETACH) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 2):  # EINVAL: not a mount point; ENOENT: no such path
        return False
    raise OSError(err, f"umount {target}: {os.strerror(err)}")


# The helper is a Python process started per request: milliseconds on a
# host, tens of seconds in a loaded emulated guest. Its unit allows longer.
HELPER_TIMEOUT = 60.0


def open_fuse_device() -> int:
    return os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)


def request(line: str, fd: int | None = None, path: Path = HELPER_SOCKET,
            timeout: float = HELPER_TIMEOUT) -> str:
    """Send ``line`` (and ``fd``) to vgpud-fsmount; its OK reply's text, or HelperError."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            fds = [] if fd is None else [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                          array.array("i", [fd]).tobytes())]
            sock.sendmsg([f"{line}\n".encode()], fds)
            reply = b""
            while not reply.endswith(b"\n") and len(reply) < REPLY_MAX:
                chunk = sock.recv(REPLY_MAX)
                if not chunk:
                    break
                reply += chunk
    except OSError as exc:
        raise HelperError(f"vgpud-fsmount at {path}: {exc}") from exc
    text = reply.decode(errors="replace").strip()
    if not text.startswith("OK"):
        raise HelperError(f"vgpud-fsmount: {text or 'no reply'}")
    return text[2:].strip()
