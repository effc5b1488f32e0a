"""The mfusepy adapter: serves the latest Snapshot as files.

Layout: ``gpus``, ``tenants/<name>/<file>`` (vgpud.fsview.render). It runs
in one FUSE thread (single-threaded loop: concurrent writers are served one
after another) and touches nothing of the event loop's: reads render the
snapshot reference it finds at open(), whole, so a file read in several
read(2) calls is one consistent snapshot; writes go to ``submit``, which
hands them to the loop and waits.

Authorization: the kernel checks the modes (mounted default_permissions):
the writable files are root:<admin group> 0664, the rest 0444, the
directories 0555. Root passes any mode, so open() refuses writing a
read-only file; write() checks the caller again (``authorize``, the rule of
vgpud.admin.auth.is_admin) in case the modes and the group ever disagree.

Writes: each write(2) at offset 0 is one whole value (vgpud.fsview.values);
a write at another offset (the rest of a value split over several writes)
is EINVAL, so a value split in two changes nothing. O_TRUNC and truncate to
0 are accepted and change nothing.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from vgpud.fsview.render import TENANT_FILES, WRITABLE, render_gpus, render_tenant_file
from vgpud.fsview.snapshot import Snapshot
from vgpud.fsview.values import parse_write

__all__ = ["MAX_HANDLES", "MAX_HANDLES_PER_UID", "FileView", "Node", "resolve"]

log = logging.getLogger(__name__)

# Open files at once, per uid and in all; more: ENFILE. Per uid, so that one
# user holding files open cannot keep the others from reading.
MAX_HANDLES_PER_UID = 256
MAX_HANDLES = 16384
DIR_MODE = stat.S_IFDIR | 0o555
FILE_MODE = stat.S_IFREG | 0o444
WRITABLE_MODE = stat.S_IFREG | 0o664


class FileInfo(Protocol):
    """The fields of libfuse's struct fuse_file_info used here."""

    flags: int
    fh: int
    direct_io: int


@dataclass(frozen=True, slots=True)
class Node:
    """A path of the view: a directory (``entries``) or a file."""

    tenant: str | None = None
    file: str | None = None
    entries: tuple[str, ...] | None = None

    @property
    def writable(self) -> bool:
        return self.tenant is not None and self.file in WRITABLE


def resolve(snap: Snapshot, path: str) -> Node | None:
    """The node at ``path`` in ``snap``, None when there is none."""
    parts = [p for p in path.split("/") if p]
    if not parts:
        return Node(entries=("gpus", "tenants"))
    if parts == ["gpus"]:
        return Node(file="gpus")
    if parts[0] != "tenants" or len(parts) > 3:
        return None
    if len(parts) == 1:
        return Node(entries=tuple(snap.tenants))
    if parts[1] not in snap.tenants:
        return None
    if len(parts) == 2:
        return Node(tenant=parts[1], entries=tuple(TENANT_FILES))
    return Node(tenant=parts[1], file=parts[2]) if parts[2] in TENANT_FILES else None


@dataclass(slots=True)
class _Handle:
    node: Node
    content: bytes | None  # None: opened write-only
    uid: int


def _fail(code: int) -> OSError:
    return OSError(code, os.strerror(code))


class FileView:
    """mfusepy Operations (raw_fi: open() sets direct_io, so the kernel keeps
    no page cache and a file's size, reported 0 as in cgroupfs, is not a limit).

    ``snapshot``: the latest Snapshot. ``submit(tenant, changes)``: apply
    Manager changes, raising OSError (EINVAL: refused). ``caller``: the
    request's (uid, gid, pid) (mfusepy.fuse_get_context). ``authorize``:
    whether that caller may change tenants. ``exit``: end the FUSE loop
    (mfusepy.fuse_exit, callable from a request only).
    """

    use_ns = True

    def __init__(self, snapshot: Callable[[], Snapshot],
                 submit: Callable[[str, dict[str, object]], None],
                 caller: Callable[[], tuple[int, int, int]],
                 authorize: Callable[[int, int, int], bool],
                 exit: Callable[[], None]) -> None:
        self._snapshot = snapshot
        self._submit = submit
        self._caller = caller
        self._authorize = authorize
        self._exit = exit
        self._handles: dict[int, _Handle] = {}
        self._per_uid: dict[int, int] = {}
        self._next = 1
        self._time = time.time_ns()
        self.stopping = False  # set by the owner: the next request ends the loop
        self.on_init: Callable[[], None] = lambda: None

    # --- mfusepy Operations ---

    def init(self, path: str) -> None:
        self.on_init()

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        if self.stopping:
            self._exit()
            raise _fail(errno.ENOENT)
        snap = self._snapshot()
        node = resolve(snap, path)
        if node is None:
            raise _fail(errno.ENOENT)
        attrs: dict[str, Any] = {"st_uid": 0, "st_gid": 0, "st_size": 0, "st_atime": self._time,
                                 "st_mtime": self._time, "st_ctime": self._time}
        if node.entries is not None:
            return {**attrs, "st_mode": DIR_MODE, "st_nlink": 2}
        if node.writable:
            return {**attrs, "st_mode": WRITABLE_MODE, "st_nlink": 1, "st_gid": snap.admin_gid}
        return {**attrs, "st_mode": FILE_MODE, "st_nlink": 1}

    def readdir(self, path: str, fh: int) -> list[str]:
        node = resolve(self._snapshot(), path)
        if node is None or node.entries is None:
            raise _fail(errno.ENOTDIR)
        return [".", "..", *node.entries]

    def open(self, path: str, fi: FileInfo) -> int:
        snap = self._snapshot()
        node = resolve(snap, path)
        if node is None:
            raise _fail(errno.ENOENT)
        if node.file is None:
            raise _fail(errno.EISDIR)
        access = fi.flags & os.O_ACCMODE
        if access != os.O_RDONLY:
            if not node.writable:
                raise _fail(errno.EACCES)  # root passes the mode check
            self._check_caller()
        uid = self._caller()[0]
        held = self._per_uid.get(uid, 0)
        if held >= MAX_HANDLES_PER_UID or len(self._handles) >= MAX_HANDLES:
            raise _fail(errno.ENFILE)
        content = None if access == os.O_WRONLY else self._render(snap, node)
        fi.fh, self._next = self._next, self._next + 1
        fi.direct_io = 1
        self._handles[fi.fh] = _Handle(node, content, uid)
        self._per_uid[uid] = held + 1
        return 0

    def read(self, path: str, size: int, offset: int, fi: FileInfo) -> bytes:
        content = self._handle(fi).content
        if content is None:
            raise _fail(errno.EBADF)
        return content[offset:offset + size]

    def write(self, path: str, data: bytes, offset: int, fi: FileInfo) -> int:
        node = self._handle(fi).node
        if not node.writable or node.tenant is None or node.file is None:
            raise _fail(errno.EBADF)
        uid = self._check_caller()
        if offset != 0:
            log.debug("fs: %s/%s: write at offset %d refused (one value per write)",
                      node.tenant, node.file, offset)
            raise _fail(errno.EINVAL)
        try:
            changes = parse_write(node.file, data, self._snapshot().regions)
        except ValueError as exc:
            log.debug("fs: %s/%s: %s", node.tenant, node.file, exc)
            raise _fail(errno.EINVAL) from None
        self._submit(node.tenant, changes)
        log.info("fs: uid %d set %s of tenant %s", uid, node.file, node.tenant)
        return len(data)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        node = resolve(self._snapshot(), path)
        if node is None:
            raise _fail(errno.ENOENT)
        if not node.writable:
            raise _fail(errno.EACCES)
        if length != 0:
            raise _fail(errno.EINVAL)
        self._check_caller()
        return 0

    def release(self, path: str, fi: FileInfo) -> int:
        handle = self._handles.pop(fi.fh, None)
        if handle is not None:
            left = self._per_uid.pop(handle.uid) - 1
            if left:
                self._per_uid[handle.uid] = left
        return 0

    # --- helpers ---

    def _handle(self, fi: FileInfo) -> _Handle:
        handle = self._handles.get(fi.fh)
        if handle is None:
            raise _fail(errno.EBADF)
        return handle

    def _check_caller(self) -> int:
        uid, gid, pid = self._caller()
        if not self._authorize(uid, gid, pid):
            log.info("fs: write by uid %d (pid %d) refused: not an admin", uid, pid)
            raise _fail(errno.EACCES)
        return uid

    @staticmethod
    def _render(snap: Snapshot, node: Node) -> bytes:
        if node.tenant is None:
            return render_gpus(snap)
        assert node.file is not None
        return render_tenant_file(snap, node.tenant, node.file)

