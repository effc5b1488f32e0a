"""Channel groups in the charge journal: their lines, replay (live contexts
only, paused state kept), compaction, the scheduler taking restored groups
over, a restarted daemon dropping the groups of closed contexts, and a
stateful check that replaying the journal rebuilds the live tracker."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
import zlib
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.support.daemon_world import QuotaWorld
from tests.support.fakekernel import make_context
from tests.support.journal_files import ID, MACHINE_SETTINGS, fresh, journal_file, record_writes
from tests.support.sched_world import CONFIG as SCHED_CONFIG
from tests.support.sched_world import Clock, Recorder, Timers, settle
from vgpud.admin.manager import Manager
from vgpud.core.groups import (
    Group,
    GroupEvent,
    GroupForgotten,
    GroupLearned,
    GroupPauseChanged,
    GroupTracker,
)
from vgpud.core.ledger import Closed, Ledger, Opened
from vgpud.kernel.uapi import Sched, SchedState
from vgpud.sched.service import SchedulerService
from vgpud.store import journal as J
from vgpud.store.config import parse_config
from vgpud.store.journal import (
    ChargeAndGroupJournal,
    GroupAdded,
    GroupPaused,
    GroupRemoved,
    Identity,
)
from vgpud.store.state import RuntimeState

GIB = 2**30
G1 = Group(1, "a", 0, 0xC1D00001, 0x5C000001, 0xBEEF0080, 4242)
G2 = Group(1, "a", 1, 0xC1D00001, 0x5C000002, 0xBEEF0081, 4242)
G3 = Group(2, "b", 0, 0xC1D00002, 0x5C000001, 0xBEEF0080, 4343)


def state(tracker: GroupTracker) -> tuple[dict[int, Group], frozenset[int]]:
    """What a journal must rebuild: the groups by id and which are paused."""
    return dict(tracker.by_id), frozenset(g.id for g in tracker if tracker.paused(g))


def line(payload: str) -> bytes:
    return b"%s %08x\n" % (payload.encode(), zlib.crc32(payload.encode()))


def broken(record: J.Record) -> bytes:
    """The record's line with its checksum spoilt."""
    good = J.encode(record)
    return good[:-9] + (b"0" if good[-9:-8] != b"0" else b"1") + good[-8:]


def restored(path: Path, contexts: dict[int, str] | None = None) -> GroupTracker:
    tracker = GroupTracker()
    records = J.load(path, ID)
    if contexts is None:
        ledger = fresh()
        J.replay(ledger, records)
        contexts = ledger.contexts()
    J.replay_groups(tracker, records, contexts)
    return tracker


# --- lines ---

RECORDS = [
    GroupAdded(G1),
    GroupAdded(Group(2**64 - 1, "tenant-9.x_y", 2**32 - 1, 2**32 - 1, 0, 2**32 - 1, 0)),
    GroupRemoved(0xC1D00001, 0x5C000001),
    GroupPaused(0xC1D00001, 0x5C000001, True),
    GroupPaused(0, 0xFFFFFFFF, False),
]


@pytest.mark.parametrize("record", RECORDS)
def test_group_line_round_trip(record: J.Record) -> None:
    data = J.encode(record)
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert J.decode(J._checked(data[:-1])) == record


def test_group_lines_read_as_documented() -> None:
    assert J.encode(GroupAdded(Group(7, "a", 1, 10, 11, 12, 99)))[:-10] == b"G 7 a 1 10 11 12 99"
    assert J.encode(GroupRemoved(10, 11))[:-10] == b"R 10 11"
    assert J.encode(GroupPaused(10, 11, True))[:-10] == b"P 10 11 1"


BAD_GROUP_LINES = [
    broken(GroupRemoved(G1.client, G1.handle)),  # it would have removed G1
    broken(GroupPaused(G1.client, G1.handle, True)),  # it would have paused it
    broken(GroupAdded(G3)),
    line("G 1 a 0 1 2 3"),  # too few fields
    line("G 1 a 0 1 2 3 4 5"),  # too many
    line("G 1 Bad-Name 0 1 2 3 4"),  # not a tenant name
    line("G 1 a 0 4294967296 2 3 4"),  # client over u32
    line("G 1 a - 1 2 3 4"),  # no GPU
    line("R 1"),
    line(f"R {G1.client} {G1.handle} 1"),
    line(f"P {G1.client} {G1.handle} 2"),  # neither 0 nor 1
    line(f"P {G1.client} {G1.handle}"),
    b"R \xff 00000000\n",
]


@pytest.mark.parametrize("bad", BAD_GROUP_LINES)
def test_bad_group_lines_are_skipped_and_change_nothing(
    tmp_path: Path, bad: bytes, caplog: pytest.LogCaptureFixture,
) -> None:
    path = journal_file(tmp_path, J.encode(Opened(1, "a")), J.encode(GroupAdded(G1)), bad,
                        J.encode(GroupAdded(G2)))
    tracker = restored(path)
    assert state(tracker) == ({G1.id: G1, G2.id: G2}, frozenset())
    assert "line 4 skipped" in caplog.text


def test_changes_about_no_live_group_are_skipped(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    path = journal_file(tmp_path, J.encode(Opened(1, "a")),
                        J.encode(GroupRemoved(G1.client, G1.handle)),
                        J.encode(GroupPaused(G2.client, G2.handle, True)),
                        J.encode(GroupAdded(G1)),
                        J.encode(GroupRemoved(G1.client, G1.handle)),
                        J.encode(GroupPaused(G1.client, G1.handle, True)),
                        J.encode(GroupAdded(G2)))
    tracker = GroupTracker()
    assert J.replay_groups(tracker, J.load(path, ID), {1: "a"}) == 3
    assert state(tracker) == ({G2.id: G2}, frozenset())
    assert caplog.text.count("is about no live group") == 3


def test_only_groups_of_restored_contexts_of_their_tenant_come_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    other_tenant = Group(3, "a", 0, 9, 9, 8, 1)  # context 3 is b's
    records = [GroupAdded(G1), GroupAdded(G3), GroupAdded(other_tenant),
               GroupPaused(G1.client, G1.handle, True), Opened(1, "a"), Closed(2)]
    tracker = GroupTracker()
    assert J.replay_groups(tracker, records, {1: "a", 3: "b"}) == 0
    assert state(tracker) == ({G1.id: G1}, frozenset({G1.id}))
    assert "2 channel groups of contexts not restored left out" in caplog.text


def test_a_group_created_again_is_not_paused() -> None:
    tracker = GroupTracker()
    records = [GroupAdded(G1), GroupPaused(G1.client, G1.handle, True), GroupAdded(G1)]
    J.replay_groups(tracker, records, {1: "a"})
    assert state(tracker) == ({G1.id: G1}, frozenset())


def test_the_ledger_replay_passes_group_lines_by(tmp_path: Path) -> None:
    ledger = fresh()
    assert J.replay(ledger, [Opened(1, "a"), GroupAdded(G1), GroupRemoved(1, 2)]) == 0
    assert ledger.contexts() == {1: "a"}


# --- versions ---


def test_a_version_1_journal_is_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    path = tmp_path / "charges"
    path.write_bytes(line(f"vgpud-charges 1 {ID.boot_id} {ID.module}")
                     + J.encode(Opened(1, "a")))
    assert J.load(path, ID) == [Opened(1, "a")]
    assert "version 1, without channel groups" in caplog.text


def test_a_newer_version_is_discarded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "charges"
    path.write_bytes(line(f"vgpud-charges 3 {ID.boot_id} {ID.module}")
                     + J.encode(Opened(1, "a")))
    assert J.load(path, ID) == []
    assert "format version 3, this vgpud reads 1 and 2: discarded" in caplog.text


def test_the_header_is_version_2(tmp_path: Path) -> None:
    assert J._header(ID) == line(f"vgpud-charges 2 {ID.boot_id} {ID.module}")


# --- resume, append, compaction ---


def follow(journal: ChargeAndGroupJournal | None, ledger: Ledger,
           tracker: GroupTracker) -> ChargeAndGroupJournal:
    """Subscribe the journal to the ledger and the tracker, as vgpud.app does."""
    assert journal is not None
    ledger.observers.subscribe(journal)
    tracker.observers.subscribe(journal)
    return journal


def test_resume_restores_groups_and_their_paused_state(tmp_path: Path) -> None:
    path = tmp_path / "run" / "charges"
    ledger, tracker = fresh(), GroupTracker()
    journal = follow(ChargeAndGroupJournal.resume(path, ledger, ID, groups=tracker), ledger,
                     tracker)
    ledger.open(1, "a")
    ledger.open(2, "b")
    for group in (G1, G2, G3):
        tracker.add(group)
    tracker.set_paused(G2, True)
    tracker.set_paused(G3, True)
    tracker.set_paused(G3, False)
    journal.close()

    ledger2, tracker2 = fresh(), GroupTracker()
    second = follow(ChargeAndGroupJournal.resume(path, ledger2, ID, groups=tracker2), ledger2,
                    tracker2)
    assert state(tracker2) == state(tracker)
    # the second journal started from the restored state; it follows the tracker
    ledger2.close(2)
    tracker2.closed(2)
    second.close()
    ledger3, tracker3 = fresh(), GroupTracker()
    ChargeAndGroupJournal.resume(path, ledger3, ID, groups=tracker3).close()  # type: ignore[union-attr]
    assert state(tracker3) == ({G1.id: G1, G2.id: G2}, frozenset({G2.id}))


def test_resume_without_a_tracker_restores_the_charges_only(tmp_path: Path) -> None:
    path = tmp_path / "charges"
    ledger, tracker = fresh(), GroupTracker()
    first = follow(ChargeAndGroupJournal.resume(path, ledger, ID, groups=tracker), ledger,
                   tracker)
    ledger.open(1, "a")
    tracker.add(G1)
    first.close()
    again = fresh()
    ChargeAndGroupJournal.resume(path, again, ID).close()  # type: ignore[union-attr]
    assert again.contexts() == {1: "a"}
    assert J.load(path, ID) == [Opened(1, "a")]  # compacted without the groups


def test_group_changes_are_one_write_each_and_come_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger, tracker = fresh(), GroupTracker()
    heard: list[str] = []

    class Observer:
        def notify(self, event: GroupEvent) -> None:
            kind = {GroupLearned: "created", GroupForgotten: "freed",
                    GroupPauseChanged: "paused"}[type(event)]
            heard.append(f"{kind}, {len(writes)} written")

    journal = ChargeAndGroupJournal(tmp_path / "charges", ID, ledger, groups=tracker)
    assert journal.start()
    follow(journal, ledger, tracker)  # first, as in vgpud.app: on file before it is acted on
    tracker.observers.subscribe(Observer())
    writes = record_writes(monkeypatch)
    ledger.open(1, "a")
    tracker.add(G1)
    tracker.set_paused(G1, True)
    tracker.set_paused(G1, True)  # a repeat: no change
    tracker.freed(G1.client, G1.parent)  # its device
    assert [J.decode(J._checked(w[:-1])) for w in writes] == [
        Opened(1, "a"), GroupAdded(G1), GroupPaused(G1.client, G1.handle, True),
        GroupRemoved(G1.client, G1.handle)]
    assert heard == ["created, 2 written", "paused, 3 written", "freed, 4 written"]
    journal.close()


def test_compaction_writes_and_counts_the_groups(tmp_path: Path) -> None:
    path = tmp_path / "charges"
    ledger, tracker = fresh(), GroupTracker()
    journal = ChargeAndGroupJournal(path, ID, ledger, groups=tracker, floor=16)
    assert journal.start()
    follow(journal, ledger, tracker)
    ledger.open(1, "a")
    for n in range(400):
        group = Group(1, "a", 0, 7, n, 3, 1)
        tracker.add(group)
        if n % 2:
            tracker.set_paused(group, True)
        if n % 3:
            tracker.freed(7, n)
    lines = path.read_bytes().splitlines()
    live = len(list(ledger.changes())) + len(list(J.group_changes(tracker)))
    assert journal.compactions >= 5
    assert len(lines) <= 1 + live + max(16, J.GROWTH * live)
    assert state(restored(path)) == state(tracker)
    journal.compact()
    assert len(path.read_bytes().splitlines()) == 1 + live
    journal.close()


# --- the scheduler takes restored groups over ---


def test_the_service_switches_restored_groups_and_keeps_paused_ones_off(
    tmp_path: Path,
) -> None:
    text = SCHED_CONFIG.format(state=tmp_path / "state.json")
    manager = Manager(tmp_path / "vgpud.toml", parse_config(text), RuntimeState(), Ledger(),
                      [(0, "sim", GIB)])
    tracker = GroupTracker()
    ga = Group(1, "a", 0, 0xA0, 0x100, 0x10, 1)
    gb = Group(2, "b", 0, 0xB0, 0x100, 0x10, 2)
    gc = Group(3, "c", 0, 0xC0, 0x100, 0x10, 3)
    for group in (ga, gb, gc):
        tracker.add(group)
    tracker.set_paused(gb, True)
    clock = Clock()
    timers = Timers(clock)
    service = SchedulerService(manager, tracker, clock=clock, call_later=timers,
                               share_interval=1e6)
    actuator = Recorder(clock)

    async def main() -> None:
        service.start(actuator)
        await settle()
        first = [e for _, es in actuator.calls for e in es]
        assert Sched(2, 0xB0, 0x100, SchedState.OWNER_OFF) in first
        # each of the others gets a state at once (the module turned them back on)
        assert {(e.h_client, e.enable) for e in first if e.h_client != 0xB0} == {
            (0xA0, SchedState.ON), (0xC0, SchedState.OFF)}
        await timers.run_until(clock.now + 1_000_000_000)
        states = {e.enable for _, es in actuator.calls for e in es if e.h_client == 0xB0}
        assert states == {SchedState.OWNER_OFF}
        turned_on = {e.h_client for _, es in actuator.calls for e in es if e.enable == 1}
        assert turned_on == {0xA0, 0xC0}
        assert service.share("b") == {} and service.share("a") == {0: 71.4}
        await service.stop()

    asyncio.run(asyncio.wait_for(main(), 30))


# --- the daemon: restored, then reconciled with the module's live contexts ---


def test_restarted_daemon_knows_the_groups_of_live_contexts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    first = QuotaWorld(tmp_path, "off")
    ledger, tracker = first.policy.inner.ledger, first.admin.scheduler.tracker
    kept = Group(7, "a", 0, 0xC7, 0x5C0, 0x80, 100)
    paused = Group(7, "a", 0, 0xC7, 0x5C1, 0x80, 100)
    gone = Group(8, "a", 0, 0xC8, 0x5C0, 0x80, 101)
    for ctx in (7, 8):
        ledger.open(ctx, "a")
    for group in (kept, paused, gone):
        tracker.add(group)
    tracker.set_paused(paused, True)
    first.admin.close()  # the daemon is killed: its journal stays
    first.close()
    (tmp_path / "notify").unlink()

    again = QuotaWorld(tmp_path, "off")
    tracker = again.admin.scheduler.tracker
    assert state(tracker) == ({g.id: g for g in (kept, paused, gone)}, frozenset({paused.id}))
    again.kernel.contexts = [make_context(7)]  # 8 closed while no daemon ran

    async def main() -> None:
        serving = asyncio.create_task(again.daemon().serve())
        assert (await again.notification()).startswith("READY=1")
        for _ in range(100):
            if again.kernel.schedules:
                break
            await asyncio.sleep(0.01)
        entries = [e for es in again.kernel.schedules for e in es]
        assert Sched(7, kept.client, kept.handle, SchedState.ON) in entries
        assert [e.enable for e in entries if e.h_object == paused.handle] == [
            SchedState.OWNER_OFF]
        os.kill(os.getpid(), signal.SIGTERM)
        assert await serving == 0

    asyncio.run(asyncio.wait_for(main(), 20))
    assert state(tracker) == ({kept.id: kept, paused.id: paused}, frozenset({paused.id}))
    assert "2 contexts and 3 channel groups restored" in caplog.text
    text = (tmp_path / "run" / "charges").read_text()
    assert f"R {gone.client} {gone.handle} " in text
    again.close()


# --- stateful: the journal of any sequence of tracker changes replays to the tracker ---


class JournaledGroupsMachine(RuleBasedStateMachine):
    """Contexts open and close, groups come, go (freed by handle, device or
    client, or with their context), pause and resume; a journal compacting
    often follows the ledger and the tracker. After every step, replaying the
    file gives a tracker equal to the live one, paused state included."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="vgpud-gjournal-")
        self.path = Path(self.dir) / "charges"
        self.ledger, self.tracker = fresh(), GroupTracker()
        self.journal = ChargeAndGroupJournal(self.path, ID, self.ledger, groups=self.tracker,
                                             floor=4)
        assert self.journal.start()
        follow(self.journal, self.ledger, self.tracker)
        self.next_ctx = 1

    @rule(tenant=st.sampled_from("ab"))
    def open(self, tenant: str) -> None:
        self.ledger.open(self.next_ctx, tenant)
        self.next_ctx += 1

    @precondition(lambda self: self.ledger.contexts())
    @rule(data=st.data(), client=st.integers(1, 3), handle=st.integers(1, 6),
          parent=st.integers(7, 8), gpu=st.integers(0, 1), tgid=st.integers(0, 2**32 - 1))
    def create(self, data: st.DataObject, client: int, handle: int, parent: int, gpu: int,
               tgid: int) -> None:
        ctx, tenant = data.draw(st.sampled_from(sorted(self.ledger.contexts().items())))
        self.tracker.add(Group(ctx, tenant, gpu, client, handle, parent, tgid))

    @rule(client=st.integers(1, 3), handle=st.sampled_from((1, 2, 3, 4, 5, 6, 7, 8, 0)))
    def free(self, client: int, handle: int) -> None:
        self.tracker.freed(client, handle or client)  # 0: the client itself

    @precondition(lambda self: self.ledger.contexts())
    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        ctx = data.draw(st.sampled_from(sorted(self.ledger.contexts())))
        self.ledger.close(ctx)  # in the daemon's order: the ledger's close, then the groups
        self.tracker.closed(ctx)

    @precondition(lambda self: len(self.tracker))
    @rule(data=st.data(), paused=st.booleans())
    def pause(self, data: st.DataObject, paused: bool) -> None:
        group = data.draw(st.sampled_from(sorted(self.tracker, key=lambda g: g.id)))
        self.tracker.set_paused(group, paused)

    @invariant()
    def journal_replays_to_the_live_tracker(self) -> None:
        records = J.load(self.path, ID)
        ledger, tracker = fresh(), GroupTracker()
        assert J.replay(ledger, records) == 0
        assert J.replay_groups(tracker, records, ledger.contexts()) == 0
        assert state(tracker) == state(self.tracker)
        assert list(J.group_changes(tracker)) == list(J.group_changes(self.tracker))

    def teardown(self) -> None:
        self.journal.close()
        shutil.rmtree(self.dir)


JournaledGroupsMachine.TestCase.settings = MACHINE_SETTINGS
TestJournaledGroupsMachine = JournaledGroupsMachine.TestCase


def test_identity_is_checked_for_group_lines_too(tmp_path: Path) -> None:
    path = journal_file(tmp_path, J.encode(Opened(1, "a")), J.encode(GroupAdded(G1)),
                        identity=Identity(ID.boot_id, "another-load"))
    assert state(restored(path, {1: "a"})) == ({}, frozenset())
