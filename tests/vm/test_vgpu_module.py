"""Module-level tests of kmod/vgpu in a real kernel (VM tier).

They talk to the module directly: ioctls through ctypes, the upcall protocol
through tests/bench/c_responder (compiled here) or a tiny raw-netlink client
below, with no daemon. nvsim is the backing driver (conftest's fixtures), or
whatever the module was loaded over when /dev/vgpu already exists.

    scripts/vm-run -- python -m pytest -q tests/vm/test_vgpu_module.py
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, VGPU_DIR, in_guest, insmod, loaded, rmmod, set_param, wait_path

pytestmark = pytest.mark.vm

# --- the uapi (kmod/include/uapi/linux/vgpu.h) -------------------------------

NETLINK_GENERIC = 16
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLM_F_CAPPED, NLM_F_ACK_TLVS = 0x100, 0x200
SOL_NETLINK, NETLINK_EXT_ACK = 270, 11
GENL_ID_CTRL, CTRL_CMD_GETFAMILY = 0x10, 3
CTRL_ATTR_FAMILY_ID, CTRL_ATTR_FAMILY_NAME = 1, 2

(CMD_REGISTER, CMD_SET_FILTER, CMD_GET_STATS, CMD_UPCALL, CMD_VERDICT, CMD_EVENT,
 CMD_UNREGISTER) = range(1, 8)
(A_VERSION, A_FILTER_FLAGS, A_RULES, A_STATS, A_UPCALL, A_PARAMS, A_DATA, A_CGROUP,
 A_VERDICT, A_EVENT) = range(1, 11)
NODE_CTL, NODE_GPU, NODE_UVM = 0, 1, 2
OFF_NONE = 0xFFFFFFFF
FILTER_OPEN = 1
UPCALL_OPEN, UPCALL_IOCTL = 1, 2
F_XFER, F_DATA_FAULT, F_DATA_BIG = 1, 2, 4
ALLOW, DENY, FAIL_STATUS = 1, 2, 3
EVENT_POST, EVENT_CLOSE = 1, 2
PROTO_VERSION = 1

RULE = struct.Struct("=8I32I")
UPCALL = struct.Struct("=3Q12I8x")
VERDICT = struct.Struct("=QIIII")
EVENT = struct.Struct("=QQIIiI")
STATS_FIELDS = (
    "version", "daemon_portid", "contexts", "opens", "ioctls", "upcalls", "verdicts",
    "timeouts", "lost", "fail_open", "fail_closed", "killed", "events", "events_lost",
    "bad_verdicts", "mmaps",
)
STATS = struct.Struct("=II14Q")


def rule(nodes: int, nr: int, size: int = 0, match_off: int = OFF_NONE,
         keys: tuple[int, ...] = (), ptr_off: int = OFF_NONE, len_off: int = OFF_NONE,
         flags: int = 0, n_match: int | None = None) -> bytes:
    match = list(keys) + [0] * (32 - len(keys))
    n = len(keys) if n_match is None else n_match
    return RULE.pack(nodes, nr, size, match_off, ptr_off, len_off, n, flags, *match)


# --- NVIDIA escapes used here ------------------------------------------------

def iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord("F") << 8) | nr


RM_ALLOC, CHECK_VERSION_STR, REGISTER_FD, XFER = 0x2B, 210, 201, 211
NVOS21 = struct.Struct("=IIIIQII")  # hRoot hParent hNew hClass pAllocParms paramsSize status
NV_ERR_NO_MEMORY = 0x51

libc = ctypes.CDLL(None, use_errno=True)
libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
libc.ioctl.restype = ctypes.c_int


def ioctl(fd: int, cmd: int, buf: ctypes.Array[ctypes.c_char] | None) -> int:
    ret = libc.ioctl(fd, cmd, ctypes.addressof(buf) if buf is not None else None)
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret


def alloc(fd: int, h_class: int, pparams: int = 0, psize: int = 0,
          xfer: bool = False) -> tuple[int, bytes]:
    """RM_ALLOC (NVOS21) on @fd; returns (ioctl result, params after)."""
    buf = ctypes.create_string_buffer(NVOS21.pack(0, 0, 0, h_class, pparams, psize, 0xFFFF))
    if not xfer:
        return ioctl(fd, iowr(RM_ALLOC, NVOS21.size), buf), buf.raw[:NVOS21.size]
    x = ctypes.create_string_buffer(struct.pack("=IIQ", RM_ALLOC, NVOS21.size,
                                                ctypes.addressof(buf)))
    before = x.raw
    ret = ioctl(fd, iowr(XFER, 16), x)
    assert x.raw == before, "the XFER wrapper was modified"
    return ret, buf.raw[:NVOS21.size]


def status_of(params: bytes) -> int:
    return NVOS21.unpack(params)[6]


# --- a raw generic netlink client --------------------------------------------

def nla(t: int, data: bytes) -> bytes:
    pad = (4 - len(data) % 4) % 4
    return struct.pack("=HH", 4 + len(data), t) + data + b"\0" * pad


def parse_attrs(data: bytes) -> dict[int, bytes]:
    attrs, off = {}, 0
    while off + 4 <= len(data):
        ln, ty = struct.unpack_from("=HH", data, off)
        if ln < 4:
            break
        attrs[ty & 0x3FFF] = data[off + 4:off + ln]
        off += (ln + 3) & ~3
    return attrs


class NlError(OSError):
    def __init__(self, err: int, msg: str) -> None:
        super().__init__(err, f"{os.strerror(err)}: {msg}")
        self.msg = msg


class Genl:
    """vgpu's family over a raw socket; upcalls/events queue up in .pending."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC)
        self.sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
        self.sock.bind((0, 0))
        self.seq = 0
        self.pending: list[tuple[int, dict[int, bytes]]] = []
        self.family = GENL_ID_CTRL
        _, replies = self.request(CTRL_CMD_GETFAMILY,
                                  [(CTRL_ATTR_FAMILY_NAME, b"vgpu\0")], version=1)
        self.family = struct.unpack("=H", replies[0][CTRL_ATTR_FAMILY_ID][:2])[0]

    def close(self) -> None:
        self.sock.close()

    def send(self, cmd: int, attrs: list[tuple[int, bytes]], flags: int = NLM_F_ACK,
             version: int = 1) -> int:
        self.seq += 1
        body = struct.pack("=BBH", cmd, version, 0) + b"".join(nla(t, d) for t, d in attrs)
        self.sock.send(struct.pack("=IHHII", 16 + len(body), self.family,
                                   NLM_F_REQUEST | flags, self.seq, 0) + body)
        return self.seq

    def recv(self, timeout: float | None) -> list[tuple[int, int, int, bytes]]:
        self.sock.settimeout(timeout)
        data = self.sock.recv(1 << 16)
        msgs, off = [], 0
        while off + 16 <= len(data):
            ln, ty, fl, seq, _ = struct.unpack_from("=IHHII", data, off)
            msgs.append((ty, fl, seq, data[off + 16:off + ln]))
            off += (ln + 3) & ~3
        return msgs

    def request(self, cmd: int, attrs: list[tuple[int, bytes]],
                version: int = 1) -> tuple[int, list[dict[int, bytes]]]:
        seq = self.send(cmd, attrs, version=version)
        replies: list[dict[int, bytes]] = []
        while True:
            for ty, fl, mseq, body in self.recv(10):
                if ty == NLMSG_ERROR and mseq == seq:
                    err = -struct.unpack_from("=i", body)[0]
                    msg = ""
                    if fl & NLM_F_ACK_TLVS:
                        olen = 16 if fl & NLM_F_CAPPED else struct.unpack_from("=I", body, 4)[0]
                        tlv = parse_attrs(body[4 + ((olen + 3) & ~3):])
                        msg = tlv.get(1, b"").rstrip(b"\0").decode()
                    if err:
                        raise NlError(err, msg)
                    return 0, replies
                if mseq == seq:
                    replies.append(parse_attrs(body[4:]))
                elif ty == self.family:
                    self.pending.append((body[0], parse_attrs(body[4:])))

    def next_msg(self, cmd: int, timeout: float = 10) -> dict[int, bytes]:
        deadline = time.monotonic() + timeout
        while True:
            for i, (c, attrs) in enumerate(self.pending):
                if c == cmd:
                    del self.pending[i]
                    return attrs
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no message {cmd}")
            try:
                msgs = self.recv(left)
            except TimeoutError:
                continue
            for ty, _, _, body in msgs:
                if ty == self.family:
                    self.pending.append((body[0], parse_attrs(body[4:])))

    def next_upcall(self, timeout: float = 10) -> tuple[tuple[int, ...], dict[int, bytes]]:
        attrs = self.next_msg(CMD_UPCALL, timeout)
        return UPCALL.unpack(attrs[A_UPCALL]), attrs

    def register(self, version: int = PROTO_VERSION) -> None:
        self.request(CMD_REGISTER, [(A_VERSION, struct.pack("=I", version))])

    def unregister(self) -> None:
        self.request(CMD_UNREGISTER, [])

    def set_filter(self, rules: list[bytes], flags: int = 0, raw: bytes | None = None) -> None:
        data = b"".join(rules) if raw is None else raw
        self.request(CMD_SET_FILTER, [(A_FILTER_FLAGS, struct.pack("=I", flags)),
                                      (A_RULES, data)])

    def verdict(self, uid: int, action: int, error: int = 0, status: int = 0,
                status_off: int = 0) -> None:
        self.request(CMD_VERDICT, [(A_VERDICT, VERDICT.pack(uid, action, error, status,
                                                             status_off))])

    def stats(self) -> dict[str, int]:
        _, replies = self.request(CMD_GET_STATS, [])
        return dict(zip(STATS_FIELDS, STATS.unpack(replies[0][A_STATS]), strict=True))


def stats() -> dict[str, int]:
    g = Genl()
    try:
        return g.stats()
    finally:
        g.close()


def set_filter(rules: list[bytes], flags: int = 0) -> None:
    g = Genl()
    try:
        g.set_filter(rules, flags)
    finally:
        g.close()


# --- the C responder ----------------------------------------------------------

@pytest.fixture(scope="session")
def responder_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "c_responder"
    res = subprocess.run(["gcc", "-O2", "-Wall", "-I", str(ROOT / "kmod/include/uapi"), "-o",
                          str(out), str(ROOT / "tests/bench/c_responder.c")],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    return out


class Responder:
    def __init__(self, binary: Path, *args: str) -> None:
        self.proc = subprocess.Popen([str(binary), "-v", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 20)
        first = self.proc.stdout.readline().strip() if ready else ""
        if first != "ready":
            self.kill()
            raise AssertionError(f"responder not ready: {first!r} {self.proc.stderr.read()}")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str, timeout: float = 10) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if line.startswith(prefix):
                return dict(w.split("=", 1) for w in line.split()[1:] if "=" in w)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def responders(responder_bin: Path) -> Iterator[list[Responder]]:
    started: list[Responder] = []
    yield started
    for r in started:
        r.kill()


def start(responders: list[Responder], binary: Path, *args: str) -> Responder:
    r = Responder(binary, *args)
    responders.append(r)
    return r


# --- the module under test ------------------------------------------------------

class Env:
    def __init__(self, dev: Path) -> None:
        self.dev = dev
        self.backing = Path(Path("/sys/module/vgpu/parameters/backing_dir").read_text().strip())
        self.nvsim = loaded("nvsim") and self.backing == Path("/dev/nvsim")

    def open(self, name: str = "nvidiactl", flags: int = os.O_RDWR) -> int:
        return os.open(self.dev / name, flags)


@pytest.fixture
def vg(request: pytest.FixtureRequest) -> Iterator[Env]:
    """The loaded module, reset to no daemon, no filter, fail-closed."""
    if loaded("vgpu") and VGPU_DIR.exists():
        dev = VGPU_DIR
    elif in_guest():
        dev = request.getfixturevalue("vgpu")
    else:
        pytest.skip("no /dev/vgpu: needs vgpu.ko loaded (scripts/vm-run)")
    set_param("vgpu", "fail_open", "0")
    set_param("vgpu", "upcall_timeout_ms", "2000")
    set_filter([])
    yield Env(dev)
    set_filter([])
    set_param("vgpu", "fail_open", "0")


CLASS40 = ("-f", f"ctl:{RM_ALLOC:#x}:0:12:-:-:0x40")


def wait_for(pred, timeout: float = 10, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# --- tests --------------------------------------------------------------------------

def test_nodes_appear(vg: Env) -> None:
    ctl = os.stat(vg.dev / "nvidiactl")
    assert (ctl.st_mode & 0o7777) == 0o666
    assert os.major(ctl.st_rdev) != os.major(os.stat(vg.backing / "nvidiactl").st_rdev)
    gpus = sorted(p.name for p in vg.backing.glob("nvidia[0-9]*"))
    assert sorted(p.name for p in vg.dev.glob("nvidia[0-9]*")) == gpus
    assert (vg.dev / "nvidia-uvm").exists() == (vg.backing / "nvidia-uvm").exists()


def test_fast_path_forwards(vg: Env) -> None:
    before = stats()
    fd = vg.open()
    try:
        buf = ctypes.create_string_buffer(struct.pack("=II64s", ord("2"), 0, b""))
        if vg.nvsim:
            assert ioctl(fd, iowr(CHECK_VERSION_STR, 72), buf) == 0
            assert buf.raw[8:17] == b"595.45.04"
            ret, params = alloc(fd, 0x41, xfer=True)
            assert ret == 0 and status_of(params) == 0
        else:
            with pytest.raises(OSError):
                ioctl(fd, iowr(CHECK_VERSION_STR, 72), buf)
    finally:
        os.close(fd)
    after = stats()
    assert after["ioctls"] >= before["ioctls"] + 2
    assert after["opens"] == before["opens"] + 1
    assert after["upcalls"] == before["upcalls"]


def test_mmap_forwards(vg: Env) -> None:
    name = "nvidia0" if (vg.dev / "nvidia0").exists() else "nvidiactl"
    fd = vg.open(name)
    before = stats()["mmaps"]
    try:
        try:
            m = mmap.mmap(fd, 4096)
            m.close()
            forwarded = True
        except OSError as e:
            forwarded = e.errno != errno.ENODEV
    finally:
        os.close(fd)
    assert stats()["mmaps"] == before + (1 if forwarded else 0)


def test_slow_path_fail_status(vg: Env, responder_bin: Path, responders) -> None:
    r = start(responders, responder_bin, *CLASS40, "-a", f"status={NV_ERR_NO_MEMORY:#x}@28")
    before = stats()
    fd = vg.open()
    try:
        ret, params = alloc(fd, 0x40)
        assert ret == 0 and status_of(params) == NV_ERR_NO_MEMORY
        up = r.expect("upcall")
        assert up["kind"] == "2" and up["nr"] == "0x2b" and up["plen"] == "32"
        assert up["flags"] == "0x0"
        # Wrapped in IOCTL_XFER_CMD: same rule, status in the inner params.
        ret, params = alloc(fd, 0x40, xfer=True)
        assert ret == 0 and status_of(params) == NV_ERR_NO_MEMORY
        assert r.expect("upcall")["flags"] == hex(F_XFER)
        # Another class does not match: the driver answers.
        if vg.nvsim:
            ret, params = alloc(fd, 0x41)
            assert ret == 0 and status_of(params) == 0
    finally:
        os.close(fd)
    after = stats()
    assert after["upcalls"] == before["upcalls"] + 2
    assert after["verdicts"] == before["verdicts"] + 2
    assert after["daemon_portid"] != 0


def test_slow_path_allow_post_and_data(vg: Env, responder_bin: Path, responders) -> None:
    # Every 32-byte RM_ALLOC, with the alloc-params buffer as data.
    r = start(responders, responder_bin, "-f", f"ctl:{RM_ALLOC:#x}:32:-:16:24:")
    fd = vg.open()
    try:
        if vg.nvsim:
            ret, params = alloc(fd, 0x41)
            assert ret == 0 and status_of(params) == 0
        else:
            with pytest.raises(OSError):
                alloc(fd, 0x41)
        up = r.expect("upcall")
        assert up["plen"] == "32" and up["dlen"] == "0"
        ev = r.expect("event kind=1")
        assert ev["upcall"] == up["id"] and ev["plen"] == "32"
        assert int(ev["ret"]) == (0 if vg.nvsim else -errno.ENOTTY)

        buf = ctypes.create_string_buffer(56)
        for pparams, psize, flags, dlen in ((ctypes.addressof(buf), 56, 0, "56"),
                                            (0x10, 8, F_DATA_FAULT, "0"),
                                            (ctypes.addressof(buf), 1 << 20, F_DATA_BIG, "0")):
            with contextlib.suppress(OSError):
                alloc(fd, 0x80, pparams, psize)
            up = r.expect("upcall")
            assert int(up["flags"], 16) == flags and up["dlen"] == dlen
    finally:
        os.close(fd)
    r.expect("event kind=2")


def test_deny_and_open_filter(vg: Env, responder_bin: Path, responders) -> None:
    r = start(responders, responder_bin, "-O", *CLASS40, "-a", "deny=13")
    with pytest.raises(PermissionError):
        vg.open()
    up = r.expect("upcall")
    assert up["kind"] == "1" and up["cgroup"].startswith("/")
    assert up["pid"] == str(os.getpid()) and up["uid"] == "0"
    r.kill()
    r = start(responders, responder_bin, "-O", *CLASS40, "-a", "allow")
    fd = vg.open()
    try:
        assert r.expect("upcall")["kind"] == "1"
        if vg.nvsim:
            ret, _ = alloc(fd, 0x40)  # allowed: reaches nvsim (no parent: a status)
            assert ret == 0
    finally:
        os.close(fd)


def test_no_daemon_fail_closed_and_open(vg: Env) -> None:
    set_filter([rule(1 << NODE_CTL, RM_ALLOC, 0, 12, (0x40,))])
    fd = vg.open()
    try:
        before = stats()
        with pytest.raises(OSError) as e:
            alloc(fd, 0x40)
        assert e.value.errno == errno.EHOSTDOWN
        assert stats()["fail_closed"] == before["fail_closed"] + 1
        set_param("vgpu", "fail_open", "1")
        if vg.nvsim:
            ret, _ = alloc(fd, 0x40)
            assert ret == 0
        else:
            with pytest.raises(OSError) as e:
                alloc(fd, 0x40)
            assert e.value.errno == errno.ENOTTY
        assert stats()["fail_open"] == before["fail_open"] + 1
    finally:
        os.close(fd)


def test_timeout(vg: Env, responder_bin: Path, responders) -> None:
    start(responders, responder_bin, *CLASS40, "-a", "ignore")
    set_param("vgpu", "upcall_timeout_ms", "300")
    fd = vg.open()
    try:
        before = stats()
        t0 = time.monotonic()
        with pytest.raises(OSError) as e:
            alloc(fd, 0x40)
        assert e.value.errno == errno.ETIMEDOUT
        assert 0.25 < time.monotonic() - t0 < 5
        assert stats()["timeouts"] == before["timeouts"] + 1
    finally:
        os.close(fd)


def _waiters(vg: Env, n: int) -> tuple[list[threading.Thread], list[object]]:
    results: list[object] = [None] * n

    def call(i: int) -> None:
        fd = vg.open()
        try:
            results[i] = alloc(fd, 0x40)[0]
        except OSError as e:
            results[i] = e.errno
        finally:
            os.close(fd)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results


@pytest.mark.parametrize("fail_open", [False, True])
def test_daemon_sigkill_with_waiters(vg: Env, responder_bin: Path, responders,
                                     fail_open: bool) -> None:
    set_param("vgpu", "upcall_timeout_ms", "20000")
    set_param("vgpu", "fail_open", "1" if fail_open else "0")
    r = start(responders, responder_bin, *CLASS40, "-a", "ignore")
    base = stats()["upcalls"]
    threads, results = _waiters(vg, 6)
    wait_for(lambda: stats()["upcalls"] == base + 6, what="6 pending upcalls")
    t0 = time.monotonic()
    r.proc.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads), "waiters stuck after the daemon died"
    assert time.monotonic() - t0 < 5
    if fail_open:
        assert all(x == 0 if vg.nvsim else x == errno.ENOTTY for x in results), results
    else:
        assert results == [errno.EHOSTDOWN] * 6
    assert stats()["daemon_portid"] == 0
    # The filter survives the daemon; a new daemon resumes filtering.
    set_param("vgpu", "fail_open", "0")
    fd = vg.open()
    try:
        with pytest.raises(OSError) as e:
            alloc(fd, 0x40)
        assert e.value.errno == errno.EHOSTDOWN
        start(responders, responder_bin, "-a", f"status={NV_ERR_NO_MEMORY:#x}@28")
        ret, params = alloc(fd, 0x40)
        assert ret == 0 and status_of(params) == NV_ERR_NO_MEMORY
    finally:
        os.close(fd)


def test_bad_verdicts_and_registration(vg: Env) -> None:
    g = Genl()
    other = Genl()
    try:
        with pytest.raises(NlError) as e:
            g.register(version=99)
        assert e.value.errno == errno.EPROTONOSUPPORT and "1" in e.value.msg
        g.register()
        g.register()  # idempotent for the same port
        with pytest.raises(NlError) as e:
            other.register()
        assert e.value.errno == errno.EBUSY
        g.set_filter([rule(1 << NODE_CTL, RM_ALLOC, 0, 12, (0x40,))])
        threads, results = _waiters(vg, 1)
        hdr, attrs = g.next_upcall()
        uid = hdr[0]
        assert len(attrs[A_PARAMS]) == 32
        before = stats()
        with pytest.raises(NlError) as e:
            other.verdict(uid, ALLOW)
        assert e.value.errno == errno.EPERM
        bad = [dict(action=0), dict(action=4), dict(action=DENY, error=0),
               dict(action=DENY, error=4096), dict(action=ALLOW, error=1),
               dict(action=FAIL_STATUS, status=1, status_off=29),
               dict(action=FAIL_STATUS, status=1, status_off=0xFFFFFFFE)]
        for b in bad:
            with pytest.raises(NlError) as e:
                g.verdict(uid, **b)
            assert e.value.errno == errno.EINVAL, b
        with pytest.raises(NlError) as e:
            g.verdict(uid + 1000, ALLOW)
        assert e.value.errno == errno.ENOENT
        time.sleep(0.1)
        assert threads[0].is_alive(), "a refused verdict completed the waiter"
        after = stats()
        assert after["bad_verdicts"] == before["bad_verdicts"] + len(bad)
        assert after["lost"] == before["lost"] + 1
        g.verdict(uid, DENY, error=errno.EACCES)
        threads[0].join(5)
        assert results == [errno.EACCES]
        with pytest.raises(NlError) as e:
            g.verdict(uid, ALLOW)
        assert e.value.errno == errno.ENOENT
        # UNREGISTER: only by the daemon; pending waiters get the fail policy.
        threads, results = _waiters(vg, 1)
        g.next_upcall()
        with pytest.raises(NlError) as e:
            other.unregister()
        assert e.value.errno == errno.EPERM
        g.unregister()
        threads[0].join(5)
        assert results == [errno.EHOSTDOWN]
        other.register()  # the slot is free again
    finally:
        g.close()
        other.close()


def test_filter_validation(vg: Env) -> None:
    g = Genl()
    try:
        ctl = 1 << NODE_CTL
        bad = [
            rule(0, RM_ALLOC),
            rule(1 << 3, RM_ALLOC),
            rule(ctl, RM_ALLOC, flags=1),
            rule(ctl, RM_ALLOC, 0, 12, (0x40,), n_match=33),
            rule(ctl, RM_ALLOC, 32, 29, (0x40,)),
            rule(ctl, RM_ALLOC, 32, ptr_off=28, len_off=24),
            rule(ctl, RM_ALLOC, 32, ptr_off=16, len_off=OFF_NONE),
            rule(ctl, RM_ALLOC, 32, ptr_off=16, len_off=30),
            rule(ctl, RM_ALLOC, 16385),
            rule(ctl, RM_ALLOC, 0, 16381, (1,)),
        ]
        for b in bad:
            with pytest.raises(NlError) as e:
                g.set_filter([rule(ctl, 0x29), b])
            assert e.value.errno == errno.EINVAL, RULE.unpack(b)[:8]
        with pytest.raises(NlError) as e:
            g.set_filter([], raw=rule(ctl, RM_ALLOC)[:-4])
        assert e.value.errno == errno.EINVAL
        with pytest.raises(NlError):
            g.set_filter([rule(ctl, RM_ALLOC)] * 33)
        with pytest.raises(NlError):
            g.set_filter([], flags=2)
        g.set_filter([rule(ctl, RM_ALLOC)] * 32, flags=FILTER_OPEN)
        g.set_filter([rule(ctl | (1 << NODE_GPU) | (1 << NODE_UVM), 0x30000001, 16, 0, (1,),
                           ptr_off=8, len_off=0)])
        g.set_filter([])
    finally:
        g.close()


def test_commands_need_admin(vg: Env) -> None:
    pid = os.fork()
    if pid == 0:  # child: an unprivileged user
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            Genl().stats()
        except NlError as e:
            code = e.errno
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == errno.EPERM


def test_fd_translation(vg: Env, responder_bin: Path, responders) -> None:
    if not vg.nvsim:
        pytest.skip("needs nvsim, which checks fds")
    ctl, gpu = vg.open(), vg.open("nvidia0")
    other = os.open("/dev/null", os.O_RDWR)
    try:
        nfds = len(os.listdir("/proc/self/fd"))
        buf = ctypes.create_string_buffer(struct.pack("=i", other))
        with pytest.raises(OSError) as e:  # not ours: left to the driver
            ioctl(gpu, iowr(REGISTER_FD, 4), buf)
        assert e.value.errno == errno.EINVAL
        buf = ctypes.create_string_buffer(struct.pack("=i", ctl))
        assert ioctl(gpu, iowr(REGISTER_FD, 4), buf) == 0
        assert struct.unpack("=i", buf.raw[:4])[0] == ctl
        assert len(os.listdir("/proc/self/fd")) == nfds
        # The same through the slow path.
        start(responders, responder_bin, "-f", f"gpu:{REGISTER_FD}:4:-:-:-:")
        gpu2 = vg.open("nvidia0")
        ctl2 = vg.open()
        try:
            buf = ctypes.create_string_buffer(struct.pack("=i", ctl2))
            assert ioctl(gpu2, iowr(REGISTER_FD, 4), buf) == 0
            assert struct.unpack("=i", buf.raw[:4])[0] == ctl2
        finally:
            os.close(gpu2)
            os.close(ctl2)
    finally:
        os.close(other)
        os.close(gpu)
        os.close(ctl)


def test_stats_counters(vg: Env) -> None:
    before = stats()
    assert before["version"] == PROTO_VERSION
    fds = [vg.open() for _ in range(3)]
    mid = stats()
    for fd in fds:
        os.close(fd)
    after = stats()
    assert mid["contexts"] == before["contexts"] + 3
    assert mid["opens"] == before["opens"] + 3
    assert after["contexts"] == before["contexts"]


KILLED_CALLER = """
import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
buf = ctypes.create_string_buffer(struct.pack("=IIIIQII", 0, 0, 0, 0x40, 0, 0, 0))
print("calling", flush=True)
libc.ioctl(fd, %d, ctypes.addressof(buf))
print("returned", flush=True)
"""


def test_rmmod_refused_open_and_caller_killed(vg: Env) -> None:
    fd = vg.open()
    res = rmmod("vgpu")
    os.close(fd)
    assert res.returncode != 0 and loaded("vgpu")

    g = Genl()
    try:
        g.register()
        g.set_filter([rule(1 << NODE_CTL, RM_ALLOC, 0, 12, (0x40,))])
        before = stats()
        code = KILLED_CALLER % iowr(RM_ALLOC, NVOS21.size)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                 text=True, cwd=ROOT)
        hdr, _ = g.next_upcall(timeout=30)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=5) == -signal.SIGKILL
        assert "returned" not in child.stdout.read()
        with pytest.raises(NlError) as e:
            g.verdict(hdr[0], ALLOW)
        assert e.value.errno == errno.ENOENT
        after = stats()
        assert after["killed"] == before["killed"] + 1
        assert after["lost"] == before["lost"] + 1
        assert after["contexts"] == before["contexts"]
    finally:
        g.close()
    # The module unloads now that nothing is open, and loads again.
    params = {p: Path(f"/sys/module/vgpu/parameters/{p}").read_text().strip()
              for p in ("backing_dir", "upcall_timeout_ms")}
    wait_for(lambda: stats()["daemon_portid"] == 0, what="daemon socket release")
    res = rmmod("vgpu")
    assert res.returncode == 0, res.stderr
    assert not loaded("vgpu")
    insmod(ROOT / "kmod/vgpu/vgpu.ko", *(f"{k}={v}" for k, v in params.items()))
    wait_path(VGPU_DIR / "nvidiactl")


def test_kmemleak_clean(vg: Env) -> None:
    leak = Path("/sys/kernel/debug/kmemleak")
    if not leak.exists():
        pytest.skip("kernel without CONFIG_DEBUG_KMEMLEAK")
    leak.write_text("scan")
    report = leak.read_text()
    assert "vgpu" not in report, report
