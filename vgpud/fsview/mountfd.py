"""Mounting without CAP_SYS_ADMIN: the daemon's side of vgpud-fsmount, the
libc calls both sides use, and their messages.

The daemon opens /dev/fuse itself (mode 0666: no privilege needed), sends
the descriptor over /run/vgpud-fsmount.sock (SCM_RIGHTS, in the sendmsg of
the request's frame) with the request ``mount``, and serves libfuse on
``/dev/fd/N`` once the helper answered OK (libfuse >= 3.3 takes an
already-mounted descriptor so). ``umount`` asks it to detach the view when
the daemon stops. One request per connection, in vgpud.wire's frames: the
request ``{"op": "mount" | "umount"}`` (at most REQUEST_MAX bytes), the
reply ``{"status": "ok", "mountpoint": PATH}`` or ``{"status": "err",
"text": WHY}`` (at most REPLY_MAX).
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import os
import socket
from pathlib import Path

from vgpud.wire import WireError, as_object, as_str, decode, encode, frame, read_frame

__all__ = ["HELPER_SOCKET", "REPLY_MAX", "REQUEST_MAX", "HelperError", "decode_reply",
           "encode_reply", "has_cap_sys_admin", "mount", "open_fuse_device", "request",
           "umount_detach"]

HELPER_SOCKET = Path("/run/vgpud-fsmount.sock")
CAP_SYS_ADMIN = 21
MNT_DETACH = 2
REQUEST_MAX = 64
REPLY_MAX = 32 << 10  # a mountpoint of PATH_MAX, escaped (6 bytes a byte at most)
TEXT_MAX = 1024  # characters of a refusal's reason (longer is cut)

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


def request(op: str, fd: int | None = None, path: Path = HELPER_SOCKET,
            timeout: float = HELPER_TIMEOUT) -> str:
    """Ask vgpud-fsmount ``op`` (with ``fd``); the mountpoint it answered, or HelperError."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            fds = [] if fd is None else [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                          array.array("i", [fd]).tobytes())]
            sock.sendmsg([frame(encode({"op": op}), REQUEST_MAX)], fds)
            body = read_frame(sock.recv, REPLY_MAX)
    except (OSError, WireError) as exc:
        raise HelperError(f"vgpud-fsmount at {path}: {exc}") from exc
    if body is None:
        raise HelperError("vgpud-fsmount: no reply")
    try:
        ok, text = decode_reply(body)
    except WireError as exc:
        raise HelperError(f"vgpud-fsmount: a malformed reply ({exc})") from None
    if not ok:
        raise HelperError(f"vgpud-fsmount: ERR {text}")
    return text


def encode_reply(ok: bool, text: str) -> bytes:
    """A reply body: OK with the mountpoint, or ERR with why."""
    if ok:
        return encode({"status": "ok", "mountpoint": text})
    return encode({"status": "err", "text": text[:TEXT_MAX]})


def decode_reply(body: bytes) -> tuple[bool, str]:
    """(OK?, the mountpoint or why); WireError for anything else."""
    top = as_object(decode(body), "reply", ("status",), optional=("mountpoint", "text"))
    status = as_str(top["status"], "status")
    if status == "ok":
        return True, as_str(as_object(top, "OK", ("status", "mountpoint"))["mountpoint"],
                            "mountpoint")
    if status == "err":
        return False, as_str(as_object(top, "ERR", ("status", "text"))["text"], "reason",
                             TEXT_MAX)
    raise WireError(f"unknown status {status[:32]!r}")
