"""Item 6: the daemon read and wrote tenant memory.

FB_GET_INFO (v1) points at its {index, data} list from inside the control
params. The daemon used to read and rewrite that list with
process_vm_readv/writev, on its event loop, at the address the tenant chose:
a page whose fault never completes (userfaultfd here; a FUSE mapping that
never answers does the same) hung the whole daemon, and every tenant's
verdicts with it. Now the module copies the list in the caller's context,
sends it up as VGPU_A_DATA2, hands the driver its own copy and writes the
daemon's REPLY back in the caller's context: only the caller's thread can
wait on its own page.

The attacker (uid 1003, tests/support/attack_fblist.c) serves the faults of
its own threads and never those of anyone else, while a sibling drops the
page again and again. Another tenant (uid 1004) allocates and frees
meanwhile. Judged by the processes: the victim's calls all succeed, none
takes a second (a stalled daemon would hold each for the module's upcall
timeout, 2 s in the VM tier), and no process outside the tenant ever
faulted on its page. The victim's p99 under the attack against without it
(the issue's target: within 3x) is printed, not asserted: in a TCG guest
on a shared 2-core host it is a ratio of two p99s of a few hundred calls
each, which swung from 0.94x (docs/threat-model.md) to 3.3x between runs
of the same code (three runs on 2026-12-07: 3.2x beside another guest,
1.9x and 3.3x alone).

The race: a sibling thread flips the list entries' index between sizes
nvsim reports (RAM_SIZE, HEAP_SIZE, ...) and one it answers 0 for, for
>= 10 s and FLIP_ATTEMPTS calls. Judged by what nvsim returned to the
tenant: no entry ever carries a size over the tenant's quota (the driver
answers for the index the daemon saw, so the daemon rewrites exactly what
the driver was asked).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.guest import ROOT
from tests.support.hostile import TENANT_UID, attacker_binary, start_daemon, tenant_argv
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm

MIB = 2**20
QUOTA_MIB = 64
# FB_GET_INFO calls of the flip race (each an upcall): 609/s in the TCG guest,
# quiet (2026-12-07), so about 35 s; the attacker stops at 100 s regardless.
FLIP_ATTEMPTS = 20_000
VICTIM_UID = 1004
TENANTS = f"""\
[[tenant]]
name = "t"
memory = "{QUOTA_MIB}MiB"
match = [{{ uid = {TENANT_UID} }}]

[[tenant]]
name = "v"
memory = "{QUOTA_MIB}MiB"
match = [{{ uid = {VICTIM_UID} }}]
"""

# The tenant builds its tree through vgpu, then hands the fd to the attacker.
ATTACKER = r"""
import os, subprocess, sys
from tests.support import nvclient as nv
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
os.set_inheritable(fd, True)
tree = nv.build_tree(fd)
os.execv(sys.argv[1], [sys.argv[1], sys.argv[2], str(fd), str(tree.client),
                       str(tree.subdevice), *sys.argv[3:]])
"""

# Another tenant: allocates 1 MiB and frees it, for SECONDS; prints the
# latency of each allocation (ms) and the failures.
VICTIM = r"""
import json, os, sys, time
from tests.support import nvclient as nv
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(fd)
lat, failed = [], 0
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    t0 = time.monotonic()
    r = nv.alloc_memory(fd, tree.client, tree.subdevice, 1 << 20)
    lat.append((time.monotonic() - t0) * 1e3)
    if r.errno or r.status:
        failed += 1
        continue
    nv.rm_free(fd, tree.client, tree.subdevice, r.handle)
print(json.dumps({"lat": lat, "failed": failed}))
"""


# The tenant serves a FUSE file system of its own, in its own user and mount
# namespace, from a child process: one file whose reads never answer. It maps
# a page of it and hands the driver that page as FB_GET_INFO's {index, data}
# list. It prints the server's pid, then "started".
FUSE_STUCK = r"""
import ctypes, errno, mmap, os, stat, struct, sys, tempfile, threading, time
from mfusepy import FUSE, FuseOSError, Operations
from tests.support import nvclient as nv

class Stuck(Operations):
    def getattr(self, path, fh=None):
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        if path == "/page":
            return {"st_mode": stat.S_IFREG | 0o644, "st_nlink": 1, "st_size": 4096}
        raise FuseOSError(errno.ENOENT)

    def readdir(self, path, fh):
        return [".", "..", "page"]

    def open(self, path, flags):
        return 0

    def read(self, path, size, offset, fh):
        threading.Event().wait()  # never answers

def call(mnt):
    while not os.path.exists(mnt + "/page"):
        time.sleep(0.05)
    fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
    tree = nv.build_tree(fd)
    f = os.open(mnt + "/page", os.O_RDONLY)
    page = mmap.mmap(f, 4096, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    lst = ctypes.addressof(ctypes.c_char.from_buffer(page))
    print("started", flush=True)
    r = nv.rm_control(fd, tree.client, tree.subdevice, nv.NV2080_CTRL_CMD_FB_GET_INFO,
                      struct.pack("=I4xQ", 2, lst))
    print(f"returned {r[:2]}", flush=True)

mnt = tempfile.mkdtemp()
server = os.fork()
if server == 0:
    FUSE(Stuck(), mnt, foreground=True)
    os._exit(0)
print(f"server {server}", flush=True)
call(mnt)
"""


def _run_as(uid: int, code: str, *args: str, userns: bool = False) -> subprocess.Popen[str]:
    argv = tenant_argv(code, userns=userns)
    argv[1:3] = [f"--reuid={uid}", f"--regid={uid}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([*argv, *args], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _victim(seconds: float) -> dict:
    p = _run_as(VICTIM_UID, VICTIM, str(seconds))
    out, err = p.communicate(timeout=seconds + 120)
    assert p.returncode == 0, err
    return json.loads(out)


def _p99(lat: list[float]) -> float:
    s = sorted(lat)
    return s[min(len(s) - 1, int(len(s) * 0.99))]


@pytest.fixture
def two_tenants(vgpu: Path, daemon_factory, tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(daemon_factory, tmp_path, TENANTS)
    yield d
    print(d.log()[-4000:])


@pytest.fixture
def uffd_allowed() -> Iterator[None]:
    """userfaultfd for the unprivileged tenant (an ordinary FUSE mount in a user
    namespace would serve the attacker the same way)."""
    knob = Path("/proc/sys/vm/unprivileged_userfaultfd")
    old = knob.read_text()
    knob.write_text("1")
    yield
    knob.write_text(old)


@pytest.fixture(scope="module")
def attacker() -> Iterator[Path]:
    with attacker_binary("attack_fblist") as exe:
        yield exe


def test_a_list_page_that_never_answers_stalls_only_its_caller(
        two_tenants: Daemon, attacker: Path, uffd_allowed: None) -> None:
    base = _victim(5)
    assert base["failed"] == 0
    p99_base = _p99(base["lat"])

    att = _run_as(TENANT_UID, ATTACKER, str(attacker), "uffd", "20")
    try:
        assert att.stdout is not None
        assert att.stdout.readline().strip() == "started"
        time.sleep(2)
        under = _victim(5)
        p99_under = _p99(under["lat"])
        print(f"victim: {len(base['lat'])} calls p99 {p99_base:.2f} ms without the attack; "
              f"{len(under['lat'])} calls, {under['failed']} failed, p99 {p99_under:.2f} ms "
              f"under it ({p99_under / p99_base:.1f}x)")
        try:
            out, err = att.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            out, err = "", "the attacker did not finish (a call of its own never returned)"
    finally:
        if att.poll() is None:
            att.kill()
            att.wait()
    print(f"attacker: {out.strip()} {err.strip()}")
    assert under["failed"] == 0
    # A stalled daemon holds every victim call for the module's upcall timeout
    # (2 s); half of it is far above the noise of a loaded 2-core host (the
    # p99 ratio is printed, not asserted: see the docstring).
    assert max(under["lat"]) < 1000, f"a victim call took {max(under['lat']):.0f} ms"
    assert out.startswith("calls"), err
    calls, foreign = (int(w) for w in out.split()[1::2])
    print(f"the attacker made {calls} calls; {foreign} foreign faults on its page")
    assert calls > 1
    assert foreign == 0, "a process outside the tenant read the tenant's list"


def test_a_caller_stuck_on_its_own_page_can_be_killed(
        two_tenants: Daemon, attacker: Path, uffd_allowed: None) -> None:
    """The list page is never served, not even to the tenant's own threads:
    the caller waits in its own copy, the daemon answers others, SIGKILL ends it."""
    att = _run_as(TENANT_UID, ATTACKER, str(attacker), "uffd-stuck", "30")
    try:
        time.sleep(5)
        under = _victim(3)
        print(f"victim: {len(under['lat'])} calls, {under['failed']} failed, "
              f"p99 {_p99(under['lat']):.2f} ms while the attacker waits on its page")
        assert under["failed"] == 0, under
        assert att.poll() is None, "the stuck call returned"
    finally:
        att.kill()
        att.wait(timeout=60)
    assert att.returncode == -9


@pytest.fixture
def fuse() -> None:
    subprocess.run(["modprobe", "fuse"], check=False)
    if not Path("/dev/fuse").exists():
        pytest.skip("no /dev/fuse in this kernel")


def test_a_fuse_page_that_never_answers_stalls_only_its_caller(
        two_tenants: Daemon, fuse: None) -> None:
    """The FUSE variant of the stuck page: the tenant (uid 1003 in a user and
    mount namespace of its own) serves the list page from a FUSE file whose
    reads never answer. The module copies the list in the caller's context,
    so only the caller waits: the victim's calls are answered meanwhile. A
    FUSE request already read by its server is waited for until the server
    answers or goes (FUSE's rule, vgpu or not): the caller, killed, ends
    once its server is killed too."""
    att = _run_as(TENANT_UID, FUSE_STUCK, userns=True)
    server = 0
    try:
        assert att.stdout is not None
        first = att.stdout.readline().split()
        assert first[:1] == ["server"], first
        server = int(first[1])
        assert att.stdout.readline().strip() == "started"
        time.sleep(3)
        under = _victim(3)
        print(f"victim: {len(under['lat'])} calls, {under['failed']} failed, "
              f"p99 {_p99(under['lat']):.2f} ms, max {max(under['lat']):.0f} ms while the "
              "attacker waits on its FUSE page")
        assert under["failed"] == 0, under
        assert max(under["lat"]) < 1000, f"a victim call took {max(under['lat']):.0f} ms"
        assert att.poll() is None, "the stuck call returned"
    finally:
        att.kill()
        if server:
            os.kill(server, signal.SIGKILL)
        att.wait(timeout=60)
    assert att.returncode == -9


def test_flipping_the_list_index_never_shows_more_than_the_quota(
        two_tenants: Daemon, attacker: Path) -> None:
    att = _run_as(TENANT_UID, ATTACKER, str(attacker), "flip", "10", str(FLIP_ATTEMPTS),
                  str(QUOTA_MIB * 1024))
    out, err = att.communicate(timeout=600)
    assert att.returncode == 0, err
    print(f"race: {out.strip()} (limit {QUOTA_MIB * 1024} KiB)")
    fields = dict(zip(out.split()[::2], (int(w) for w in out.split()[1::2]), strict=True))
    assert fields["attempts"] >= FLIP_ATTEMPTS, "stopped at 100 s"
    assert fields["ok"] > 0
    assert fields["over"] == 0, f"the tenant saw {fields['max']} KiB"
    assert fields["max"] == QUOTA_MIB * 1024  # the sizes answered are the quota's


assert sys.version_info >= (3, 10)
assert nv.NV2080_CTRL_CMD_FB_GET_INFO == 0x20801301
