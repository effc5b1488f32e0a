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
FILTER_OPEN, FILTER_UVM_MMAP = 1, 2
UPCALL_OPEN, UPCALL_IOCTL, UPCALL_POST, UPCALL_MMAP = 1, 2, 3, 4
F_XFER, F_DATA_FAULT, F_DATA_BIG = 1, 2, 4
ALLOW, DENY, FAIL_STATUS, REPLY = 1, 2, 3, 4
VERDICT_F_POST = 1
EVENT_POST, EVENT_CLOSE = 1, 2
PROTO_VERSION = 3

RULE = struct.Struct("=8I32I")
UPCALL = struct.Struct("=3Q12IiI")
VERDICT = struct.Struct("=QIIIIII")
MMAP_PARAMS = struct.Struct("=QQII")
# Indices in UPCALL.unpack(): the fields the tests look at.
U_ID, U_KIND, U_NODE, U_NR, U_FLAGS, U_RET = 0, 3, 4, 7, 8, 15
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
                status_off: int = 0, flags: int = 0, reserved: int = 0,
                params: bytes | None = None, data: bytes | None = None) -> None:
        attrs = [(A_VERDICT, VERDICT.pack(uid, action, error, status, status_off, flags,
                                          reserved))]
        if params is not None:
            attrs.append((A_PARAMS, params))
        if data is not None:
            attrs.append((A_DATA, data))
        self.request(CMD_VERDICT, attrs)

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
    r = start(responders, responder_bin, "-P", "-f", f"ctl:{RM_ALLOC:#x}:32:-:16:24:")
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


def test_post_event_only_when_the_rule_asks(vg: Env, responder_bin: Path, responders) -> None:
    r = start(responders, responder_bin, "-f", f"ctl:{RM_ALLOC:#x}:32:-:-:-")
    fd = vg.open()
    try:
        before = stats()
        with contextlib.suppress(OSError):
            alloc(fd, 0x41)
        r.expect("upcall")
        after = stats()
        assert after["upcalls"] == before["upcalls"] + 1
        assert after["events"] == before["events"]
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
        assert e.value.errno == errno.EPROTONOSUPPORT and f"version {PROTO_VERSION}" in e.value.msg
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
        bad = [dict(action=0), dict(action=REPLY), dict(action=5), dict(action=DENY, error=0),
               dict(action=DENY, error=4096), dict(action=ALLOW, error=1),
               dict(action=FAIL_STATUS, status=1, status_off=29),
               dict(action=FAIL_STATUS, status=1, status_off=0xFFFFFFFE),
               dict(action=ALLOW, reserved=1), dict(action=ALLOW, flags=4),
               dict(action=DENY, error=1, flags=VERDICT_F_POST)]
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
            rule(ctl, RM_ALLOC, flags=4),  # POST 1, SHADOW 2, no more
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
            g.set_filter([], flags=4)
        g.set_filter([], flags=FILTER_UVM_MMAP)
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


# --- REPLY verdicts, POST upcalls, MMAP upcalls --------------------------------

sys.path.insert(0, str(ROOT / "tests"))
import nvclient as nv  # noqa: E402

PAGE = mmap.PAGESIZE
CTL = 1 << NODE_CTL


def rm_calls() -> int | None:
    """nvsim's count of calls it received, None without nvsim."""
    p = Path("/sys/module/nvsim/parameters/rm_calls")
    return int(p.read_text()) if p.exists() else None


class Call:
    """Runs fn(*args) in a thread; result() returns its value or raises its error."""

    def __init__(self, fn, *args, **kw) -> None:
        self.value: object = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn(*args, **kw)
            except BaseException as e:  # handed to result()
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def result(self, timeout: float = 10):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the call did not return"
        if self.error:
            raise self.error
        return self.value


@contextlib.contextmanager
def daemon(rules: list[bytes], flags: int = 0) -> Iterator[Genl]:
    g = Genl()
    try:
        g.register()
        g.set_filter(rules, flags)
        yield g
    finally:
        g.close()


# RM_ALLOC of class 0x40, with the alloc-params buffer (ptr@16, len@24) as data.
ALLOC40_DATA = rule(CTL, RM_ALLOC, 32, 12, (0x40,), ptr_off=16, len_off=24)


def test_reply_verdict(vg: Env) -> None:
    fd = vg.open()
    buf = ctypes.create_string_buffer(b"\x11" * 56)
    try:
        with daemon([ALLOC40_DATA]) as g:
            calls, before = rm_calls(), stats()
            c = Call(alloc, fd, 0x40, ctypes.addressof(buf), 56)
            hdr, attrs = g.next_upcall()
            assert hdr[U_KIND] == UPCALL_IOCTL and hdr[U_RET] == 0
            assert len(attrs[A_PARAMS]) == 32 and attrs[A_DATA] == b"\x11" * 56
            new = NVOS21.pack(1, 2, 0xCAFE, 0x40, 0x1000, 8, 0x1234)
            g.verdict(hdr[U_ID], REPLY, params=new, data=b"\x5a" * 56)
            ret, params = c.result()
            # Written where the caller's pointer was, not where the reply's points.
            assert (ret, params, buf.raw[:56]) == (0, new, b"\x5a" * 56)
            # DATA alone: the params stay as the caller wrote them.
            c = Call(alloc, fd, 0x40, ctypes.addressof(buf), 56)
            hdr, attrs = g.next_upcall()
            g.verdict(hdr[U_ID], REPLY, data=bytes(range(56)))
            ret, params = c.result()
            assert ret == 0 and params == attrs[A_PARAMS] and buf.raw[:56] == bytes(range(56))
            # PARAMS alone, wrapped in XFER: the inner params (alloc checks the wrapper).
            c = Call(alloc, fd, 0x40, xfer=True)
            hdr, attrs = g.next_upcall()
            assert hdr[U_FLAGS] == F_XFER and A_DATA not in attrs
            new = NVOS21.pack(3, 4, 0xBEEF, 0x40, 0, 0, NV_ERR_NO_MEMORY)
            g.verdict(hdr[U_ID], REPLY, params=new)
            assert c.result() == (0, new)
            after = stats()
            assert after["verdicts"] == before["verdicts"] + 3
            assert after["events"] == before["events"]  # no POST event for a REPLY
            assert rm_calls() == calls, "a REPLY reached the driver"
    finally:
        os.close(fd)


def test_reply_malformed(vg: Env) -> None:
    fd = vg.open()
    buf = ctypes.create_string_buffer(56)
    try:
        with daemon([ALLOC40_DATA]) as g:
            before = stats()
            c = Call(alloc, fd, 0x40, ctypes.addressof(buf), 56)
            hdr, _ = g.next_upcall()
            uid = hdr[U_ID]
            bad = [dict(params=bytes(31)), dict(params=bytes(33)), dict(params=b""),
                   dict(data=bytes(55)), dict(data=bytes(57)),
                   dict(params=bytes(32), data=bytes(8)), dict(params=bytes(30), data=bytes(56)),
                   dict(), dict(params=bytes(32), error=1), dict(params=bytes(32), reserved=1),
                   dict(params=bytes(32), flags=VERDICT_F_POST)]
            for b in bad:
                with pytest.raises(NlError) as e:
                    g.verdict(uid, REPLY, **b)
                assert e.value.errno == errno.EINVAL, b
            for action, kw in ((ALLOW, dict(params=bytes(32))), (DENY, dict(data=bytes(56))),
                               (FAIL_STATUS, dict(params=bytes(32)))):
                with pytest.raises(NlError) as e:
                    g.verdict(uid, action, error=13 if action == DENY else 0, **kw)
                assert e.value.errno == errno.EINVAL, (action, kw)
            time.sleep(0.1)
            assert c.alive(), "a refused verdict completed the waiter"
            assert buf.raw == bytes(56)
            n = len(bad) + 3
            assert stats()["bad_verdicts"] == before["bad_verdicts"] + n
            g.verdict(uid, DENY, error=errno.EACCES)
            with pytest.raises(PermissionError):
                c.result()
            # No data sent (no pointer): DATA in the REPLY is refused.
            c = Call(alloc, fd, 0x40)
            hdr, attrs = g.next_upcall()
            assert A_DATA not in attrs
            for b in (dict(data=bytes(8)), dict(params=bytes(32), data=b"")):
                with pytest.raises(NlError) as e:
                    g.verdict(hdr[U_ID], REPLY, **b)
                assert e.value.errno == errno.EINVAL
            g.verdict(hdr[U_ID], REPLY, params=bytes(32))
            assert c.result() == (0, bytes(32))
            # An OPEN upcall takes ALLOW or DENY only.
            g.set_filter([], FILTER_OPEN)
            c = Call(vg.open)
            hdr, attrs = g.next_upcall()
            assert hdr[U_KIND] == UPCALL_OPEN
            for action, kw in ((REPLY, dict(params=bytes(4))), (ALLOW, dict(flags=VERDICT_F_POST)),
                               (FAIL_STATUS, {})):
                with pytest.raises(NlError) as e:
                    g.verdict(hdr[U_ID], action, **kw)
                assert e.value.errno == errno.EINVAL, action
            g.verdict(hdr[U_ID], ALLOW)
            os.close(c.result())
    finally:
        os.close(fd)


def test_post_upcall_virtualizes_fb_info(vg: Env) -> None:
    """ALLOW + F_POST, then REPLY to the POST upcall: FB_GET_INFO_V2 rewritten."""
    if not vg.nvsim:
        pytest.skip("needs nvsim")
    ctl = vg.open()
    try:
        t = nv.build_tree(ctl)
        idx = [nv.FB_TOTAL_RAM_SIZE, nv.FB_HEAP_FREE]
        _, _, real = nv.fb_get_info_v2(ctl, t.client, t.subdevice, idx)
        # RM_CONTROL FB_GET_INFO_V2, its params (ptr@16, len@24) as data.
        fb_rule = rule(CTL, 0x2A, 32, 8, (nv.NV2080_CTRL_CMD_FB_GET_INFO_V2,),
                       ptr_off=16, len_off=24)
        with daemon([fb_rule]) as g:
            calls, before = rm_calls(), stats()
            c = Call(nv.fb_get_info_v2, ctl, t.client, t.subdevice, idx)
            hdr, attrs = g.next_upcall()
            assert hdr[U_KIND] == UPCALL_IOCTL and len(attrs[A_DATA]) == nv.FB_INFO_V2_SIZE
            g.verdict(hdr[U_ID], ALLOW, flags=VERDICT_F_POST)
            post, pattrs = g.next_upcall()
            assert post[U_KIND] == UPCALL_POST and post[U_ID] == hdr[U_ID]
            assert post[U_RET] == 0 and post[U_NR] == 0x2A
            assert len(pattrs[A_PARAMS]) == 32
            data = bytearray(pattrs[A_DATA])
            assert struct.unpack_from("=II", data, 4) == (nv.FB_TOTAL_RAM_SIZE,
                                                         real[nv.FB_TOTAL_RAM_SIZE])
            struct.pack_into("=IIII", data, 4, nv.FB_TOTAL_RAM_SIZE, 262144,
                             nv.FB_HEAP_FREE, 131072)
            g.verdict(post[U_ID], REPLY, data=bytes(data))
            assert c.result() == (0, 0, {nv.FB_TOTAL_RAM_SIZE: 262144, nv.FB_HEAP_FREE: 131072})
            assert rm_calls() == calls + 1, "the driver was not called exactly once"
            # ALLOW to the POST upcall keeps the driver's results.
            c = Call(nv.fb_get_info_v2, ctl, t.client, t.subdevice, idx)
            hdr, _ = g.next_upcall()
            g.verdict(hdr[U_ID], ALLOW, flags=VERDICT_F_POST)
            post, _ = g.next_upcall()
            # A POST upcall takes ALLOW or REPLY only; REPLY as long as sent.
            for action, kw in ((DENY, dict(error=1)), (FAIL_STATUS, {}),
                               (ALLOW, dict(flags=VERDICT_F_POST)),
                               (REPLY, dict(data=bytes(8)))):
                with pytest.raises(NlError) as e:
                    g.verdict(post[U_ID], action, **kw)
                assert e.value.errno == errno.EINVAL, action
            g.verdict(post[U_ID], ALLOW)
            assert c.result() == (0, 0, real)
            # The daemon goes while a POST upcall waits: the results stay.
            c = Call(nv.fb_get_info_v2, ctl, t.client, t.subdevice, idx)
            hdr, _ = g.next_upcall()
            g.verdict(hdr[U_ID], ALLOW, flags=VERDICT_F_POST)
            g.next_upcall()
            g.unregister()
            assert c.result() == (0, 0, real)
            after = stats()
            assert after["events"] == before["events"], "POST event sent besides the upcall"
            assert after["upcalls"] == before["upcalls"] + 6
            assert after["fail_closed"] == before["fail_closed"]
    finally:
        os.close(ctl)


def test_post_timeout_keeps_results(vg: Env, responder_bin: Path, responders) -> None:
    r = start(responders, responder_bin, "-f", f"ctl:{RM_ALLOC:#x}:0:12:-:-:0x41",
              "-a", "post-ignore")
    set_param("vgpu", "upcall_timeout_ms", "300")
    fd = vg.open()
    try:
        before = stats()
        if vg.nvsim:
            ret, params = alloc(fd, 0x41)
            assert ret == 0 and status_of(params) == 0 and NVOS21.unpack(params)[2] != 0
        else:
            with pytest.raises(OSError) as e:
                alloc(fd, 0x41)
            assert e.value.errno == errno.ENOTTY  # the driver's answer, not the policy's
        up = r.expect("upcall")
        post = r.expect("upcall")
        assert up["kind"] == "2" and post["kind"] == "3" and post["id"] == up["id"]
        assert int(post["ret"]) == (0 if vg.nvsim else -errno.ENOTTY)
        after = stats()
        assert after["timeouts"] == before["timeouts"] + 1
        assert after["fail_closed"] == before["fail_closed"]
        assert after["verdicts"] == before["verdicts"] + 1
    finally:
        os.close(fd)


def test_responder_post(vg: Env, responder_bin: Path, responders) -> None:
    r = start(responders, responder_bin, "-f", f"ctl:{RM_ALLOC:#x}:0:12:-:-:0x41",
              "-a", "post")
    fd = vg.open()
    try:
        before = stats()
        with contextlib.suppress(OSError):
            alloc(fd, 0x41)
        up, post = r.expect("upcall"), r.expect("upcall")
        assert (up["kind"], post["kind"], post["plen"]) == ("2", "3", "32")
        assert post["id"] == up["id"]
        after = stats()
        assert after["verdicts"] == before["verdicts"] + 2
        assert after["events"] == before["events"]
    finally:
        os.close(fd)
    r.expect("event kind=2")


libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.mmap.restype = ctypes.c_void_p
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class MmapChild:
    """mmap in a child process, which then touches the pages.

    The caller of mmap holds its mmap_lock while the upcall waits: a
    responder in the same process (a thread here) would block on it at its
    next page fault or heap growth, so the caller must be another process.
    result() returns "ok" or raises the mmap's OSError.
    """

    def __init__(self, fd: int, length: int, flags: int = mmap.MAP_SHARED,
                 offset: int = 0) -> None:
        rd, wr = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(rd)
            addr = libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd,
                             offset)
            if addr in (None, ctypes.c_void_p(-1).value):
                out = f"errno {ctypes.get_errno()}"
            elif ctypes.string_at(addr, length) != bytes(length):
                out = "not zeroed"
            else:
                ctypes.memmove(addr + length - 4, b"uvm!", 4)
                out = "ok" if ctypes.string_at(addr + length - 4, 4) == b"uvm!" else "bad"
                libc.munmap(addr, length)
            os.write(wr, out.encode())
            os._exit(0)
        os.close(wr)
        self.rd = rd

    def result(self, timeout: float = 10) -> str:
        try:
            ready, _, _ = select.select([self.rd], [], [], timeout)
            assert ready, "mmap did not return"
            out = os.read(self.rd, 100).decode()
        finally:
            os.close(self.rd)
            os.waitpid(self.pid, 0)
        if out.startswith("errno "):
            e = int(out.split()[1])
            raise OSError(e, os.strerror(e))
        assert out == "ok", out
        return out


def _mmap(fd: int, length: int, flags: int = mmap.MAP_SHARED, offset: int = 0) -> None:
    MmapChild(fd, length, flags, offset).result()


def test_mmap_upcall(vg: Env) -> None:
    if not (vg.dev / "nvidia-uvm").exists():
        pytest.skip("no nvidia-uvm node")
    uvm = vg.open("nvidia-uvm")
    ctl = vg.open()
    try:
        with daemon([], FILTER_UVM_MMAP) as g:
            before = stats()
            c = MmapChild(uvm, 2 * PAGE, offset=3 * PAGE)
            hdr, attrs = g.next_upcall()
            assert (hdr[U_KIND], hdr[U_NODE]) == (UPCALL_MMAP, NODE_UVM)
            assert MMAP_PARAMS.unpack(attrs[A_PARAMS]) == (3, 2 * PAGE, 3, 1)
            for action, kw in ((REPLY, dict(params=bytes(24))), (FAIL_STATUS, {}),
                               (ALLOW, dict(flags=VERDICT_F_POST))):
                with pytest.raises(NlError) as e:
                    g.verdict(hdr[U_ID], action, **kw)
                assert e.value.errno == errno.EINVAL, action
            g.verdict(hdr[U_ID], ALLOW)
            if vg.nvsim:
                assert c.result() == "ok"  # zeroed pages, writable
            else:
                with pytest.raises(OSError):
                    c.result()
            assert stats()["mmaps"] == before["mmaps"] + 1
            # DENY: the errno, nothing mapped, nothing forwarded.
            c = MmapChild(uvm, PAGE)
            hdr, _ = g.next_upcall()
            g.verdict(hdr[U_ID], DENY, error=errno.EPERM)
            with pytest.raises(PermissionError):
                c.result()
            assert stats()["mmaps"] == before["mmaps"] + 1
            # MAP_PRIVATE is reported as such (nvsim then refuses it).
            c = MmapChild(uvm, PAGE, mmap.MAP_PRIVATE)
            hdr, attrs = g.next_upcall()
            assert MMAP_PARAMS.unpack(attrs[A_PARAMS])[3] == 2
            g.verdict(hdr[U_ID], ALLOW)
            with pytest.raises(OSError) as e:
                c.result()
            if vg.nvsim:
                assert e.value.errno == errno.EINVAL
            # Other nodes are not upcalled.
            with contextlib.suppress(OSError):
                _mmap(ctl, PAGE)
            assert stats()["upcalls"] == before["upcalls"] + 3
            # Fail policy: closed refuses, open forwards.
            g.unregister()
            with pytest.raises(OSError) as e:
                _mmap(uvm, PAGE)
            assert e.value.errno == errno.EHOSTDOWN
            set_param("vgpu", "fail_open", "1")
            with contextlib.suppress(OSError):
                _mmap(uvm, PAGE)
            assert stats()["fail_open"] == before["fail_open"] + 1
        # Without the flag no mmap is upcalled.
        set_param("vgpu", "fail_open", "0")
        set_filter([])
        before = stats()
        if vg.nvsim:
            _mmap(uvm, PAGE)
        assert stats()["upcalls"] == before["upcalls"]
    finally:
        os.close(ctl)
        os.close(uvm)


def test_mmap_upcall_caller_killed(vg: Env) -> None:
    """A caller killed while waiting under mmap_lock leaves no waiter."""
    if not (vg.dev / "nvidia-uvm").exists():
        pytest.skip("no nvidia-uvm node")
    code = ("import mmap, os\n"
            "fd = os.open('/dev/vgpu/nvidia-uvm', os.O_RDWR)\n"
            "print('calling', flush=True)\n"
            "mmap.mmap(fd, 4096)\n"
            "print('returned', flush=True)\n")
    with daemon([], FILTER_UVM_MMAP) as g:
        before = stats()
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                 text=True, cwd=ROOT)
        hdr, _ = g.next_upcall(timeout=30)
        assert hdr[U_KIND] == UPCALL_MMAP
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=5) == -signal.SIGKILL
        assert "returned" not in child.stdout.read()
        with pytest.raises(NlError) as e:
            g.verdict(hdr[U_ID], ALLOW)
        assert e.value.errno == errno.ENOENT
        assert stats()["killed"] == before["killed"] + 1


def test_kmemleak_clean(vg: Env) -> None:
    leak = Path("/sys/kernel/debug/kmemleak")
    if not leak.exists():
        pytest.skip("kernel without CONFIG_DEBUG_KMEMLEAK")
    leak.write_text("scan")
    report = leak.read_text()
    assert "vgpu" not in report, report
