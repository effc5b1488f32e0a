"""libnvtrace.so on this machine: no NVIDIA driver, so the traced "nodes" are plain
files under a prefix of our own (NVTRACE_PREFIXES). ioctl on a plain file fails
(ENOTTY) after the recorder has read the params, which is what is tested here:
what is recorded, for whom, and that the caller sees its own result. The
driver's answers (params after the call) are tested against nvsim in
tests/vm/test_nvtrace.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TypeVar

import pytest

from tools.nvtrace.calls import Ioctl, Mmap, Opened, events
from tools.nvtrace.fmt import Kind, Meta, OpenHow, Tag, Trace, read_trace

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "tools/nvtrace/libnvtrace.so"
T = TypeVar("T")

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

PRELUDE = """\
import ctypes, errno, os, struct, sys, threading
libc = ctypes.CDLL(None, use_errno=True)  # the global namespace, as a C program calls it
libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
def iowr(nr, size):
    return (3 << 30) | (size << 16) | (ord("F") << 8) | nr
def ioctl(fd, req, arg):
    ctypes.set_errno(0)
    rc = libc.ioctl(fd, req, arg)
    return rc, ctypes.get_errno()
D = sys.argv[1]
"""


@pytest.fixture(scope="module")
def lib() -> Path:
    subprocess.run(["make", "-s", "-C", str(LIB.parent)], check=True)
    return LIB


def record(lib: Path, tmp: Path, body: str, **env: str) -> list[Trace]:
    """Run a Python program under the recorder; its traces, by file name."""
    nodes, out = tmp / "dev", tmp / "out"
    nodes.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    for name in ("nvidiactl", "nvidia0", "nvidia-uvm", "other"):
        (nodes / name).write_bytes(bytes(8192))
    script = tmp / "prog.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    full = {**os.environ, "LD_PRELOAD": str(lib), "NVTRACE_DIR": str(out),
            "NVTRACE_PREFIXES": f"/nonexistent:{nodes}/nvidia", **env}
    res = subprocess.run([sys.executable, str(script), str(nodes)], env=full,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [read_trace(p) for p in sorted(out.iterdir())]


def some(value: T | None) -> T:
    assert value is not None
    return value


def ioctls(trace: Trace) -> list[Ioctl]:
    return [ev for ev in events(trace) if isinstance(ev, Ioctl)]


def test_params_nested_buffers_and_the_callers_result(lib: Path, tmp_path: Path) -> None:
    (trace,) = record(lib, tmp_path, """
        fd = os.open(D + "/nvidiactl", os.O_RDWR)
        alloc_params = ctypes.create_string_buffer(bytes(range(128)), 128)
        # paramsSize 0, as libcuda sends it: the driver takes the size from the class.
        p = ctypes.create_string_buffer(struct.pack("=IIIIQII", 1, 2, 0, 0x40,
                                        ctypes.addressof(alloc_params), 0, 0), 32)
        assert ioctl(fd, iowr(0x2B, 32), ctypes.addressof(p)) == (-1, errno.ENOTTY)
        ctrl = ctypes.create_string_buffer(b"C" * 24, 24)
        p54 = ctypes.create_string_buffer(struct.pack("=IIIIQII", 1, 2, 0x20801303, 0,
                                          ctypes.addressof(ctrl), 24, 0), 32)
        x = ctypes.create_string_buffer(struct.pack("=IIQ", 0x2A, 32, ctypes.addressof(p54)), 16)
        assert ioctl(fd, iowr(211, 16), ctypes.addressof(x)) == (-1, errno.ENOTTY)
        bad = ctypes.create_string_buffer(struct.pack("=IIIIQII", 1, 2, 0, 0x40, 8, 128, 0), 32)
        assert ioctl(fd, iowr(0x2B, 32), ctypes.addressof(bad)) == (-1, errno.ENOTTY)
        assert ioctl(fd, iowr(0x2B, 32), 16) == (-1, errno.ENOTTY)
        other = os.open(D + "/other", os.O_RDWR)
        ioctl(other, iowr(0x2B, 32), ctypes.addressof(p))
        os.close(fd)
    """)
    assert trace.name.endswith(f"-{trace.header.pid}.nvtrace")
    assert trace.header.value(Meta.PREFIXES).endswith("/dev/nvidia")
    opened = [ev for ev in events(trace) if isinstance(ev, Opened)]
    assert [ev.node.name for ev in opened] == ["nvidiactl"]  # "other" is not traced
    alloc, ctrl, bad, bad_arg = ioctls(trace)
    assert (alloc.nr, alloc.xfer, alloc.err, alloc.ret) == (0x2B, False, 25, -1)
    assert some(alloc.params_in)[12:16] == (0x40).to_bytes(4, "little")
    # The alloc params: a window of NVTRACE_WINDOW bytes whatever paramsSize
    # says, read as the driver reads them: the 128 bytes of their class.
    assert some(alloc.record.block(Tag.PTR)).want == trace.header.window == 4096
    assert alloc.data_in is not None and alloc.data_in.data == bytes(range(128))
    assert alloc.data_out is not None and alloc.data_out.data == bytes(range(128))
    assert (ctrl.nr, ctrl.xfer) == (0x2A, True)
    assert some(ctrl.params_in)[8:12] == (0x20801303).to_bytes(4, "little")
    assert ctrl.data_in is not None and ctrl.data_in.data == b"C" * 24
    assert bad.data_in is not None and bad.data_in.fault and bad.data_in.addr == 8
    assert bad_arg.params_in is None and some(bad_arg.record.block(Tag.ARG)).fault
    assert [r.kind for r in trace.records][-1] == Kind.CLOSE


def test_window_mmap_dup_and_truncation(lib: Path, tmp_path: Path) -> None:
    (trace,) = record(lib, tmp_path, """
        import mmap
        uvm = os.open(D + "/nvidia-uvm", os.O_RDWR)
        buf = ctypes.create_string_buffer(64)
        ioctl(uvm, 0x30000001, ctypes.addressof(buf))
        gpu = os.open(D + "/nvidia0", os.O_RDWR)
        m = mmap.mmap(gpu, 4096, mmap.MAP_SHARED, mmap.PROT_READ, offset=4096)
        os.dup2(gpu, 50)
        big = ctypes.create_string_buffer(32)
        ioctl(50, iowr(0x2A, 32), ctypes.addressof(big))
        os.close(50)
    """, NVTRACE_WINDOW="48", NVTRACE_MAX_BLOCK="16")
    evs = list(events(trace))
    uvm_call = next(ev for ev in evs if isinstance(ev, Ioctl) and ev.node.name == "nvidia-uvm")
    assert uvm_call.nr == 0x30000001 and not uvm_call.nvidia
    arg = some(uvm_call.record.block(Tag.ARG))
    assert arg.want == 48 and len(arg.data) == 16 and arg.trunc  # window, then max_block
    mm = next(ev for ev in evs if isinstance(ev, Mmap))
    assert (mm.node.name, mm.length, mm.offset, mm.ok) == ("nvidia0", 4096, 4096, True)
    dup = next(ev for ev in evs if isinstance(ev, Opened) and ev.fd == 50)
    assert dup.record.args[2] == OpenHow.DUP and dup.node.name == "nvidia0"
    call50 = next(ev for ev in evs if isinstance(ev, Ioctl) and ev.fd == 50)
    assert call50.params_in is None and some(call50.record.block(Tag.ARG)).trunc
    assert any(r.kind == Kind.CLOSE and r.fd == 50 for r in trace.records)
    assert trace.header.window == 48 and trace.header.max_block == 16


def test_threads_records_stay_whole(lib: Path, tmp_path: Path) -> None:
    (trace,) = record(lib, tmp_path, """
        fd = os.open(D + "/nvidiactl", os.O_RDWR)
        def work(i):
            b = ctypes.create_string_buffer(bytes([i]) * 32, 32)
            for _ in range(200):
                ioctl(fd, iowr(0x2A, 32), ctypes.addressof(b))
        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts: t.start()
        for t in ts: t.join()
    """)
    calls = ioctls(trace)
    assert len(calls) == 800
    assert len({c.seq for c in calls}) == 800
    assert len({c.record.tid for c in calls}) == 4
    for c in calls:  # each record's blocks belong to its own thread's buffer
        assert c.params_in == c.params_out and len(set(some(c.params_in))) == 1


def test_fork_and_exec_children_get_files_of_their_own(lib: Path, tmp_path: Path) -> None:
    traces = record(lib, tmp_path, """
        import subprocess
        fd = os.open(D + "/nvidiactl", os.O_RDWR)
        b = ctypes.create_string_buffer(32)
        ioctl(fd, iowr(0x2A, 32), ctypes.addressof(b))
        pid = os.fork()
        if pid == 0:
            ioctl(fd, iowr(0x29, 16), ctypes.addressof(b))
            os._exit(0)
        os.waitpid(pid, 0)
        code = PRELUDE_CODE + "ioctl(int(sys.argv[2]), iowr(0x34, 28), 0)"
        subprocess.run([sys.executable, "-c", code, D, str(fd)], pass_fds=[fd], check=True)
    """.replace("PRELUDE_CODE", repr(PRELUDE)))
    assert len(traces) == 3
    pids = {t.header.pid for t in traces}
    (parent,) = [t for t in traces if t.header.ppid not in pids]
    assert [c.nr for c in ioctls(parent)] == [0x2A]
    children = [t for t in traces if t is not parent]
    assert sorted(c.nr for t in children for c in ioctls(t)) == [0x29, 0x34]
    for child in children:
        assert child.header.ppid == parent.header.pid
        opened = next(ev for ev in events(child) if isinstance(ev, Opened))
        assert opened.record.args[2] == OpenHow.FOUND and opened.node.name == "nvidiactl"


def test_an_app_that_closes_every_fd_keeps_its_files_intact(lib: Path, tmp_path: Path) -> None:
    traces = record(lib, tmp_path, """
        fd = os.open(D + "/nvidiactl", os.O_RDWR)
        b = ctypes.create_string_buffer(32)
        ioctl(fd, iowr(0x2A, 32), ctypes.addressof(b))
        os.closerange(3, 1000)  # our trace file too
        mine = os.open(D + "/../mine", os.O_RDWR | os.O_CREAT)
        fd = os.open(D + "/nvidiactl", os.O_RDWR)
        ioctl(fd, iowr(0x2B, 32), ctypes.addressof(b))
        os.close(fd)
        os.close(mine)
        assert open(D + "/../mine", "rb").read() == b""
    """)
    first, second = sorted(traces, key=lambda t: t.name.endswith(".1.nvtrace"))
    assert second.name == first.name.replace(".nvtrace", ".1.nvtrace")
    assert [c.nr for c in ioctls(first)] == [0x2A]
    assert [c.nr for c in ioctls(second)] == [0x2B]
    assert (tmp_path / "mine").read_bytes() == b""
