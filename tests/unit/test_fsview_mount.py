"""The file view mounted for real on the host (/dev/fuse; the tests run as root).

A Manager without the kernel module (tests.support.bus) behind FsView, its
loop in a thread as the daemon's; files read and written with real file I/O
as root, as a member of the admin group and as another user.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.support.bus import make_manager, write_config
from tests.support.contexts import close_context, open_context, usage_changed
from tests.support.workloads import writes
from vgpud.admin.manager import Manager
from vgpud.core.ledger import Key, Reservation
from vgpud.fsview.mountfd import REPLY_MAX, HelperError, decode_reply, request
from vgpud.fsview.ops import MAX_HANDLES_PER_UID
from vgpud.fsview.service import FsView, context_views
from vgpud.fsview.snapshot import ContextView
from vgpud.fsview.values import MAX_WRITE
from vgpud.kernel.uapi import Context, Node
from vgpud.store.config import FsSettings
from vgpud.store.state import load_state
from vgpud.wire import read_frame

T = TypeVar("T")
ADMIN_GROUP, ADMIN_GID = "users", 100  # an admin group every Debian has
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                                reason="needs root and /dev/fuse")


class Shares:
    def share(self, tenant: str) -> dict[int, float]:
        return {0: 50.0} if tenant == "alice" else {}

    def measured_share(self, tenant: str) -> dict[int, float]:
        return {}


class Served:
    """FsView over ``manager``, its event loop in a thread (as the daemon's)."""

    def __init__(self, manager: Manager, mountpoint: Path, peaks: Path | None = None) -> None:
        self.manager = manager
        self.mountpoint = mountpoint
        self.loop = asyncio.new_event_loop()
        self.view = FsView(manager, manager._ledger, Shares(), FsSettings(mountpoint=mountpoint),
                           peaks_path=peaks)
        manager.observers.subscribe(self.view)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        assert self.run(self.view.start())

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        async def run() -> T:
            return fn(*args)
        return self.run(run())

    def close(self) -> None:
        self.run(self.view.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    def path(self, tenant: str, name: str) -> Path:
        return self.mountpoint / "tenants" / tenant / name


@pytest.fixture
def public() -> Iterator[Path]:
    """A directory every user may traverse (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="vgpud-fs-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def served(tmp_path: Path, public: Path) -> Iterator[Served]:
    served = Served(make_manager(write_config(tmp_path, admin_group=ADMIN_GROUP)),
                    public / "fs")
    yield served
    served.close()
    assert not is_mounted(public / "fs")


def is_mounted(path: Path) -> bool:
    return any(line.split()[4] == str(path)
               for line in Path("/proc/self/mountinfo").read_text().splitlines())


def as_user(uid: int, *groups: int, code: str) -> subprocess.CompletedProcess[str]:
    ids = ["--reuid", str(uid), "--regid", str(uid)]
    ids += ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    return subprocess.run(["setpriv", *ids, sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=30)


def try_write(path: Path, data: str) -> str:
    return (f"import os\ntry:\n open({str(path)!r}, 'w').write({data!r}); print('ok')\n"
            "except OSError as e: print(os.strerror(e.errno))")


def test_tree_and_modes(served: Served) -> None:
    root = served.mountpoint
    assert sorted(os.listdir(root)) == ["gpus", "tenants"]
    assert sorted(os.listdir(root / "tenants")) == ["alice", "bob.x-1", "shared"]
    st = os.stat(served.path("alice", "dmem.max"))
    assert (oct(st.st_mode), st.st_uid, st.st_gid) == ("0o100664", 0, ADMIN_GID)
    st = os.stat(served.path("alice", "dmem.current"))
    assert (oct(st.st_mode), st.st_uid, st.st_gid) == ("0o100444", 0, 0)
    assert oct(os.stat(root / "tenants" / "alice").st_mode) == "0o40555"
    line = next(x for x in Path("/proc/self/mountinfo").read_text().splitlines()
                if x.split()[4] == str(root))
    assert "nosuid" in line and "nodev" in line and "noexec" in line
    assert "default_permissions" in line and "allow_other" in line


def test_reads_show_the_manager(served: Served) -> None:
    gib = 2**30
    assert served.path("alice", "dmem.max").read_text() == (
        f"nvidia/gpu0/vidmem {8 * gib}\nnvidia/gpu1/vidmem {8 * gib}\n")
    assert served.path("bob.x-1", "dmem.max").read_text() == (
        f"nvidia/gpu0/vidmem 0\nnvidia/gpu1/vidmem {40 * gib}\n")
    assert served.path("shared", "dmem.max").read_text() == (
        "nvidia/gpu0/vidmem max\nnvidia/gpu1/vidmem max\n")
    assert served.path("bob.x-1", "gpu.weight").read_text() == "300\n"
    assert served.path("alice", "gpu.share").read_text() == (
        "nvidia/gpu0 target=50.0 measured=0.0\nnvidia/gpu1 target=0.0 measured=0.0\n")
    assert (served.mountpoint / "gpus").read_text().splitlines()[0] == (
        f"nvidia/gpu0 index=0 total={80 * gib} name=NVIDIA H100 (sim)")
    out = as_user(65534, code=f"print(open({str(served.path('alice', 'gpu.max'))!r}).read())")
    assert out.stdout == "max\n\n"


def test_usage_peak_and_contexts_follow_the_ledger(served: Served) -> None:
    ledger, manager = served.manager._ledger, served.manager

    def allocate(size: int) -> None:
        open_context(manager, ledger, 1, "alice")
        reservation = ledger.reserve(1, 0, size)
        assert isinstance(reservation, Reservation)
        ledger.commit(reservation, Key(1, 2))
        usage_changed(manager, "alice")

    served.call(allocate, 12345)
    assert served.path("alice", "dmem.current").read_text() == (
        "nvidia/gpu0/vidmem 12345\nnvidia/gpu1/vidmem 0\n")
    live = [Context(1, 0, Node.GPU, 0, 500, 499, 1000, 1000)]
    assert context_views(ledger, live) == {"alice": (ContextView(1, 500, 499, 1000, 0, 12345),)}
    assert context_views(ledger, []) == {"alice": (ContextView(1, None, None, None, None, 12345),)}
    served.call(close_context, manager, ledger, 1)
    assert served.path("alice", "dmem.current").read_text() == (
        "nvidia/gpu0/vidmem 0\nnvidia/gpu1/vidmem 0\n")
    assert served.path("alice", "dmem.peak").read_text() == (
        "nvidia/gpu0/vidmem 12345\nnvidia/gpu1/vidmem 0\n")


def test_the_peaks_outlive_a_restart(tmp_path: Path, public: Path) -> None:
    """A daemon restart keeps dmem.peak as it keeps the charges: saved at
    stop, loaded at start; a tenant gone from the config is not kept."""
    peaks = tmp_path / "fs-peaks.json"
    config = write_config(tmp_path, admin_group=ADMIN_GROUP)
    first = Served(make_manager(config), public / "fs", peaks)
    try:
        ledger, manager = first.manager._ledger, first.manager

        def allocate() -> None:
            open_context(manager, ledger, 1, "alice")
            reservation = ledger.reserve(1, 1, 4096)
            assert isinstance(reservation, Reservation)
            ledger.commit(reservation, Key(1, 2))
            usage_changed(manager, "alice")
            close_context(manager, ledger, 1)

        first.call(allocate)
        assert first.path("alice", "dmem.current").read_text().endswith("vidmem 0\n")
    finally:
        first.close()
    saved = json.loads(peaks.read_text())
    assert saved["alice"] == [0, 4096] and oct(peaks.stat().st_mode) == "0o100600"
    saved["gone"] = [1, 2]
    peaks.write_text(json.dumps(saved))
    second = Served(make_manager(config), public / "fs", peaks)
    try:
        assert second.path("alice", "dmem.peak").read_text() == (
            "nvidia/gpu0/vidmem 0\nnvidia/gpu1/vidmem 4096\n")
    finally:
        second.close()
    assert "gone" not in json.loads(peaks.read_text())


def test_root_write_goes_through_the_manager(served: Served, tmp_path: Path) -> None:
    assert writes(served.path("alice", "dmem.max"), b"nvidia/gpu0/vidmem 4096\n") == [24]
    assert str(served.call(served.manager.tenant, "alice").memory) == "4KiB"
    assert served.path("alice", "dmem.max").read_text() == (
        "nvidia/gpu0/vidmem 4096\nnvidia/gpu1/vidmem 4096\n")
    assert writes(served.path("alice", "gpu.weight"), b"700\n") == [4]
    assert writes(served.path("alice", "gpu.max"), b"30\n") == [3]
    alice = load_state(tmp_path / "state.json").tenants(served.manager.config.tenants)[0]
    assert (alice.name, str(alice.memory), alice.weight, alice.cap) == ("alice", "4KiB", 700, 30)
    assert writes(served.path("alice", "gpu.max"), b"max") == [3]
    assert served.path("alice", "gpu.max").read_text() == "max\n"


def test_admin_group_member_may_write_others_may_not(served: Served) -> None:
    weight = served.path("alice", "gpu.weight")
    assert as_user(4242, ADMIN_GID, code=try_write(weight, "250\n")).stdout == "ok\n"
    assert weight.read_text() == "250\n"
    for groups in ((), (4242,)):
        out = as_user(4242, *groups, code=try_write(weight, "900\n"))
        assert out.stdout == "Permission denied\n"
    assert weight.read_text() == "250\n"
    assert served.call(served.manager.tenant, "alice").weight == 250


@pytest.mark.parametrize(("name", "data"), [
    ("gpu.weight", b"0\n"),  # out of range: the Manager's InvalidArgument
    ("gpu.weight", b"abc\n"),
    ("gpu.max", b"101\n"),
    ("dmem.max", b"0\n"),
    ("dmem.max", b"nvidia/gpu9/vidmem 4096\n"),
    ("dmem.max", b"4096\x00\n"),
    ("dmem.max", b"4" * (MAX_WRITE + 1)),
    ("dmem.max", b"4" * 2**20),
])
def test_bad_value_is_einval_and_changes_nothing(served: Served, name: str,
                                                 data: bytes) -> None:
    before = {f: served.path("alice", f).read_text() for f in ("dmem.max", "gpu.weight",
                                                              "gpu.max")}
    assert writes(served.path("alice", name), data) == ["EINVAL"]
    assert {f: served.path("alice", f).read_text() for f in before} == before


def test_partial_writes_change_nothing(served: Served) -> None:
    path = served.path("alice", "dmem.max")
    assert writes(path, b"nvidia/gpu0/vid", b"mem 4096\n") == ["EINVAL", "EINVAL"]
    assert writes(path, b"4096", b"\n") == [4, "EINVAL"]  # each write is one whole value
    assert str(served.call(served.manager.tenant, "alice").memory) == "4KiB"


def test_read_only_files_and_tree_refuse_root(served: Served) -> None:
    with pytest.raises(PermissionError):
        writes(served.path("alice", "dmem.current"), b"0\n")
    with pytest.raises(PermissionError):
        writes(served.path("alice", "gpu.priority"), b"priority\n")
    with pytest.raises(OSError):
        (served.mountpoint / "tenants" / "mallory").mkdir()
    with pytest.raises(OSError):
        served.path("alice", "gpu.weight").unlink()
    with pytest.raises(FileNotFoundError):
        served.path("nobody", "gpu.weight").read_text()


def test_one_user_holding_files_open_does_not_lock_out_others(served: Served) -> None:
    path = served.path("alice", "gpu.weight")
    code = ("import os, sys\nfds = []\ntry:\n"
            f" while len(fds) < {MAX_HANDLES_PER_UID + 1}: fds.append(os.open({str(path)!r}, 0))\n"
            "except OSError as e: print(len(fds), os.strerror(e.errno), flush=True)\n"
            "sys.stdin.read()")
    holder = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdin is not None
    try:
        assert holder.stdout.readline() == f"{MAX_HANDLES_PER_UID} Too many open files in system\n"
        assert path.read_text() == "100\n"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert as_user(65534, code=f"print(open({str(path)!r}).read())").stdout == "100\n\n"


def test_racing_opens_stop_at_the_cap(served: Served) -> None:
    """Eight threads of one user open at once, twice the cap between them:
    exactly the cap succeeds (the FUSE loop serves one request at a time),
    the rest get ENFILE, and all of it is returned at close."""
    path = served.path("alice", "gpu.weight")
    code = ("import os, threading\nfrom collections import Counter\n"
            "got, lock, go = Counter(), threading.Lock(), threading.Barrier(8)\n"
            "fds = []\n"
            "def opener():\n"
            " go.wait()\n"
            f" for _ in range({MAX_HANDLES_PER_UID // 4}):\n"
            "  try:\n"
            f"   fd = os.open({str(path)!r}, 0)\n"
            "  except OSError as e:\n"
            "   with lock: got[os.strerror(e.errno)] += 1\n"
            "  else:\n"
            "   with lock: got['ok'] += 1; fds.append(fd)\n"
            "ts = [threading.Thread(target=opener) for _ in range(8)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\n"
            "[os.close(fd) for fd in fds]\n"
            "print(sorted(got.items()))\n")
    want = (f"[('Too many open files in system', {MAX_HANDLES_PER_UID}), "
            f"('ok', {MAX_HANDLES_PER_UID})]\n")
    assert as_user(65534, code=code).stdout == want
    # Again: every handle was given back (the kernel sends RELEASE after
    # close() returns, so the second round may have to wait for it).
    deadline = time.monotonic() + 20
    while (got := as_user(65534, code=code).stdout) != want and time.monotonic() < deadline:
        time.sleep(0.5)
    assert got == want


def test_a_read_is_one_snapshot(served: Served) -> None:
    path = served.path("alice", "dmem.max")
    with open(path, "rb", buffering=0) as f:
        first = f.read(10)
        assert writes(path, b"max\n") == [4]
        rest = f.read()
    assert (first + rest).decode() == f"nvidia/gpu0/vidmem {2**33}\nnvidia/gpu1/vidmem {2**33}\n"
    assert path.read_text() == "nvidia/gpu0/vidmem max\nnvidia/gpu1/vidmem max\n"


def test_concurrent_writers_leave_one_of_their_values(served: Served) -> None:
    path = served.path("alice", "gpu.weight")
    results: list[list[int | str]] = []

    def writer(value: int) -> None:
        for _ in range(25):
            results.append(writes(path, f"{value}\n".encode()))

    threads = [threading.Thread(target=writer, args=(v,)) for v in range(101, 109)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r in ([4],) for r in results) and len(results) == 200
    shown = int(path.read_text())
    assert 101 <= shown <= 108
    assert served.call(served.manager.tenant, "alice").weight == shown


def handler_address(sig: int) -> int | None:
    """The handler the kernel has for ``sig`` (struct sigaction's first field)."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(256)
    assert libc.sigaction(sig, None, buf) == 0
    return ctypes.c_void_p.from_buffer(buf).value


def test_libfuse_keeps_the_daemons_signal_handlers(tmp_path: Path) -> None:
    """The daemon handles TERM, INT and HUP before it mounts; libfuse only
    installs its own where a handler is SIG_DFL, and so changes none."""
    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE)
    saved = {s: signal.getsignal(s) for s in sigs}
    try:
        for s in sigs[:3]:
            signal.signal(s, lambda *_: None)
        before = {s: handler_address(s) for s in sigs}
        served = Served(make_manager(write_config(tmp_path)), tmp_path / "fs")
        try:
            assert {s: handler_address(s) for s in sigs} == before
        finally:
            served.close()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


DAEMON_SIDE = """
import asyncio, sys
from pathlib import Path
from tests.support.bus import make_manager
from vgpud.fsview.mountfd import has_cap_sys_admin
from vgpud.fsview.service import FsView, context_views
from vgpud.fsview.snapshot import ContextView
from vgpud.store.config import FsSettings

class Shares:
    def share(self, t): return {}
    def measured_share(self, t): return {}

async def main():
    manager = make_manager(Path(sys.argv[1]))
    view = FsView(manager, manager._ledger, Shares(), FsSettings(mountpoint=Path("/nonexistent")),
                  helper_socket=Path(sys.argv[2]))
    manager.observers.subscribe(view)
    print("cap_sys_admin", has_cap_sys_admin(), flush=True)
    print("started", await view.start(), view.mountpoint, flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await view.stop()
    print("stopped", flush=True)

asyncio.run(main())
"""


@pytest.fixture
def helper(tmp_path: Path, public: Path) -> Iterator[Path]:
    """vgpud-fsmount serving a socket, for a config whose mountpoint is public/view."""
    config = write_config(tmp_path, admin_group=ADMIN_GROUP)
    config.write_text(config.read_text() + f'\n[fs]\nmountpoint = "{public / "view"}"\n')
    sock = public / "fsmount.sock"
    proc = subprocess.Popen([sys.executable, "-c", "from vgpud.fsview.helper import main; main()",
                             "--config", str(config), "--listen", str(sock)],
                            stderr=subprocess.PIPE, text=True)
    for _ in range(200):
        if sock.exists():
            break
        threading.Event().wait(0.05)
    yield sock
    proc.terminate()
    proc.wait(timeout=10)


def test_unprivileged_daemon_serves_through_the_helper(helper: Path, tmp_path: Path,
                                                      public: Path) -> None:
    where = public / "view"
    assert oct(helper.stat().st_mode & 0o777) == "0o600"
    child = subprocess.Popen(
        ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin",
         sys.executable, "-c", DAEMON_SIDE, str(tmp_path / "vgpud.toml"), str(helper)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline() == "cap_sys_admin False\n"
        assert child.stdout.readline() == f"started True {where}\n"
        line = next(x for x in Path("/proc/self/mountinfo").read_text().splitlines()
                    if x.split()[4] == str(where))
        assert "fuse.vgpud" in line and "default_permissions" in line and "allow_other" in line
        assert "nosuid" in line and "nodev" in line and "noexec" in line
        assert writes(where / "tenants" / "alice" / "gpu.weight", b"42\n") == [3]
        assert (where / "tenants" / "alice" / "gpu.weight").read_text() == "42\n"
        out = as_user(65534, code=try_write(where / "tenants" / "alice" / "gpu.weight", "9"))
        assert out.stdout == "Permission denied\n"
        child.stdin.close()
        assert child.stdout.readline() == "stopped\n"
    finally:
        child.kill()
        child.wait()
    assert not is_mounted(where)


def test_a_killed_daemons_dead_mount_is_replaced(helper: Path, tmp_path: Path,
                                                 public: Path) -> None:
    """SIGKILL leaves the view mounted with no one serving it (ENOTCONN to
    every lookup); the restarted daemon's helper request replaces it."""
    where = public / "view"

    def daemon() -> subprocess.Popen[str]:
        child = subprocess.Popen(
            ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin",
             sys.executable, "-c", DAEMON_SIDE, str(tmp_path / "vgpud.toml"), str(helper)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=Path(__file__).parents[2])
        assert child.stdout is not None
        assert child.stdout.readline() == "cap_sys_admin False\n"
        assert child.stdout.readline() == f"started True {where}\n"
        return child

    first = daemon()
    first.kill()
    first.wait()
    with pytest.raises(OSError) as dead:
        (where / "gpus").stat()
    assert dead.value.errno == errno.ENOTCONN
    second = daemon()
    try:
        assert (where / "tenants" / "alice" / "gpu.weight").read_text() == "100\n"
    finally:
        assert second.stdin is not None
        second.stdin.close()
        second.wait(timeout=30)
    assert not is_mounted(where)


def test_helper_refuses_other_users_and_other_descriptors(helper: Path, public: Path) -> None:
    os.chmod(helper, 0o666)  # so that the kernel lets the other user connect: the helper judges
    code = ("import os, sys\nfrom pathlib import Path\nfrom vgpud.fsview.mountfd import request\n"
            f"try: request('mount', os.open('/dev/fuse', os.O_RDWR), Path({str(helper)!r}))\n"
            "except Exception as e: print(e)")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, cwd=Path(__file__).parents[2])
    assert out.stdout == "vgpud-fsmount: ERR uid 65534 is not root\n"
    with open("/dev/null", "rb") as null, pytest.raises(HelperError, match="not /dev/fuse"):
        request("mount", null.fileno(), helper)
    with pytest.raises(HelperError, match="takes one descriptor"):
        request("mount", None, helper)
    with pytest.raises(HelperError, match="unknown request"):
        request("mount /etc", None, helper)
    assert not is_mounted(public / "view")


@pytest.mark.parametrize(("sent", "says"), [
    (b"mount\n", "malformed request: the stream ended"),  # the old one-line request
    (b"mount please\n", "malformed request: no frame header"),
    (b"VGW\x02\x0e\x00\x00\x00" + b'{"op":"mount"}', "malformed request: wire format version 2"),
    (b"VGW\x01\xff\xff\x00\x00" + b"{", "malformed request: a frame of 65535 bytes"),
    (b"VGW\x01\x0e\x00\x00\x00" + b'{"op":"mount"', "malformed request: the stream ended"),
    (b"VGW\x01\x05\x00\x00\x00" + b"mount", "malformed request: not a JSON body"),
])
def test_helper_answers_what_is_no_request_and_lives_on(helper: Path, public: Path,
                                                        sent: bytes, says: str) -> None:
    """Bytes that are no request (with a /dev/fuse descriptor): answered
    ERR, nothing mounted, the descriptor closed, the next request served."""
    with socket.socket(socket.AF_UNIX) as sock, open("/dev/fuse", "rb") as fuse:
        sock.settimeout(30)
        sock.connect(str(helper))
        socket.send_fds(sock, [sent], [fuse.fileno()])
        sock.shutdown(socket.SHUT_WR)
        body = read_frame(sock.recv, REPLY_MAX)
    assert body is not None
    ok, text = decode_reply(body)
    assert not ok and text.startswith(says), text
    assert not is_mounted(public / "view")
    with pytest.raises(HelperError, match="takes one descriptor"):
        request("mount", None, helper)
