"""The charge journal: lines, loading, compaction, failures, a SIGKILLed writer,
and a stateful check that replaying it rebuilds the live ledger."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import zlib
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from tests.support.journal_files import ID, MACHINE_SETTINGS, fresh, journal_file, record_writes
from tests.support.ledger_model import ACCOUNTS, LedgerMachine, ModelNode
from vgpud.core.ledger import (
    Change,
    Charged,
    Closed,
    Duped,
    Key,
    Ledger,
    Opened,
    Removed,
    Reservation,
    Tracked,
)
from vgpud.store import journal as J
from vgpud.store.journal import ChargeAndGroupJournal, Identity

MiB = 2**20
CLIENT = Key(0xC1D00001, 0xC1D00001)
DEVICE = Key(0xC1D00001, 0xBEEF0080)


def durable(ledger: Ledger) -> tuple:
    """Everything a journal must rebuild: accounts (limit, charged), contexts,
    objects with their parent, GPU, children and charge (shared charges as the
    set of handles that share them). Not reservations: they live for one call."""
    sharing: dict[int, set[Key]] = {}
    for key, node in ledger._nodes.items():
        if node.charge is not None:
            sharing.setdefault(id(node.charge), set()).add(key)
    nodes = {}
    for key, node in ledger._nodes.items():
        c = node.charge
        charge = None if c is None else (c.tenant, c.gpu, c.size, c.refs,
                                         frozenset(sharing[id(c)]))
        nodes[key] = (node.ctx, node.parent, node.gpu, frozenset(node.children), charge)
    accounts = {k: (a.limit, a.charged) for k, a in ledger._accounts.items()}
    contexts = {ctx: (c.tenant, frozenset(c.keys)) for ctx, c in ledger._contexts.items()}
    return accounts, contexts, nodes


def populate(ledger: Ledger) -> None:
    """Two contexts, a tree, charges, a dup across tenants, a free, a close."""
    ledger.open(1, "a")
    ledger.track(1, CLIENT)
    ledger.track(1, DEVICE, CLIENT, gpu=0)
    for n, size in enumerate((MiB, 2 * MiB, 4 * MiB)):
        r = ledger.reserve(1, 0, size, DEVICE, Key(CLIENT.client, n))
        assert isinstance(r, Reservation)
        ledger.commit(r)
    ledger.open(2, "b")
    ledger.track(2, Key(7, 7))
    ledger.dup(2, Key(7, 1), Key(CLIENT.client, 0), Key(7, 7))
    ledger.free(Key(CLIENT.client, 1))
    ledger.open(3, "b")
    ledger.close(3)


# --- lines ---

CHANGES = [
    Opened(1, "a"),
    Opened(2**64 - 1, "tenant-9.x_y"),
    Tracked(1, Key(1, 1), None, None),
    Tracked(1, Key(1, 2), Key(1, 1), 3),
    Charged(1, Key(1, 3), Key(1, 2), "a", 0, 2**64 - 1),
    Charged(1, Key(0, 77), None, "a", 1, 4096),
    Duped(2, Key(0xFFFFFFFF, 5), Key(1, 3), None),
    Duped(2, Key(2, 5), Key(1, 3), Key(2, 2)),
    Removed(Key(1, 2)),
    Closed(2),
]


@pytest.mark.parametrize("change", CHANGES)
def test_line_round_trip(change: Change) -> None:
    line = J.encode(change)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert J.decode(J._checked(line[:-1])) == change


def test_encode_refuses_other_values() -> None:
    with pytest.raises(TypeError):
        J.encode(("O", 1))  # type: ignore[arg-type]


def line(payload: str) -> bytes:
    return b"%s %08x\n" % (payload.encode(), zlib.crc32(payload.encode()))


BAD_LINES = [
    b"O 1 a 00000000\n",  # wrong checksum
    b"O 1 a\n",  # none at all
    line("O 1"),  # too few fields
    line("O 1 a b"),  # too many
    line("Z 1"),  # unknown record
    line("O 1 Bad-Name"),  # not a tenant name
    line("O -1 a"),  # not a number
    line("T 1 4294967296 1 - - -"),  # handle over u32
    line("C 1 1 1 - - a 0 18446744073709551616"),  # size over u64
    line("T 1 1 1 1 - -"),  # half a parent
    b"\xff\xfe 12345678\n",
]


@pytest.mark.parametrize("bad", BAD_LINES)
def test_bad_lines_are_skipped(tmp_path: Path, bad: bytes,
                               caplog: pytest.LogCaptureFixture) -> None:
    path = journal_file(tmp_path, J.encode(Opened(1, "a")), bad, J.encode(Closed(1)))
    assert J.load(path, ID) == [Opened(1, "a"), Closed(1)]
    assert "line 3 skipped" in caplog.text


def test_truncated_last_line_is_skipped(tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    path = journal_file(tmp_path, J.encode(Opened(1, "a")), J.encode(Closed(1))[:-3])
    assert J.load(path, ID) == [Opened(1, "a")]
    assert "truncated" in caplog.text


def test_many_bad_lines_are_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = journal_file(tmp_path, *[b"junk\n"] * 50, J.encode(Closed(1)))
    assert J.load(path, ID) == [Closed(1)]
    assert "50 bad lines skipped in all" in caplog.text
    assert caplog.text.count("skipped:") == 5


@pytest.mark.parametrize("identity, why", [
    (Identity("another-boot", ID.module), "another boot"),
    (Identity(ID.boot_id, "4243"), "another load of vgpu.ko"),
])
def test_other_boot_or_module_load_is_discarded(tmp_path: Path, identity: Identity, why: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    path = journal_file(tmp_path, J.encode(Opened(1, "a")), identity=identity)
    assert J.load(path, ID) == []
    assert why in caplog.text


@pytest.mark.parametrize("head", [b"", b"garbage\n", line("vgpud-charges 3 x y"),
                                  line("other 1 x y"), b"\n"])
def test_no_valid_header_means_nothing(tmp_path: Path, head: bytes) -> None:
    path = tmp_path / "charges"
    path.write_bytes(head + J.encode(Opened(1, "a")))
    assert J.load(path, ID) == []


def test_missing_or_unreadable_journal(tmp_path: Path) -> None:
    assert J.load(tmp_path / "none", ID) == []
    (tmp_path / "dir").mkdir()
    assert J.load(tmp_path / "dir", ID) == []


def test_current_identity(tmp_path: Path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("abc\n")
    (tmp_path / "vgpu").mkdir()
    here = J.current_identity(boot, tmp_path / "vgpu")
    assert here == Identity("abc", str((tmp_path / "vgpu").stat().st_ino))
    assert J.current_identity(boot, tmp_path / "none") == Identity("abc", "absent")
    unknown = J.current_identity(tmp_path / "none", tmp_path / "vgpu")
    assert unknown.boot_id.startswith("unknown-")
    assert unknown != J.current_identity(tmp_path / "none", tmp_path / "vgpu")


# --- resume, append, compaction ---


def follow(journal: ChargeAndGroupJournal | None, ledger: Ledger) -> ChargeAndGroupJournal:
    """Subscribe the journal to the ledger, as vgpud.app does."""
    assert journal is not None
    ledger.observers.subscribe(journal)
    return journal


def test_resume_rebuilds_the_ledger(tmp_path: Path) -> None:
    path = tmp_path / "run" / "charges"
    live = fresh()
    journal = follow(ChargeAndGroupJournal.resume(path, live, ID), live)
    populate(live)
    journal.close()
    again = fresh()
    second = follow(ChargeAndGroupJournal.resume(path, again, ID), again)
    assert durable(again) == durable(live)
    assert again.usage("a", 0).charged == 5 * MiB
    # the second journal started from the replayed state: a third daemon sees it too
    again.close(2)
    second.close()
    third = fresh()
    ChargeAndGroupJournal.resume(path, third, ID).close()  # type: ignore[union-attr]
    assert durable(third) == durable(again)
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_changes_that_no_longer_fit_are_skipped(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "charges"
    live = fresh()
    first = follow(ChargeAndGroupJournal.resume(path, live, ID), live)
    populate(live)
    first.close()
    smaller = Ledger()
    smaller.set_limit("a", 0, MiB)  # tenant b is gone from the config
    journal = ChargeAndGroupJournal.resume(path, smaller, ID)
    assert journal is not None
    assert smaller.contexts() == {1: "a"}
    assert smaller.usage("a", 0).charged == 5 * MiB
    assert "does not apply" in caplog.text
    journal.close()
    assert "O 2 b" not in path.read_text()  # compacted to what applied


def test_compaction_bounds_the_file(tmp_path: Path) -> None:
    path = tmp_path / "charges"
    ledger = fresh(limit=2**40)
    journal = ChargeAndGroupJournal(path, ID, ledger, floor=16)
    assert journal.start()
    follow(journal, ledger)
    ledger.open(1, "a")
    ledger.track(1, CLIENT)
    for n in range(500):
        r = ledger.reserve(1, 0, MiB, CLIENT, Key(CLIENT.client, n))
        ledger.commit(r)  # type: ignore[arg-type]
        if n % 3:
            ledger.free(Key(CLIENT.client, n))
    lines = len(path.read_bytes().splitlines())
    live = len(list(ledger.changes()))  # only grew: it bounds the last compaction's too
    assert journal.compactions >= 5
    assert lines <= 1 + live + max(16, J.GROWTH * live)
    copy = fresh(limit=2**40)
    J.replay(copy, J.load(path, ID))
    assert durable(copy) == durable(ledger)
    journal.close()
    size = path.stat().st_size
    ledger.open(2, "a")  # heard, but closed: nothing written
    assert path.stat().st_size == size
    assert not (tmp_path / ".charges.tmp").exists()


def test_one_write_per_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = fresh()
    journal = ChargeAndGroupJournal(tmp_path / "charges", ID, ledger)
    journal.start()
    follow(journal, ledger)
    writes = record_writes(monkeypatch)
    populate(ledger)
    assert [J.decode(J._checked(w[:-1])) for w in writes] == [
        Opened(1, "a"), Tracked(1, CLIENT, None, None), Tracked(1, DEVICE, CLIENT, 0),
        Charged(1, Key(CLIENT.client, 0), DEVICE, "a", 0, MiB),
        Charged(1, Key(CLIENT.client, 1), DEVICE, "a", 0, 2 * MiB),
        Charged(1, Key(CLIENT.client, 2), DEVICE, "a", 0, 4 * MiB),
        Opened(2, "b"), Tracked(2, Key(7, 7), None, None),
        Duped(2, Key(7, 1), Key(CLIENT.client, 0), Key(7, 7)),
        Removed(Key(CLIENT.client, 1)), Opened(3, "b"), Closed(3),
    ]
    journal.close()


def test_a_failed_write_is_healed_by_a_compaction(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "charges"
    ledger = fresh()
    journal = ChargeAndGroupJournal(path, ID, ledger)
    journal.start()
    follow(journal, ledger)
    real_write = os.write
    failures = iter([OSError(28, "No space left on device")])

    def full(fd: int, data: bytes) -> int:
        error = next(failures, None)
        if error is not None:
            raise error
        return real_write(fd, data)

    monkeypatch.setattr(J.os, "write", full)
    ledger.open(1, "a")  # lost from the file
    assert "No space left" in caplog.text
    assert J.load(path, ID) == []
    ledger.track(1, CLIENT)  # not appended either: the file is known to be stale
    for n in range(J.RETRY):
        ledger.track(1, Key(CLIENT.client, n), CLIENT)
    copy = fresh()
    J.replay(copy, J.load(path, ID))
    assert durable(copy) == durable(ledger)
    journal.close()


def test_unwritable_directory_means_no_journal(tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("")
    ledger = fresh()
    assert ChargeAndGroupJournal.resume(tmp_path / "file" / "charges", ledger, ID) is None
    assert "will not survive a restart" in caplog.text
    os.chmod(tmp_path, 0o500)
    try:
        if os.geteuid() != 0:  # root writes anyway
            assert ChargeAndGroupJournal.resume(tmp_path / "charges", ledger, ID) is None
    finally:
        os.chmod(tmp_path, 0o700)


def test_second_daemon_leaves_the_journal_alone(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "charges"
    first = fresh()
    journal = follow(ChargeAndGroupJournal.resume(path, first, ID), first)
    populate(first)
    before = path.read_bytes()
    assert ChargeAndGroupJournal.resume(path, fresh(), ID) is None
    assert "held by another vgpud" in caplog.text
    assert path.read_bytes() == before
    journal.close()
    assert ChargeAndGroupJournal.resume(path, fresh(), ID) is not None


WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from vgpud.core.ledger import Key, Ledger
    from vgpud.store.journal import ChargeAndGroupJournal, Identity
    ledger = Ledger()
    ledger.set_limit("a", 0, 1 << 40)
    ledger.observers.subscribe(ChargeAndGroupJournal.resume(Path(sys.argv[1]), ledger,
                                                           Identity("b", "m")))
    ledger.open(1, "a")
    ledger.track(1, Key(1, 1))
    for n in range(int(sys.argv[2])):
        ledger.commit(ledger.reserve(1, 0, 4096, Key(1, 1), Key(1, 100 + n)))
    print("done", flush=True)
    sys.stdin.read()
""")


def test_nothing_written_is_lost_to_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "charges"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "1000"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "done\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ledger = Ledger()
    ledger.set_limit("a", 0, 1 << 40)
    # its lock died with it
    journal = ChargeAndGroupJournal.resume(path, ledger, Identity("b", "m"))
    assert journal is not None
    assert ledger.usage("a", 0).charged == 1000 * 4096
    journal.close()


# --- stateful: the journal of any sequence of operations replays to the live ledger ---


class JournaledLedgerMachine(LedgerMachine):
    """The ledger model check, with a journal (compacting often) following the
    ledger: after every step, a new ledger replayed from the file equals it."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="vgpud-journal-")
        self.path = Path(self.dir) / "charges"
        self.journal = ChargeAndGroupJournal(self.path, ID, self.ledger, floor=8)
        assert self.journal.start()
        follow(self.journal, self.ledger)

    @precondition(lambda self: self.model.contexts)
    @rule(data=st.data(), gpu=st.sampled_from((0, 1, 7)))
    def track_device(self, data: st.DataObject, gpu: int) -> None:
        ctx = data.draw(st.sampled_from(sorted(self.model.contexts)))
        parent, key = self.child_key(data, ctx)
        self.ledger.track(ctx, key, parent, gpu)
        self.model.nodes[key] = ModelNode(ctx, parent, None)

    @invariant()
    def journal_replays_to_the_live_ledger(self) -> None:
        replayed = Ledger()
        for tenant, gpu in ACCOUNTS:
            replayed.set_limit(tenant, gpu, self.model.limits[tenant, gpu])
        assert J.replay(replayed, J.load(self.path, ID)) == 0
        assert durable(replayed) == durable(self.ledger)
        assert list(replayed.changes()) == list(self.ledger.changes())

    def teardown(self) -> None:
        super().teardown()
        self.journal.close()
        shutil.rmtree(self.dir)


JournaledLedgerMachine.TestCase.settings = MACHINE_SETTINGS
TestJournaledLedgerMachine = JournaledLedgerMachine.TestCase
