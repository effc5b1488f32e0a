"""LIST_CONTEXTS and SCHEDULE against the real module over nvsim (VM tier).

The daemon side is vgpud's own GenlChannel; malformed requests go out on the
raw client of tests/support/vgpu_genl.py. Channel groups are allocated through
/dev/vgpu/nvidiactl by an owner process (or thread), and scheduled by this
process as the registered daemon, through the owner's backing file.

    scripts/test-vm -k sched_cmd
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import resource
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.guest import ROOT
from tests.support.sched import aio, group_enabled, list_contexts, schedule, traced
from tests.support.vgpu_genl import Genl, NlError
from vgpud.host.processes import start_ticks
from vgpud.kernel.channel import GenlChannel, RequestFailed
from vgpud.kernel.uapi import Context, Node, Sched, SchedResult

pytestmark = pytest.mark.vm

CMD_LIST_CONTEXTS, CMD_SCHEDULE = 8, 9
A_CURSOR, A_CONTEXTS, A_SCHED, A_SCHED_RESULT, A_OPENERS = 11, 12, 13, 14, 21
CONTEXT = struct.Struct("=QQ6I")
SCHED = struct.Struct("=QIIII")
LIST_MAX, SCHED_MAX = 1024, 256
OK = SchedResult(0, nv.NV_OK)

OWNER = r"""
import json, os, sys
from tests.support import nvclient as nv
if len(sys.argv) > 2:
    os.setgroups([])
    os.setgid(int(sys.argv[3]))
    os.setuid(int(sys.argv[2]))
ctl = os.open(sys.argv[1] + "/nvidiactl", os.O_RDWR)
info = {"pid": os.getpid(), "uid": os.getuid()}
if len(sys.argv) == 2:
    t = nv.build_tree(ctl)
    tsgs = [nv.rm_alloc(ctl, t.client, t.device, 0, nv.KEPLER_CHANNEL_GROUP_A,
                        nv.TSG_ALLOC.pack(0, 0, 0, 1, 0)) for _ in range(3)]
    assert all(r.status == nv.NV_OK for r in tsgs), tsgs
    info |= {"client": t.client, "tsgs": [r.handle for r in tsgs]}
print(json.dumps(info), flush=True)
sys.stdin.read()
"""


class Owner:
    """A process holding /dev/vgpu/nvidiactl, optionally with a client and 3 TSGs."""

    def __init__(self, dev: Path, uid: int | None = None, gid: int | None = None) -> None:
        args = [sys.executable, "-c", OWNER, str(dev)]
        if uid is not None:
            args += [str(uid), str(gid)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=ROOT)  # cwd: tests.support importable
        assert self.proc.stdout is not None
        self.info = json.loads(self.proc.stdout.readline())
        self.pid: int = self.info["pid"]

    def ctx(self) -> Context:
        (ctx,) = [c for c in aio(list_contexts()) if c.tgid == self.pid]
        return ctx

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        assert self.proc.wait(30) == 0


@pytest.fixture
def owners(vgpu: Path) -> Iterator[list[Owner]]:
    started: list[Owner] = []
    yield started
    for o in started:
        if o.proc.poll() is None:
            o.proc.kill()
            o.proc.wait()


def start_owner(owners: list[Owner], dev: Path, *ids: int) -> Owner:
    owner = Owner(dev, *ids)
    owners.append(owner)
    return owner


def module_contexts() -> int:
    g = Genl()
    try:
        return g.stats()["contexts"]
    finally:
        g.close()


# --- LIST_CONTEXTS --------------------------------------------------------------

def test_list_reports_identity(vgpu: Path, owners: list[Owner]) -> None:
    me = os.getpid()
    ctl = os.open(vgpu / "nvidiactl", os.O_RDWR)
    gpu = os.open(vgpu / "nvidia1", os.O_RDWR)
    uvm = os.open(vgpu / "nvidia-uvm", os.O_RDWR)
    opened: dict[str, int] = {}

    def in_thread() -> None:
        opened["tid"] = threading.get_native_id()
        opened["fd"] = os.open(vgpu / "nvidiactl", os.O_RDWR)

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    other = start_owner(owners, vgpu, 1234, 2345)
    try:
        contexts = aio(list_contexts())
        ids = [c.ctx_id for c in contexts]
        assert ids == sorted(ids) and len(ids) == 5
        mine = [c for c in contexts if c.tgid == me]
        assert [(c.node, c.minor, c.pid, c.uid, c.gid) for c in mine] == [
            (Node.CTL, 0, me, 0, 0), (Node.GPU, 1, me, 0, 0), (Node.UVM, 0, me, 0, 0),
            (Node.CTL, 0, opened["tid"], 0, 0)]
        theirs = other.ctx()
        assert (theirs.node, theirs.pid, theirs.uid, theirs.gid) == (
            Node.CTL, other.pid, 1234, 2345)
        cgroup = Path("/proc/self/cgroup").read_text().splitlines()[0]
        assert cgroup.startswith("0::"), cgroup
        cgdir = Path("/sys/fs/cgroup") / cgroup[3:].lstrip("/")
        if cgdir.exists():  # cgroup v2 mounted: its ino is the cgroup id
            assert {c.cgroup_id for c in contexts} == {cgdir.stat().st_ino}
        else:
            assert all(c.cgroup_id == contexts[0].cgroup_id != 0 for c in contexts)
    finally:
        for fd in (ctl, gpu, uvm, opened["fd"]):
            os.close(fd)
        other.close()
    assert aio(list_contexts()) == []
    assert module_contexts() == 0


def test_list_needs_cap_net_admin(vgpu: Path) -> None:
    code = ("import asyncio, os, sys\n"
            "os.setgid(2345); os.setuid(1234)\n"
            "from vgpud.kernel.channel import GenlChannel, NotPermitted\n"
            "async def main():\n"
            "    ch = await GenlChannel.open()\n"
            "    try:\n"
            "        await ch.list_contexts()\n"
            "    except NotPermitted as e:\n"
            "        print('EPERM', e)\n"
            "    finally:\n"
            "        ch.close()\n"
            "asyncio.run(main())\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=False)
    assert res.stdout.startswith("EPERM"), res.stdout + res.stderr


def test_list_drops_closed_and_pages(vgpu: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), max(hard, 4096)))
    fds = [os.open(vgpu / "nvidiactl", os.O_RDWR) for _ in range(LIST_MAX + 200)]
    my_start = start_ticks(os.getpid())
    g = Genl()
    try:
        all_ids = [c.ctx_id for c in aio(list_contexts())]
        assert len(all_ids) == len(fds) and all_ids == sorted(all_ids)
        for fd in fds[::3]:
            os.close(fd)
        live = all_ids[1::3] + all_ids[2::3]
        live.sort()
        assert [c.ctx_id for c in aio(list_contexts())] == live

        def page(cursor: int | None) -> tuple[list[int], int]:
            attrs = [] if cursor is None else [(A_CURSOR, struct.pack("=Q", cursor))]
            _, replies = g.request(CMD_LIST_CONTEXTS, attrs)
            (reply,) = replies
            raw = reply[A_CONTEXTS]
            ids = [f[0] for f in CONTEXT.iter_unpack(raw)]
            # One opener per context, in order: here all are this process,
            # whose start time /proc shows in clock ticks (10 ms).
            starts = {s // 10_000_000 for s, _ in struct.iter_unpack("=QQ", reply[A_OPENERS])}
            assert len(reply[A_OPENERS]) == 16 * len(ids)
            assert starts <= {my_start}
            return ids, struct.unpack("=Q", reply[A_CURSOR])[0]

        # The whole list fits in one page now; 1024 + 200 did not.
        assert page(None) == (live, 0)
        assert page(0) == (live, 0)
        # From the middle: a live id is the first; a closed one gives the next.
        mid = live[len(live) // 2]
        assert page(mid) == (live[len(live) // 2:], 0)
        closed = all_ids[3]
        assert closed not in live
        assert page(closed)[0][0] == min(i for i in live if i > closed)
        assert page(live[-1] + 1) == ([], 0)
        # More than a page: reopen until LIST_MAX + 100 are live.
        fds = [fd for i, fd in enumerate(fds) if i % 3]
        fds += [os.open(vgpu / "nvidiactl", os.O_RDWR) for _ in range(LIST_MAX + 100 - len(fds))]
        live = [c.ctx_id for c in aio(list_contexts())]
        assert len(live) == LIST_MAX + 100
        first, cursor = page(0)
        assert first == live[:LIST_MAX] and cursor == live[LIST_MAX]
        assert page(cursor) == (live[LIST_MAX:], 0)
        with pytest.raises(NlError) as err:
            g.request(CMD_LIST_CONTEXTS, [(A_CURSOR, b"\0" * 4)])
        assert err.value.errno == errno.EINVAL
    finally:
        g.close()
        for fd in fds:
            os.close(fd)
    assert aio(list_contexts()) == []
    assert module_contexts() == 0


# --- SCHEDULE ---------------------------------------------------------------------

def test_schedule_on_off_and_errors(vgpu: Path, owners: list[Owner], sched_trace: Path) -> None:
    owner = start_owner(owners, vgpu)
    ctx = owner.ctx().ctx_id
    client, (g0, g1, g2) = owner.info["client"], owner.info["tsgs"]
    gpu = os.open(vgpu / "nvidia0", os.O_RDWR)
    uvm = os.open(vgpu / "nvidia-uvm", os.O_RDWR)
    try:
        others = {c.node: c.ctx_id for c in aio(list_contexts()) if c.tgid == os.getpid()}
        unknown = max(others.values()) + 1000
        assert aio(schedule([Sched(ctx, client, g0, False)])) == [OK]
        assert group_enabled(client, g0) in (None, False)
        assert aio(schedule([Sched(ctx, client, g0, True)])) == [OK]
        assert group_enabled(client, g0) in (None, True)
        assert aio(schedule([
            Sched(ctx, client, 0x0BAD0BAD, True),
            Sched(ctx, 0x0BAD0BAD, g0, True),
            Sched(unknown, client, g0, True),
            Sched(others[Node.GPU], client, g0, True),
            Sched(others[Node.UVM], client, g0, True),
            Sched(ctx, client, g0, True),
        ])) == [
            SchedResult(0, nv.NV_ERR_INVALID_OBJECT_HANDLE),
            SchedResult(0, nv.NV_ERR_INVALID_CLIENT),
            SchedResult(-errno.ENOENT, 0),
            SchedResult(-errno.EINVAL, 0),
            SchedResult(-errno.EINVAL, 0),
            OK,
        ]
        # Applied in order: outgoing groups off, then incoming ones on.
        (sched_trace).write_text("")
        entries = [Sched(ctx, client, g0, False), Sched(ctx, client, g1, False),
                   Sched(ctx, client, g2, True), Sched(ctx, client, g0, True)]
        assert aio(schedule(entries)) == [OK] * 4
        events = traced(sched_trace)
        assert [(int(e["ctx"]), int(e["object"], 16), int(e["enable"]), int(e["error"]),
                 int(e["status"], 16)) for e in events] == [
            (ctx, s.h_object, int(s.enable), 0, 0) for s in entries]
        assert all(int(e["ns"]) > 0 for e in events)
        assert [group_enabled(client, g) for g in (g0, g1, g2)] in (
            [None] * 3, [True, False, True])
    finally:
        os.close(gpu)
        os.close(uvm)
        owner.close()
    # The owner is gone: its context with it.
    assert aio(schedule([Sched(ctx, client, g0, True)])) == [SchedResult(-errno.ENOENT, 0)]
    assert module_contexts() == 0


def test_schedule_only_from_the_daemon(vgpu: Path, owners: list[Owner]) -> None:
    owner = start_owner(owners, vgpu)
    entry = Sched(owner.ctx().ctx_id, owner.info["client"], owner.info["tsgs"][0], True)

    async def main() -> None:
        stranger = await GenlChannel.open()
        daemon = await GenlChannel.open()
        try:
            for registered in (False, True):
                if registered:
                    await daemon.register()
                with pytest.raises(RequestFailed, match="registered daemon only") as err:
                    await stranger.schedule([entry])
                assert err.value.errno == errno.EPERM
            assert await daemon.schedule([entry]) == [OK]
        finally:
            stranger.close()
            daemon.close()

    aio(main())
    owner.close()


def test_schedule_bad_requests(vgpu: Path, owners: list[Owner], sched_trace: Path) -> None:
    owner = start_owner(owners, vgpu)
    good = SCHED.pack(owner.ctx().ctx_id, owner.info["client"], owner.info["tsgs"][0], 0, 0)
    g = Genl()
    try:
        g.register()
        cases: list[list[tuple[int, bytes]]] = [
            [],
            [(A_SCHED, b"")],
            [(A_SCHED, good[:-1])],
            [(A_SCHED, good + b"\0")],
            [(A_SCHED, good * (SCHED_MAX + 1))],
            [(A_SCHED, good + SCHED.pack(1, 2, 3, 0, 1))],  # reserved
            [(A_SCHED, good + SCHED.pack(1, 2, 3, 6, 0))],  # enable: no such op (v8: 3 to 5 are)
            [(A_SCHED, good), (A_SCHED_RESULT, b"\0" * 8)],  # a reply's attribute
        ]
        for i, attrs in enumerate(cases):
            with pytest.raises(NlError) as err:
                g.request(CMD_SCHEDULE, attrs)
            assert (i, err.value.errno) == (i, errno.EINVAL), err.value
        # Nothing was applied, not even the good first entries.
        assert traced(sched_trace) == []
        _, (reply,) = g.request(CMD_SCHEDULE, [(A_SCHED, good * SCHED_MAX)])
        assert reply[A_SCHED_RESULT] == struct.pack("=iI", 0, 0) * SCHED_MAX
        assert len(traced(sched_trace)) == SCHED_MAX
    finally:
        g.close()
        owner.close()


def test_schedule_unmaps_its_buffer(vgpu: Path, owners: list[Owner]) -> None:
    """Each message maps one page in the sender and unmaps it: VmSize stays put."""
    owner = start_owner(owners, vgpu)
    entry = SCHED.pack(owner.ctx().ctx_id, owner.info["client"], owner.info["tsgs"][0], 1, 0)

    def vmsize() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1])
        raise AssertionError("no VmSize")

    g = Genl()
    try:
        g.register()
        g.request(CMD_SCHEDULE, [(A_SCHED, entry)])
        before = vmsize()
        for _ in range(2000):
            g.request(CMD_SCHEDULE, [(A_SCHED, entry)])
        assert vmsize() - before < 2000 * 4 // 2  # KiB; a leak is 4 KiB per message
    finally:
        g.close()
        owner.close()


def test_schedule_races_close(vgpu: Path) -> None:
    """Contexts close while SCHEDULE uses them: results stay exact, nothing leaks."""
    stop = threading.Event()
    published: list[tuple[int, int, int]] = []
    failures: list[BaseException] = []

    def churn() -> None:
        g = Genl()
        cursor = 0
        try:
            while not stop.is_set():
                fd = os.open(vgpu / "nvidiactl", os.O_RDWR)
                t = nv.build_tree(fd)
                tsg = nv.rm_alloc(fd, t.client, t.device, 0, nv.KEPLER_CHANNEL_GROUP_A).handle
                _, (reply,) = g.request(CMD_LIST_CONTEXTS, [(A_CURSOR, struct.pack("=Q", cursor))])
                (ctx,) = [f[0] for f in CONTEXT.iter_unpack(reply[A_CONTEXTS])]
                cursor = ctx + 1
                published.append((ctx, t.client, tsg))
                time.sleep(0.001)
                os.close(fd)
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)
        finally:
            g.close()

    async def scheduler() -> tuple[int, int]:
        channel = await GenlChannel.open()
        await channel.register()
        ok = gone = 0
        try:
            start = time.monotonic()
            # 8 s of churn, longer on a loaded guest until both outcomes were seen
            while not failures and time.monotonic() - start < 120 and (
                    time.monotonic() - start < 8 or not (ok and gone and len(published) > 10)):
                recent = published[-3:]
                entries = [Sched(c, h, g, on) for c, h, g in recent for on in (False, True)]
                if not entries:
                    await asyncio.sleep(0.001)
                    continue
                for r in await channel.schedule(entries):
                    assert r in (OK, SchedResult(-errno.ENOENT, 0)), r
                    ok += r == OK
                    gone += r != OK
        finally:
            channel.close()
        return ok, gone

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        ok, gone = aio(scheduler())
    finally:
        stop.set()
        thread.join()
    assert not failures, failures
    assert ok and gone and len(published) > 10, (ok, gone, len(published))
    assert module_contexts() == 0


def _dmesg() -> str:
    return subprocess.run(["dmesg"], capture_output=True, text=True, check=False).stdout


def test_groups_a_gone_daemon_left_off_go_back_on(vgpu: Path, owners: list[Owner]) -> None:
    """The module turns back on, at the next registration, what a dead daemon left off."""
    owner = start_owner(owners, vgpu)
    ctx = owner.ctx().ctx_id
    client, (g0, g1, g2) = owner.info["client"], owner.info["tsgs"]
    quitter = start_owner(owners, vgpu)
    q_ctx, q_client, q_group = quitter.ctx().ctx_id, quitter.info["client"], quitter.info["tsgs"][0]

    async def main() -> None:
        first = await GenlChannel.open()
        await first.register()
        assert await first.schedule([Sched(ctx, client, g0, False), Sched(ctx, client, g1, False),
                                     Sched(q_ctx, q_client, q_group, False)]) == [OK] * 3
        assert await first.schedule([Sched(ctx, client, g1, True)]) == [OK]
        await first.register()  # the same daemon again: nothing changes
        assert [group_enabled(client, g) for g in (g0, g1, g2)] == [False, True, True]
        quitter.close()  # its context goes, and the record of its group with it
        first.close()  # dies without turning g0 back on
        assert group_enabled(client, g0) is False
        second = await GenlChannel.open()
        try:
            await second.register()
            assert [group_enabled(client, g) for g in (g0, g1, g2)] == [True, True, True]
            assert await second.schedule([Sched(ctx, client, g2, False)]) == [OK]
            assert await second.schedule([Sched(ctx, client, g2, True)]) == [OK]
        finally:
            second.close()
        third = await GenlChannel.open()  # nothing was left off this time
        try:
            await third.register()
        finally:
            third.close()

    def restores() -> list[str]:
        return [line for line in _dmesg().splitlines() if "left off by the previous" in line]

    before = len(restores())
    aio(main())
    new = restores()[before:]
    assert len(new) == 1 and "vgpu: 1 channel groups" in new[0], new
    owner.close()
    assert module_contexts() == 0
