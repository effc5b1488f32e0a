"""The charge and group journal: a restarted daemon keeps the charges and the
channel groups of live contexts.

The ledger tells each durable change to its observers (vgpud.core.ledger.Change:
a context opened or closed, an object tracked, charged, duplicated or freed).
This journal, one of them, appends each one as a line, with one write(), to a
file in a runtime directory (``daemon.charges_path``, default
/run/vgpud/charges: a tmpfs, which survives the daemon but not a reboot, as
the contexts it describes do). There is no fsync: what a killed process has
written is already in the page cache. The scheduler's GroupTracker
(vgpud.core.groups) is observed the same way, in the same file: each group
created, gone, paused or resumed is a line. When the appended lines
outnumber both a floor and GROWTH times the live state (the ledger's and the
groups'), the file is compacted: the current state goes to a temp file that
is renamed over it (so the file stays under GROWTH + 1 times the state).

At start, ``resume`` replays the journal into a fresh ledger (whose limits the
config has set), then puts back in the tracker the groups whose context the
ledger has restored (with the same tenant), paused as they were, and starts
a new journal from the result. A line whose checksum or fields are wrong is
skipped with a warning, as is a change that no longer fits (a tenant or GPU
gone from the config, a group never created). A journal written under
another boot (/proc/sys/kernel/random/boot_id) or another load of the vgpu
module (context ids restart at each load) is discarded as a whole. A
version 1 journal (no group lines) is read as it is.

Format: text lines, fields separated by one space, each ending with the
CRC-32 of what precedes it (8 hex digits); ``-`` for an absent parent or GPU:

    vgpud-charges 2 BOOT_ID MODULE             header
    O ctx tenant                               opened
    T ctx client handle pclient phandle gpu    tracked
    C ctx client handle pclient phandle tenant gpu size
    D ctx client handle sclient shandle pclient phandle
    F client handle                            freed (with its subtree)
    X ctx                                      closed
    G ctx tenant gpu client handle parent tgid a channel group created
    R client handle                            that group gone
    P client handle 0|1                        its owner resumed (0) or paused (1) it
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import uuid
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import suppress
from itertools import chain
from pathlib import Path
from typing import NamedTuple

from vgpud.core.groups import (
    Group,
    GroupEvent,
    GroupForgotten,
    GroupLearned,
    GroupPauseChanged,
    GroupTracker,
    group_id,
)
from vgpud.core.ledger import (
    Change,
    Charged,
    Closed,
    Duped,
    Key,
    Ledger,
    LedgerError,
    Opened,
    Removed,
    Tracked,
)
from vgpud.core.tenants import validate_name

__all__ = [
    "ChargeAndGroupJournal",
    "GroupAdded",
    "GroupPaused",
    "GroupRemoved",
    "Identity",
    "Record",
    "current_identity",
    "decode",
    "encode",
    "group_changes",
    "load",
    "replay",
    "replay_groups",
]

log = logging.getLogger(__name__)

MAGIC = "vgpud-charges"
VERSION = 2
_READABLE = frozenset({"1", "2"})  # version 1: the same lines, without groups
COMPACT_FLOOR = 4096  # appended lines that never trigger a compaction by themselves
GROWTH = 4  # else compact when the appended lines outnumber the live ones this many times
RETRY = 256  # changes between attempts to rewrite a journal whose write failed
_LOGGED = 5  # bad lines logged one by one; the rest are only counted
_U32_MAX = 0xFFFFFFFF
_U64_MAX = 2**64 - 1


class GroupAdded(NamedTuple):
    group: Group


class GroupRemoved(NamedTuple):
    client: int
    handle: int


class GroupPaused(NamedTuple):
    client: int
    handle: int
    paused: bool


GroupChange = GroupAdded | GroupRemoved | GroupPaused
Record = Change | GroupChange  # what a journal line holds
_GROUP_CHANGES = (GroupAdded, GroupRemoved, GroupPaused)


class Identity(NamedTuple):
    """What a journal's context ids are valid under: a boot and a module load."""

    boot_id: str
    module: str


def current_identity(boot_id: Path = Path("/proc/sys/kernel/random/boot_id"),
                     module: Path = Path("/sys/module/vgpu")) -> Identity:
    """This boot and this load of vgpu.ko: its sysfs directory's inode number,
    new at each load ("absent" when it is not loaded: then no context is open).
    An unreadable boot id gives a random identity, which no journal matches."""
    try:
        boot = boot_id.read_text().strip()
    except OSError as exc:
        log.warning("cannot read %s (%s): earlier charges cannot be restored", boot_id, exc)
        boot = f"unknown-{uuid.uuid4()}"
    try:
        instance = str(os.stat(module).st_ino)
    except FileNotFoundError:
        instance = "absent"
    except OSError as exc:
        log.warning("cannot stat %s (%s): earlier charges cannot be restored", module, exc)
        instance = f"unknown-{uuid.uuid4()}"
    return Identity(boot, instance)


# --- lines -------------------------------------------------------------------


def _line(payload: str) -> bytes:
    data = payload.encode()
    return b"%s %08x\n" % (data, zlib.crc32(data))


def _header(identity: Identity) -> bytes:
    return _line(f"{MAGIC} {VERSION} {identity.boot_id} {identity.module}")


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _key(key: Key | None) -> str:
    return "- -" if key is None else f"{key[0]} {key[1]}"


def encode(change: Record) -> bytes:
    """One journal line (with its newline) for a ledger or group change."""
    match change:
        case Charged(ctx, key, parent, tenant, gpu, size):
            text = f"C {ctx} {key[0]} {key[1]} {_key(parent)} {tenant} {gpu} {size}"
        case Removed(key):
            text = f"F {key[0]} {key[1]}"
        case Tracked(ctx, key, parent, gpu):
            text = f"T {ctx} {key[0]} {key[1]} {_key(parent)} {_opt(gpu)}"
        case Duped(ctx, key, source, parent):
            text = f"D {ctx} {key[0]} {key[1]} {source[0]} {source[1]} {_key(parent)}"
        case Opened(ctx, tenant):
            text = f"O {ctx} {tenant}"
        case Closed(ctx):
            text = f"X {ctx}"
        case GroupAdded(g):
            text = f"G {g.ctx} {g.tenant} {g.gpu} {g.client} {g.handle} {g.parent} {g.tgid}"
        case GroupRemoved(client, handle):
            text = f"R {client} {handle}"
        case GroupPaused(client, handle, paused):
            text = f"P {client} {handle} {int(paused)}"
        case _:
            raise TypeError(f"not a ledger or group change: {change!r}")
    return _line(text)


def _checked(raw: bytes) -> list[str]:
    """The fields of one line (without its newline) whose checksum holds."""
    body, sep, crc = raw.rpartition(b" ")
    if not sep or len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
        raise ValueError("bad checksum")
    return body.decode("ascii").split(" ")


def _int(text: str, top: int) -> int:
    if not text.isdigit():
        raise ValueError(f"not a number: {text!r}")
    value = int(text)
    if value > top:
        raise ValueError(f"{value} out of range")
    return value


def _handle_pair(client: str, handle: str) -> Key:
    return Key(_int(client, _U32_MAX), _int(handle, _U32_MAX))


def _parent(client: str, handle: str) -> Key | None:
    if client == handle == "-":
        return None
    return _handle_pair(client, handle)


def decode(fields: list[str]) -> Record:
    """The change a line's fields describe; ValueError when they describe none."""
    kind, args = fields[0], fields[1:]
    n = len(args)
    if kind == "C" and n == 8:
        return Charged(_int(args[0], _U64_MAX), _handle_pair(args[1], args[2]),
                       _parent(args[3], args[4]), validate_name(args[5]),
                       _int(args[6], _U32_MAX), _int(args[7], _U64_MAX))
    if kind == "T" and n == 6:
        gpu = None if args[5] == "-" else _int(args[5], _U32_MAX)
        return Tracked(_int(args[0], _U64_MAX), _handle_pair(args[1], args[2]),
                       _parent(args[3], args[4]), gpu)
    if kind == "F" and n == 2:
        return Removed(_handle_pair(args[0], args[1]))
    if kind == "D" and n == 7:
        return Duped(_int(args[0], _U64_MAX), _handle_pair(args[1], args[2]),
                     _handle_pair(args[3], args[4]), _parent(args[5], args[6]))
    if kind == "O" and n == 2:
        return Opened(_int(args[0], _U64_MAX), validate_name(args[1]))
    if kind == "X" and n == 1:
        return Closed(_int(args[0], _U64_MAX))
    if kind == "G" and n == 7:
        return GroupAdded(Group(_int(args[0], _U64_MAX), validate_name(args[1]),
                                _int(args[2], _U32_MAX), _int(args[3], _U32_MAX),
                                _int(args[4], _U32_MAX), _int(args[5], _U32_MAX),
                                _int(args[6], _U32_MAX)))
    if kind == "R" and n == 2:
        return GroupRemoved(*_handle_pair(args[0], args[1]))
    if kind == "P" and n == 3 and args[2] in ("0", "1"):
        return GroupPaused(*_handle_pair(args[0], args[1]), args[2] == "1")
    raise ValueError(f"unknown record {kind!r} with {n} fields")


# --- reading -----------------------------------------------------------------


def load(path: Path, identity: Identity) -> list[Record]:
    """The changes in the journal at ``path``, if it was written under
    ``identity``; bad lines are skipped (and logged), a missing file is empty."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("charge journal %s unreadable (%s): not restored", path, exc)
        return []
    lines = data.split(b"\n")
    if lines[-1]:
        log.warning("charge journal %s: last line truncated, skipped", path)
    lines.pop()  # what follows the last newline: empty, or a truncated line
    try:
        magic, version, boot_id, module = _checked(lines[0]) if lines else [""] * 4
    except ValueError:
        magic = version = boot_id = module = ""
    if magic != MAGIC:
        if lines:
            log.warning("charge journal %s: no valid header, discarded", path)
        return []
    if version not in _READABLE:
        log.warning("charge journal %s: format version %s, this vgpud reads %s: discarded",
                    path, version, " and ".join(sorted(_READABLE)))
        return []
    if (boot_id, module) != identity:
        why = "another boot" if boot_id != identity.boot_id else "another load of vgpu.ko"
        log.info("charge journal %s is from %s: discarded", path, why)
        return []
    if version == "1":
        log.info("charge journal %s: version 1, without channel groups", path)
    changes: list[Record] = []
    bad = 0
    for number, raw in enumerate(lines[1:], start=2):
        try:
            changes.append(decode(_checked(raw)))
        except (ValueError, UnicodeDecodeError) as exc:
            bad += 1
            if bad <= _LOGGED:
                log.warning("charge journal %s line %d skipped: %s", path, number, exc)
    if bad > _LOGGED:
        log.warning("charge journal %s: %d bad lines skipped in all", path, bad)
    return changes


def replay(ledger: Ledger, changes: Iterable[Record]) -> int:
    """Apply the ledger ``changes`` in order (group changes are not its);
    those that do not fit are skipped. Returns how many were skipped."""
    skipped = 0
    for change in changes:
        if isinstance(change, _GROUP_CHANGES):
            continue
        try:
            ledger.apply(change)
        except (LedgerError, ValueError) as exc:
            skipped += 1
            if skipped <= _LOGGED:
                log.warning("charge journal: %r does not apply: %r", change, exc)
    if skipped > _LOGGED:
        log.warning("charge journal: %d changes did not apply in all", skipped)
    return skipped


def replay_groups(tracker: GroupTracker, changes: Iterable[Record],
                  contexts: Mapping[int, str]) -> int:
    """Add to ``tracker`` the groups that the group ``changes`` leave live and
    whose context is in ``contexts`` (ctx -> tenant: the replayed ledger's)
    with the group's tenant, paused as they were. A change about a group not
    live is skipped. Returns how many were skipped."""
    groups: dict[int, Group] = {}
    paused: set[int] = set()
    skipped = 0
    for change in changes:
        match change:
            case GroupAdded(group):
                groups[group.id] = group
                paused.discard(group.id)
                continue
            case GroupRemoved(client, handle) | GroupPaused(client, handle):
                gid = group_id(client, handle)
            case _:
                continue
        if gid not in groups:
            skipped += 1
            if skipped <= _LOGGED:
                log.warning("charge journal: %r is about no live group", change)
        elif isinstance(change, GroupRemoved):
            del groups[gid]
            paused.discard(gid)
        elif change.paused:
            paused.add(gid)
        else:
            paused.discard(gid)
    dropped = 0
    for gid, group in sorted(groups.items()):
        if contexts.get(group.ctx) != group.tenant:
            dropped += 1
            continue
        tracker.add(group)
        if gid in paused:
            tracker.set_paused(group, True)
    if dropped:
        log.info("charge journal: %d channel groups of contexts not restored left out",
                 dropped)
    if skipped > _LOGGED:
        log.warning("charge journal: %d group changes did not apply in all", skipped)
    return skipped


def group_changes(tracker: GroupTracker) -> Iterator[GroupChange]:
    """Changes that rebuild the tracker's groups and their paused state."""
    for group in sorted(tracker, key=lambda g: g.id):
        yield GroupAdded(group)
        if tracker.paused(group):
            yield GroupPaused(group.client, group.handle, True)


# --- writing -----------------------------------------------------------------


class ChargeAndGroupJournal:
    """Appends a ledger's changes, and those of a group tracker if one is
    given, to ``path`` (see the module doc).

    ``start`` writes the state as a fresh journal; from then on it is to
    observe the ledger and the tracker (``notify``), before anyone else acts
    on their changes. A failed write never fails the ledger call it follows:
    it is logged, and a compaction RETRY changes later rewrites the whole
    state, which heals the journal.
    """

    def __init__(self, path: Path, identity: Identity, ledger: Ledger, *,
                 groups: GroupTracker | None = None, floor: int = COMPACT_FLOOR) -> None:
        self.path = path
        self.identity = identity
        self.ledger = ledger
        self.groups = groups
        self.floor = floor
        self.compactions = 0
        self._tmp = path.with_name(f".{path.name}.tmp")
        self._fd = -1
        self._lock_fd = -1
        self._appended = 0
        self._bound = floor
        self._broken = True  # until the first compaction succeeds
        self._retry = 0
        self._closed = False

    @classmethod
    def resume(cls, path: Path, ledger: Ledger, identity: Identity | None = None, *,
               groups: GroupTracker | None = None) -> ChargeAndGroupJournal | None:
        """Replay the journal at ``path`` into ``ledger`` and ``groups`` (an
        empty tracker), then journal them afresh (the caller subscribes it to
        both); None (logged) when it cannot
        be written, or while another daemon holds it (its lock file, ``path``
        + ``.lock``)."""
        journal = cls(path, identity or current_identity(), ledger, groups=groups)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            journal._lock()
        except OSError as exc:
            journal.close()
            log.warning("charge journal %s unusable (%s): charges will not survive a restart",
                        path, exc)
            return None
        changes = load(path, journal.identity)
        skipped = replay(ledger, changes)
        if groups is not None:
            skipped += replay_groups(groups, changes, ledger.contexts())
        if changes:
            log.info("charge journal %s: %d changes replayed (%d skipped), %d contexts and "
                     "%d channel groups restored", path, len(changes) - skipped, skipped,
                     len(ledger.contexts()), 0 if groups is None else len(groups))
        if not journal.start():
            journal.close()
            log.warning("charge journal %s unusable: charges will not survive a restart", path)
            return None
        return journal

    def _lock(self) -> None:
        """Hold the journal for this process (released at exit, even by SIGKILL)."""
        self._lock_fd = os.open(self.path.with_name(f"{self.path.name}.lock"),
                                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(errno.EBUSY, "held by another vgpud") from None

    def start(self) -> bool:
        """Write the state as a fresh journal."""
        return self.compact()

    def notify(self, event: Change | GroupEvent) -> None:
        """A change of the ledger or of the tracker: one line, one write()."""
        match event:
            case GroupLearned(group):
                self.record(GroupAdded(group))
            case GroupForgotten(group):
                self.record(GroupRemoved(group.client, group.handle))
            case GroupPauseChanged(group, paused):
                self.record(GroupPaused(group.client, group.handle, paused))
            case _:
                self.record(event)

    def record(self, change: Record) -> None:
        """Append one line; nothing once closed."""
        if self._closed:
            return
        if self._broken:
            self._retry -= 1
            if self._retry <= 0:
                self.compact()  # the ledger already holds ``change``
            return
        if self._appended >= self._bound:
            self.compact()
            return
        line = encode(change)
        try:
            ok, why = os.write(self._fd, line) == len(line), "short write"
        except OSError as exc:
            ok, why = False, str(exc)
        if not ok:
            log.error("charge journal %s: write failed (%s); it will be rewritten",
                      self.path, why)
            self._fail()
            return
        self._appended += 1

    def compact(self) -> bool:
        """Rewrite the journal as the current state (temp file, rename)."""
        lines = [_header(self.identity)]
        groups = () if self.groups is None else group_changes(self.groups)
        lines.extend(encode(change) for change in chain(self.ledger.changes(), groups))
        data = b"".join(lines)
        fd = -1
        try:
            fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
                         | os.O_CLOEXEC, 0o600)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.replace(self._tmp, self.path)
        except OSError as exc:
            log.error("charge journal %s: compaction failed: %s", self.path, exc)
            if fd >= 0:
                os.close(fd)
                with suppress(OSError):
                    os.unlink(self._tmp)
            self._fail()
            return False
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd  # the renamed file: appends go on after the state
        self._appended = 0
        self._bound = max(self.floor, GROWTH * (len(lines) - 1))
        self._broken = False
        self.compactions += 1
        return True

    def _fail(self) -> None:
        """Appends stop; a compaction is tried again RETRY changes later."""
        self._broken = True
        self._retry = RETRY

    def close(self) -> None:
        """Stop journaling; the file stays for the next daemon."""
        self._closed = True
        for fd in (self._fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._lock_fd = -1
