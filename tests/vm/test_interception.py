"""Acceptance of the kernel interception path: nvsim + vgpu + the real daemon.

Each test loads nvsim and vgpu afresh (fixtures in conftest.py) and checks
that they unload afterwards, so a leaked reference fails the test that made it.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.guest import ROOT, set_param
from tests.support.procstat import proc_state
from tests.support.vgpud_proc import TEST_DAEMON
from vgpud.kernel.channel import GenlChannel, query_module_stats
from vgpud.kernel.codec import CloseEvent, Event, PostEvent
from vgpud.kernel.uapi import ALLOW, Filter, Stats, Verdict
from vgpud.nvidia.escapes import NvStatus
from vgpud.nvidia.layouts import MemoryAllocParams, RmAlloc
from vgpud.policy.base import Request
from vgpud.policy.dispatch import Dispatcher
from vgpud.policy.rules import rm_alloc_classes

pytestmark = pytest.mark.vm

MEM_LOCAL = 0x40
MiB = 1 << 20


class Recorder:
    """A policy that records what it sees and answers as told."""

    def __init__(self, classes: set[int], answer: Callable[[Request], Verdict] | None = None):
        self.classes = classes
        self.answer = answer or (lambda _req: ALLOW)
        self.requests: list[Request] = []
        self.events: list[Event] = []

    def filter(self) -> Filter:
        return Filter(rules=rm_alloc_classes(self.classes, post=True))

    def decide(self, request: Request) -> Verdict:
        self.requests.append(request)
        return self.answer(request)

    def on_event(self, event: Event) -> None:
        self.events.append(event)


class InProcessDaemon:
    """The daemon's channel and dispatcher on a loop in a thread.

    The same code as vgpud's upcall path (GenlChannel + Dispatcher), run in
    the test process so that the test can look at what the policy saw.
    """

    def __init__(self, policy: Recorder) -> None:
        self.policy = policy
        self.dispatcher = Dispatcher(policy)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.channel: GenlChannel | None = None

    def call(self, coro):  # runs a coroutine on the daemon's loop
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def __enter__(self) -> InProcessDaemon:
        self.thread.start()

        async def start() -> GenlChannel:
            ch = await GenlChannel.open(self.dispatcher)
            await ch.register()
            await ch.set_filter(self.policy.filter())
            return ch

        self.channel = self.call(start())
        return self

    def stats(self) -> Stats:
        assert self.channel is not None
        return self.call(self.channel.get_stats())

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            assert self.channel is not None
            await self.channel.unregister()
            self.channel.close()

        self.call(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def wait_for(pred: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def placement_masked(params: bytes | None) -> bytes | None:
    """Memory alloc params with offset, limit and address (where nvsim put it) zeroed."""
    if params is None or len(params) != 128:
        return params
    return params[:80] + bytes(24) + params[104:]


def scripted_sequence(nodes: nv.NvNodes) -> list[tuple]:
    """Client, device, subdevice, memory, control, frees: every result, in order."""
    out: list[tuple] = []
    ctl = nodes.open_ctl()
    try:
        c, d, s, m = 0xC1000001, 0xD0000001, 0x50000001, 0xE0000001
        for args in ((0, 0, c, 0x41, None), (c, c, d, 0x80, nv.device_params(0)),
                     (c, d, s, 0x2080, nv.subdevice_params(0)),
                     (c, d, m, MEM_LOCAL, nv.memory_params(64 * MiB)),
                     (c, d, m + 1, 0x50A0, nv.memory_params(256 * MiB)),
                     (c, d, m + 2, 0x9999, None)):
            r = nv.rm_alloc(ctl, *args)
            out.append(("alloc", r.errno, r.status, r.handle, placement_masked(r.params)))
        out.append(("fbinfo", *nv.fb_get_info_v2(ctl, c, s, [7, 8, 9, 0x16, 0x20])))
        out.append(("control-bad", *nv.rm_control(ctl, c, s, 0x2080DEAD, b"\0" * 8)))
        out.append(("free-mem", *nv.rm_free(ctl, c, d, m)))
        out.append(("free-again", *nv.rm_free(ctl, c, d, m)))
        out.append(("free-client", *nv.rm_free(ctl, 0, 0, c)))
        out.append(("version", *nv.check_version(ctl)))
    finally:
        os.close(ctl)
    return out


def test_same_results_through_vgpu_as_direct(vgpu: Path, nvsim: Path) -> None:
    direct = scripted_sequence(nv.NvNodes(str(nvsim)))
    assert direct[3][1:3] == (0, 0)  # the memory alloc itself succeeded
    via_fast = scripted_sequence(nv.NvNodes(str(vgpu)))
    assert via_fast == direct
    # And with the daemon routing memory allocs through the slow path.
    with InProcessDaemon(Recorder({MEM_LOCAL})) as daemon:
        via_slow = scripted_sequence(nv.NvNodes(str(vgpu)))
        assert len(daemon.policy.requests) == 1
    assert via_slow == direct


def test_filtered_allocs_reach_daemon_with_size_and_opener(vgpu: Path) -> None:
    nodes = nv.NvNodes(str(vgpu))
    sizes = [1 * MiB, 3 * MiB, 17 * MiB, 64 * MiB]
    with InProcessDaemon(Recorder({MEM_LOCAL})) as daemon:
        ctl = nodes.open_ctl()
        try:
            tree = nv.build_tree(ctl)
            handles = []
            for i, size in enumerate(sizes):
                r = nv.alloc_memory(ctl, tree.client, tree.device, size,
                                    size64=bool(i % 2), xfer=i == 3)
                assert (r.errno, r.status) == (0, 0)
                handles.append(r.handle)
            # Virtual memory (0x50A0) is not filtered: it never reaches the daemon.
            nv.must(nv.alloc_memory(ctl, tree.client, tree.device, MiB, hclass=0x50A0), "va")
            wait_for(lambda: sum(isinstance(e, PostEvent) for e in daemon.policy.events) == 4)
        finally:
            os.close(ctl)
        wait_for(lambda: any(isinstance(e, CloseEvent) for e in daemon.policy.events))

    reqs = daemon.policy.requests
    assert [type(r.call) for r in reqs] == [RmAlloc] * 4
    assert [r.call.h_class for r in reqs] == [MEM_LOCAL] * 4
    assert [r.call.alloc.size for r in reqs] == sizes
    assert reqs[3].upcall.flags & 1  # came wrapped in IOCTL_XFER_CMD
    me = os.getpid()
    for r in reqs:
        assert (r.upcall.opener.tgid, r.upcall.caller_tgid) == (me, me)
        assert r.upcall.opener.uid == os.geteuid()
        assert r.upcall.opener.cgroup_id != 0
    posts = [e for e in daemon.policy.events if isinstance(e, PostEvent)]
    assert [p.upcall_id for p in posts] == [r.upcall.id for r in reqs]
    assert all(p.ret == 0 for p in posts)
    # The POST carries the params after the call: the new handle and status 0.
    assert [struct.unpack_from("<I", p.params, 8)[0] for p in posts] == handles
    closes = [e for e in daemon.policy.events if isinstance(e, CloseEvent)]
    assert [c.ctx_id for c in closes] == [reqs[0].upcall.ctx_id]


def test_fail_status_verdict_is_an_out_of_memory_without_a_driver_call(
        vgpu: Path, nvsim: Path) -> None:
    def deny_big(req: Request) -> Verdict:
        call = req.call
        assert isinstance(call, RmAlloc)
        if isinstance(call.alloc, MemoryAllocParams) and call.alloc.size > 8 * MiB:
            return Verdict.fail_status(NvStatus.NO_MEMORY, call.status_off)
        return ALLOW

    nodes, direct = nv.NvNodes(str(vgpu)), nv.NvNodes(str(nvsim))
    with InProcessDaemon(Recorder({MEM_LOCAL}, deny_big)):
        ctl, dctl = nodes.open_ctl(), direct.open_ctl()
        try:
            tree = nv.build_tree(ctl)
            dtree = nv.build_tree(dctl)
            free0 = nv.heap_free_kib(dctl, dtree)
            for size64 in (False, True):
                r = nv.alloc_memory(ctl, tree.client, tree.device, 64 * MiB,
                                    handle=0xE00000AA, size64=size64)
                assert (r.errno, r.status) == (0, NvStatus.NO_MEMORY)
                # nvsim never saw it: no object, no capacity taken.
                assert nv.rm_free(ctl, tree.client, tree.device, 0xE00000AA)[1] != 0
                assert nv.heap_free_kib(dctl, dtree) == free0
            ok = nv.alloc_memory(ctl, tree.client, tree.device, 4 * MiB)
            assert (ok.errno, ok.status) == (0, 0)
            assert nv.heap_free_kib(dctl, dtree) == free0 - 4096
        finally:
            os.close(ctl)
            os.close(dctl)


def test_fd_arguments_through_vgpu_name_emulated_files_only(vgpu: Path, nvsim: Path) -> None:
    """fd fields (REGISTER_FD, RM_MAP_MEMORY) name emulated files: the driver
    sees a proxy of ours. A direct nvsim fd or /dev/null reaches it as -1 and
    is refused; two emulated nvidia0 files map the same memory's pages."""
    nodes, direct = nv.NvNodes(str(vgpu)), nv.NvNodes(str(nvsim))
    ctl, gpu, gpu2 = nodes.open_ctl(), nodes.open_gpu(0), nodes.open_gpu(0)
    dctl, dgpu = direct.open_ctl(), direct.open_gpu(0)
    null = os.open("/dev/null", os.O_RDWR)
    maps: list[mmap.mmap] = []
    try:
        proxies0 = int(Path("/sys/module/vgpu/parameters/proxies").read_text())
        # Neither a driver file the caller holds nor any other file passes.
        assert nv.register_fd(gpu, dctl) == errno.EINVAL
        assert nv.register_fd(gpu, null) == errno.EINVAL
        # The emulated ctl fd is translated; the driver takes the proxy.
        assert nv.register_fd(gpu, ctl) == 0
        # nvsim resolves as NVIDIA does: a control minor for REGISTER_FD.
        assert nv.register_fd(dgpu, dctl) == 0
        assert nv.register_fd(gpu2, gpu) == errno.EINVAL
        tree = nv.build_tree(ctl)
        r = nv.alloc_memory(ctl, tree.client, tree.device, 2 * MiB)
        nv.must(r, "alloc")
        for fd in (dgpu, null, ctl):
            res = nv.rm_map_memory(ctl, tree.client, tree.device, r.handle, 0, 2 * MiB, fd)
            assert (res.errno, res.status) == (0, nv.NV_ERR_INVALID_ARGUMENT), fd
        # One mapping context per file: the same object through two files.
        _, m1 = nv.map_and_mmap(ctl, gpu, tree.client, tree.device, r.handle, 2 * MiB)
        maps.append(m1)
        _, m2 = nv.map_and_mmap(ctl, gpu2, tree.client, tree.device, r.handle, 2 * MiB)
        maps.append(m2)
        m1[4096:4096 + 11] = b"hello nvsim"
        assert m2[4096:4096 + 11] == b"hello nvsim"
        m2[-5:] = b"back!"
        assert m1[-5:] == b"back!"
        assert vgpu_stats()["mmaps"] >= 2
        # A proxy per translated emulated fd: REGISTER_FD x2, RM_MAP_MEMORY x3.
        proxies = int(Path("/sys/module/vgpu/parameters/proxies").read_text())
        assert proxies - proxies0 >= 5
    finally:
        for m in maps:
            m.close()
        for fd in (ctl, gpu, gpu2, dctl, dgpu, null):
            os.close(fd)


def vgpu_stats() -> dict[str, int]:
    """The module's counters, read as vgpuctl module-stats reads them."""
    return asdict(asyncio.run(query_module_stats()))


WAITER = r"""
import sys
from tests.support import nvclient as nv
nodes = nv.NvNodes({vgpu!r})
ctl = nodes.open_ctl()
tree = nv.build_tree(ctl)
print("ready", flush=True)
sys.stdin.readline()
r = nv.alloc_memory(ctl, tree.client, tree.device, 1 << 20)
print(r.errno, r.status, flush=True)
"""


@pytest.fixture
def waiters(vgpu: Path) -> Iterator[Callable[[int], list[subprocess.Popen[str]]]]:
    """Processes that each hold a tree and, on a newline, make one filtered alloc.

    The upcall timeout is raised to 20 s so that only what a test does (a
    daemon killed, a caller killed) ends the waits, not the slow guest.
    """
    set_param("vgpu", "upcall_timeout_ms", "20000")
    procs: list[subprocess.Popen[str]] = []

    def spawn(n: int) -> list[subprocess.Popen[str]]:
        batch = []
        for _ in range(n):
            p = subprocess.Popen([sys.executable, "-c", WAITER.format(vgpu=str(vgpu))],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 cwd=ROOT)  # cwd: tests.support importable
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            batch.append(p)
        procs.extend(batch)
        return batch

    yield spawn
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def go(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()


def wait_blocked(procs: list[subprocess.Popen[str]], upcalls_before: int) -> None:
    """Every process sleeps in the module waiting for its verdict."""
    wait_for(lambda: vgpu_stats()["upcalls"] >= upcalls_before + len(procs))
    for p in procs:
        assert p.poll() is None


@pytest.mark.parametrize("fail_open", [False, True])
def test_daemon_killed_while_callers_wait(waiters, daemon_factory, fail_open: bool) -> None:
    set_param("vgpu", "fail_open", "Y" if fail_open else "N")
    daemon = daemon_factory("--filter", "alloc:0x40", entry=TEST_DAEMON).start()
    procs = waiters(4)
    before = vgpu_stats()
    daemon.proc.send_signal(signal.SIGSTOP)  # the daemon hangs...
    go(procs)
    wait_blocked(procs, before["upcalls"])
    # They sleep killable (TASK_KILLABLE, shown as D); none may stay so.
    assert all(proc_state(p.pid) == "D" for p in procs)
    daemon.kill()  # ...and dies: every waiter completes at once
    results = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    # the daemon's death ended the waits, not upcall_timeout_ms (20 s), however late
    assert vgpu_stats()["timeouts"] == before["timeouts"]
    if fail_open:
        assert results == [["0", "0"]] * 4
    else:
        assert results == [[str(errno.EHOSTDOWN), "0"]] * 4
    after = vgpu_stats()
    key = "fail_open" if fail_open else "fail_closed"
    assert after[key] - before[key] == 4
    assert after["daemon_portid"] == 0

    # The filter survived: with no daemon the policy applies at once.
    procs = waiters(1)
    go(procs)
    out = procs[0].communicate(timeout=10)[0].split()
    assert out == (["0", "0"] if fail_open else [str(errno.EHOSTDOWN), "0"])

    # A restarted daemon registers again and filtering resumes.
    daemon = daemon_factory("--policy", "deny-class:0x40", entry=TEST_DAEMON).start()
    procs = waiters(1)
    go(procs)
    assert procs[0].communicate(timeout=10)[0].split() == ["0", str(NvStatus.NO_MEMORY)]
    assert daemon.stop() == 0


def test_upcall_timeout_then_late_verdict_is_lost(waiters, daemon_factory) -> None:
    set_param("vgpu", "upcall_timeout_ms", "2000")
    daemon = daemon_factory("--filter", "alloc:0x40", entry=TEST_DAEMON).start()
    procs = waiters(2)
    before = vgpu_stats()
    daemon.proc.send_signal(signal.SIGSTOP)
    go(procs)
    t0 = time.monotonic()
    results = [p.communicate(timeout=60)[0].split() for p in procs]
    elapsed = time.monotonic() - t0
    assert results == [[str(errno.ETIMEDOUT), "0"]] * 2
    assert elapsed > 1.5  # upcall_timeout_ms=2000; no upper bound: a loaded guest wakes late
    daemon.proc.send_signal(signal.SIGCONT)  # its late verdicts are refused
    wait_for(lambda: vgpu_stats()["lost"] >= before["lost"] + 2)
    after = vgpu_stats()
    assert after["timeouts"] - before["timeouts"] == 2
    assert daemon.stop() == 0


def test_caller_killed_while_waiting_leaks_nothing(waiters, daemon_factory) -> None:
    daemon = daemon_factory("--filter", "alloc:0x40", entry=TEST_DAEMON).start()
    procs = waiters(3)
    before = vgpu_stats()
    daemon.proc.send_signal(signal.SIGSTOP)
    go(procs)
    wait_blocked(procs, before["upcalls"])
    for p in procs:
        p.kill()
        p.wait(timeout=10)  # SIGKILL ends the wait at once
    after = vgpu_stats()
    assert after["killed"] - before["killed"] == 3
    assert after["contexts"] == before["contexts"] - 3  # their files are released
    daemon.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: vgpu_stats()["lost"] >= before["lost"] + 3)
    assert daemon.stop() == 0
    # The vgpu fixture's rmmod asserts the module unloads cleanly.


def test_unload_refused_while_a_file_is_open(vgpu: Path) -> None:
    fd = os.open(vgpu / "nvidiactl", os.O_RDWR)
    try:
        res = subprocess.run(["rmmod", "vgpu"], capture_output=True, text=True)
        assert res.returncode != 0
        assert Path("/sys/module/vgpu").exists()
    finally:
        os.close(fd)
    # Mapped pages keep nvsim (not vgpu) busy: vgpu unloads in the fixture.


def hostile_calls(nodes: nv.NvNodes, seed: int, count: int) -> None:
    rng = random.Random(seed)
    fds = [nodes.open_ctl(), nodes.open_gpu(0), nodes.open_uvm()]
    try:
        tree = nv.build_tree(fds[0])
        pointers = [0, 1, 0xFFFFFFFFFFFFF000, 0x7FFFFFFFF000, (1 << 63)]
        for _ in range(count):
            fd = rng.choice(fds)
            nr = rng.choice([0x2B, 0x2A, 0x29, 0x4E, 0x27, 201, 211, rng.randrange(256)])
            size = rng.choice([0, 4, 16, 32, 48, 56, 184, rng.randrange(1 << 14)])
            body = bytearray(rng.randbytes(max(size, 16)))
            if nr in (0x2B, 0x2A) and size >= 32:  # plausible handles, hostile pointers
                struct.pack_into("<II", body, 0, tree.client, tree.device)
                struct.pack_into("<Q", body, 16, rng.choice(pointers))
                struct.pack_into("<I", body, 12, rng.choice([MEM_LOCAL, 0x2080, 0x41]))
                struct.pack_into("<I", body, 24, rng.choice([0, 128, 1 << 20, 0xFFFFFFFF]))
            if nr == 211:
                struct.pack_into("<IIQ", body, 0, rng.choice([0x2B, 0x2A, 211]),
                                 rng.choice([32, 48, 16385, 0xFFFFFFFF]), rng.choice(pointers))
            buf = nv.cbuf(bytes(body))
            arg = rng.choice(pointers) if rng.random() < 0.05 else buf
            nv.raw_ioctl(fd, nv.ioc(nr, size), arg)
    finally:
        for fd in fds:
            os.close(fd)


def test_hostile_input_through_the_slow_path(vgpu: Path) -> None:
    nodes = nv.NvNodes(str(vgpu))
    with InProcessDaemon(Recorder({MEM_LOCAL, 0x2080, 0x41})) as daemon:
        before = daemon.stats()
        hostile_calls(nodes, seed=1, count=10_000)
        after = daemon.stats()
        assert after.ioctls - before.ioctls >= 10_000
        assert after.upcalls > before.upcalls  # the fuzz reached the slow path
        assert daemon.dispatcher.counters.policy_errors == 0
    dmesg = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
    assert "WARNING" not in dmesg and "BUG" not in dmesg
    assert vgpu_stats()["contexts"] == 0
