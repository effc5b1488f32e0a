"""vgpud-fsmount: mounts the file view for a daemon without CAP_SYS_ADMIN.

One request per connection (systemd's vgpud-fsmount.socket, Accept=yes,
starts one vgpud-fsmount@.service per connection and passes it as fd 3;
``--listen PATH`` serves a socket itself, for tests and systems without
systemd). The peer must be uid 0 (SO_PEERCRED). Requests (frames of
vgpud.wire, their bodies in vgpud.fsview.mountfd):

- ``mount`` with a /dev/fuse descriptor (SCM_RIGHTS): lazily unmount what is
  at the config's [fs] mountpoint, then mount a FUSE file system there on
  that descriptor (nosuid, nodev, noexec, default_permissions, allow_other);
- ``umount``: lazily unmount it.

The mountpoint comes from the config file the helper reads itself, never
from the client. The reply is OK with the mountpoint, or ERR with why; a
request that is no frame, or no request, is answered ERR like any refusal,
acting on nothing, and the connection closed.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import sys
from pathlib import Path

import click

from vgpud.fsview.mountfd import REPLY_MAX, REQUEST_MAX, encode_reply, mount, umount_detach
from vgpud.host.systemd import listen_unix, passed_socket, peer_uid
from vgpud.store.config import DEFAULT_CONFIG_PATH, ConfigError, load_config
from vgpud.wire import WireError, as_object, as_str, decode, frame, read_frame

__all__ = ["main", "mount_data", "parse_request", "serve_connection"]

log = logging.getLogger("vgpud-fsmount")

MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
FUSE_MAJOR, FUSE_MINOR = 10, 229  # /dev/fuse
FDS_MAX = 4  # descriptors taken from one request (more are closed by the kernel)


class Refused(Exception):
    """A request that is answered ERR."""


def parse_request(body: bytes, fds: list[int]) -> str:
    """``mount`` (with exactly one descriptor) or ``umount`` (with none)."""
    try:
        op = as_str(as_object(decode(body), "request", ("op",))["op"], "op")
    except WireError as exc:
        raise Refused(f"malformed request: {exc}") from None
    if op == "mount" and len(fds) == 1:
        return op
    if op == "umount" and not fds:
        return op
    if op in ("mount", "umount"):
        raise Refused(f"{op} takes {'one descriptor' if op == 'mount' else 'none'}, "
                      f"not {len(fds)}")
    raise Refused(f"unknown request {op[:32]!r}")


def mount_data(fd: int) -> str:
    """The FUSE mount options for descriptor ``fd``: served as root, the
    kernel checks the modes, other users may look."""
    return f"fd={fd},rootmode=40000,user_id=0,group_id=0,default_permissions,allow_other"


def _receive(conn: socket.socket, fds: list[int]) -> bytes:
    """The request's body; the descriptors that came with it added to ``fds``."""

    def recv(n: int) -> bytes:
        data, got, _, _ = socket.recv_fds(conn, n, FDS_MAX, socket.MSG_CMSG_CLOEXEC)
        fds.extend(got)
        return data

    try:
        body = read_frame(recv, REQUEST_MAX)
    except WireError as exc:
        raise Refused(f"malformed request: {exc}") from None
    if body is None:
        raise Refused("no request")
    return body


def _is_fuse_device(fd: int) -> bool:
    st = os.fstat(fd)
    return stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (
        FUSE_MAJOR, FUSE_MINOR)


def _mountpoint(config_path: Path) -> Path:
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        raise Refused(str(exc)) from exc
    if not config.fs.enabled:
        raise Refused(f"the file view is off ([fs] enabled in {config_path})")
    return config.fs.mountpoint


def _handle(conn: socket.socket, config_path: Path) -> str:
    fds: list[int] = []
    try:
        body = _receive(conn, fds)
        uid = peer_uid(conn)
        if uid != 0:
            raise Refused(f"uid {uid} is not root")
        verb = parse_request(body, fds)
        where = _mountpoint(config_path)
        if verb == "umount":
            umount_detach(str(where))
            return str(where)
        if not _is_fuse_device(fds[0]):
            raise Refused("the descriptor is not /dev/fuse")
        # Detach first: the mount of a daemon that died answers ENOTCONN to
        # anything else, mkdir's existence check included.
        if umount_detach(str(where)):
            log.info("detached a stale mount at %s", where)
        where.mkdir(mode=0o755, parents=True, exist_ok=True)
        mount("vgpud", str(where), "fuse.vgpud", MS_NOSUID | MS_NODEV | MS_NOEXEC,
              mount_data(fds[0]))
        log.info("mounted the file view at %s", where)
        return str(where)
    finally:
        for fd in fds:
            os.close(fd)


def serve_connection(conn: socket.socket, config_path: Path) -> bool:
    """Answer one request; whether it succeeded."""
    try:
        text, ok = _handle(conn, config_path), True
    except (Refused, OSError) as exc:
        log.error("refused: %s", exc)
        text, ok = str(exc), False
    try:
        try:
            reply = frame(encode_reply(ok, text), REPLY_MAX)
        except WireError as exc:  # a mountpoint too long to say
            reply = frame(encode_reply(False, f"mounted, but the reply: {exc}"), REPLY_MAX)
        conn.sendall(reply)
    except OSError as exc:
        log.warning("cannot reply: %s", exc)
    return ok


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              default=DEFAULT_CONFIG_PATH, show_default=True,
              help="The vgpud config whose [fs] mountpoint is mounted.")
@click.option("--listen", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Serve this socket (mode 0600) until killed, instead of the "
              "connection systemd passes (fd 3).")
def main(config_path: Path, listen: Path | None) -> None:
    """Mount the vgpud file view for the daemon (a privileged helper)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(name)s: %(levelname)s %(message)s")
    if listen is None:
        try:
            conn = passed_socket("connection")
        except LookupError as exc:
            raise click.UsageError(str(exc)) from None
        with conn:
            sys.exit(0 if serve_connection(conn, config_path) else 1)
    with listen_unix(str(listen)) as server:
        while True:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(10)
                serve_connection(conn, config_path)
