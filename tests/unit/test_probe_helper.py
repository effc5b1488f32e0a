"""vgpud-probes served over a real Unix socket, with fake probes (no bcc), and
RemoteProbes and ProbeService against it."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from vgpud.probes import helper, remote
from vgpud.probes.bcc_probes import ProbesUnavailable
from vgpud.probes.helper import Session, serve
from vgpud.probes.layout import LAT_SLOTS, LAT_TOTAL, lat_call
from vgpud.probes.remote import RemoteProbes, helper_reason
from vgpud.probes.service import ProbeService
from vgpud.probes.wire import (
    REPLY_MAX,
    REQUEST_MAX,
    Op,
    Request,
    Status,
    decode_reply,
    encode_request,
)
from vgpud.store.config import ConfigError, parse_config
from vgpud.wire import HEADER_SIZE, MAGIC, body_length, frame

CALL = lat_call(0x2B, 0x40)
KEY = (7, LAT_TOTAL, CALL)


class FakeProbes:
    """LatencyProbes' surface over a dict; every instance is recorded."""

    made: ClassVar[list[FakeProbes]] = []

    def __init__(self, source: Path) -> None:
        self.source = source
        self.map: dict[tuple[int, int, int], list[int]] = {
            KEY: [0, 3] + [0] * (LAT_SLOTS - 2) + [300]}
        self.attach_points = ["tracepoint vgpu:vgpu_ioctl_enter", "kprobe nvsim_ioctl (driver0)"]
        self.waiting = "waiting"
        self.is_stale = False
        self.closed = False
        FakeProbes.made.append(self)

    def load(self) -> list[str]:
        if self.source.name == "fail":
            raise ProbesUnavailable("bcc could not load it")
        return self.attach_points

    def stale(self) -> bool:
        return self.is_stale

    def reattach(self) -> bool:
        self.is_stale = False
        return True

    def read(self) -> dict[tuple[int, int, int], list[int]]:
        if self.source.name == "boom":
            raise RuntimeError("bcc said no")
        return dict(self.map)

    def delete(self, keys: Iterable[tuple[int, int, int]]) -> None:
        for key in keys:
            self.map.pop(key, None)

    def dropped(self) -> int:
        return 5

    def close(self) -> None:
        self.closed = True


def session(source: str = "x", reason: str | None = None) -> Session:
    return Session(make=FakeProbes, reason=lambda: reason, source=lambda: Path(source))


@pytest.fixture
def server() -> Iterator[tuple[Path, dict[str, object]]]:
    """A helper on a socket in tmp_path; the dict sets the next sessions' source
    and reason."""
    FakeProbes.made = []
    public = Path(tempfile.mkdtemp(prefix="vgpud-probes-"))
    public.chmod(0o755)  # tmp_path is root's alone: another user could not reach the socket
    path = public / "probes.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, 0o666)  # the peer check, not the mode, must refuse others
    sock.listen(8)
    opts: dict[str, object] = {"source": "x", "reason": None}
    thread = threading.Thread(target=serve, daemon=True, args=(
        sock, lambda: session(str(opts["source"]), opts["reason"])))  # type: ignore[arg-type]
    thread.start()
    yield path, opts
    sock.close()
    shutil.rmtree(public)


def connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s


def recv_reply(s: socket.socket, op: Op) -> tuple[Status, object, str]:
    n = body_length(recv_exact(s, HEADER_SIZE), REPLY_MAX)
    reply = decode_reply(op, recv_exact(s, n))
    return reply.status, reply.value, reply.text


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        assert chunk, "the helper closed the connection"
        out += chunk
    return out


def ask(s: socket.socket, req: Request) -> tuple[Status, object, str]:
    s.sendall(frame(encode_request(req), REQUEST_MAX))
    return recv_reply(s, req.op)


def wait_closed(probes: FakeProbes) -> None:
    for _ in range(200):
        if probes.closed:
            return
        time.sleep(0.01)
    raise AssertionError("the probes were not detached")


def test_served_load_read_delete_and_detach_on_close(server: tuple[Path, dict[str, object]]
                                                      ) -> None:
    path, _ = server
    with connect(path) as s:
        assert ask(s, Request(Op.READ))[0] is Status.ERR  # before LOAD: nothing happens
        assert FakeProbes.made == []
        status, value, _ = ask(s, Request(Op.LOAD))
        assert status is Status.OK and value == (True, FakeProbes.made[0].attach_points)
        assert ask(s, Request(Op.LOAD))[1] == value and len(FakeProbes.made) == 1
        assert ask(s, Request(Op.READ))[1] == FakeProbes.made[0].map
        assert ask(s, Request(Op.STALE))[1] is False
        assert ask(s, Request(Op.DROPPED))[1] == 5
        assert ask(s, Request(Op.DELETE, (KEY,)))[0] is Status.OK
        assert ask(s, Request(Op.READ))[1] == {}
    wait_closed(FakeProbes.made[0])


def test_malformed_requests_get_an_error_and_change_nothing(
        server: tuple[Path, dict[str, object]]) -> None:
    path, _ = server
    with connect(path) as s:
        assert ask(s, Request(Op.LOAD))[0] is Status.OK
        probes = FakeProbes.made[0]
        before = dict(probes.map)
        for body in (b"", b"\x99", b'{"op":"nope"}', b'{"op":"read","keys":[]}',
                     b'{"op":"delete"}', b'{"op":"delete","keys":[[1,2]]}',
                     b'{"op":"delete","keys":[[1,2,-1]]}', b'["delete",[[7,0,1]]]'):
            s.sendall(frame(body, REQUEST_MAX))
            status, _, text = recv_reply(s, Op.LOAD)
            assert status is Status.ERR and "malformed" in text, body
        # A frame past the bound: its bytes are skipped, the stream stays in step.
        s.sendall(MAGIC + struct.pack("<I", REQUEST_MAX + 1) + b"\xff" * (REQUEST_MAX + 1))
        assert recv_reply(s, Op.LOAD)[0] is Status.ERR
        assert probes.map == before and not probes.closed
        assert ask(s, Request(Op.READ))[1] == before
    wait_closed(probes)


@pytest.mark.parametrize("header", [b"VGW\x02\x0d\x00\x00\x00", b"\x00\x00\x00\x0dVGW\x01",
                                    b"GET / HT"])
def test_a_header_not_ours_is_answered_then_the_connection_closed(
        server: tuple[Path, dict[str, object]], header: bytes) -> None:
    """Another version, the old big-endian framing, or no frame at all: the
    stream is out of step, so the helper answers ERR and closes (detaching
    that connection's probes); it serves the next connection."""
    path, _ = server
    with connect(path) as s:
        assert ask(s, Request(Op.LOAD))[0] is Status.OK
        s.sendall(header + b'{"op":"read"}')
        status, _, text = recv_reply(s, Op.READ)
        assert status is Status.ERR and "malformed" in text
        assert s.recv(1) == b""
    wait_closed(FakeProbes.made[0])
    with connect(path) as s:
        assert ask(s, Request(Op.LOAD))[0] is Status.OK


def test_a_failing_probe_call_is_an_error_reply(server: tuple[Path, dict[str, object]]) -> None:
    path, opts = server
    opts["source"] = "boom"
    with connect(path) as s:
        assert ask(s, Request(Op.LOAD))[0] is Status.OK
        status, _, text = ask(s, Request(Op.READ))
        assert status is Status.ERR and "bcc said no" in text
        assert ask(s, Request(Op.DROPPED))[1] == 5  # the helper lives on


def test_unavailable_says_why(server: tuple[Path, dict[str, object]]) -> None:
    path, opts = server
    opts["reason"] = "bcc is not importable"
    with connect(path) as s:
        assert ask(s, Request(Op.LOAD)) == (Status.OFF, None, "bcc is not importable")
    opts["reason"], opts["source"] = None, "fail"
    with connect(path) as s:
        assert ask(s, Request(Op.LOAD)) == (Status.OFF, None, "bcc could not load it")
    assert FakeProbes.made[0].closed


def test_a_peer_not_root_is_refused(server: tuple[Path, dict[str, object]]) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another uid")
    path, _ = server
    code = (
        "import socket,sys\n"
        "from vgpud.probes.wire import Op, Request, encode_request, decode_reply\n"
        "from vgpud.wire import frame, read_frame\n"
        "s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1])\n"
        "s.sendall(frame(encode_request(Request(Op.LOAD)), 64))\n"
        "r = decode_reply(Op.LOAD, read_frame(s.recv, 4096))\n"
        "print(r.status.name, r.text)\n")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], check=True, timeout=60)
    assert out.stdout.strip() == "ERR uid 65534 is not root", out.stderr
    assert FakeProbes.made == []


def test_remote_probes_against_the_helper(server: tuple[Path, dict[str, object]]) -> None:
    path, _ = server
    remote = RemoteProbes(path)
    assert remote.load() == FakeProbes.made[0].attach_points == remote.attach_points
    probes = FakeProbes.made[0]
    assert remote.read() == probes.map and remote.dropped() == 5 and not remote.stale()
    probes.is_stale = True
    assert remote.stale() and remote.reattach() and not probes.is_stale
    remote.delete([KEY, (1, 1, 1)])
    assert probes.map == {}
    remote.close()
    assert probes.closed  # close returned once the helper had detached
    # Lost: stale, and reattach connects and loads again.
    assert remote.stale() and remote.reattach()
    assert len(FakeProbes.made) == 2 and remote.read() == FakeProbes.made[1].map
    remote.close()


def test_remote_probes_say_why_off(tmp_path: Path, server: tuple[Path, dict[str, object]]
                                   ) -> None:
    path, opts = server
    assert helper_reason(path) is None
    assert "no probe helper listening at" in str(helper_reason(tmp_path / "none"))
    with pytest.raises(ProbesUnavailable, match="cannot reach the probe helper"):
        RemoteProbes(tmp_path / "none").load()
    opts["reason"] = "no kernel headers for 6.1"
    with pytest.raises(ProbesUnavailable, match=r"no kernel headers for 6.1 \(probe helper\)"):
        RemoteProbes(path).load()


def test_probe_service_through_the_helper(server: tuple[Path, dict[str, object]]) -> None:
    path, _ = server

    async def main() -> None:
        svc = ProbeService({7: "a"}.get, interval=3600, helper=path)
        svc.start()
        while svc.status == "loading":
            await asyncio.sleep(0.01)
        assert svc.status == "on: " + ", ".join(FakeProbes.made[0].attach_points)
        await svc.read()
        hist = svc.latency("a")[("RM_ALLOC:0x40", "total")]
        assert hist.total == 3 and svc.dropped == 5
        await svc.stop()
        assert svc.status == "off: stopped"

    asyncio.run(main())
    wait_closed(FakeProbes.made[0])


def test_probe_service_without_the_helper(tmp_path: Path) -> None:
    async def main() -> None:
        svc = ProbeService(lambda _: None, helper=tmp_path / "absent.sock")
        svc.start()
        while svc.status == "loading":
            await asyncio.sleep(0.01)
        assert svc.status == (f"off: no probe helper listening at {tmp_path}/absent.sock "
                              "(systemctl enable --now vgpud-probes.socket)")

    asyncio.run(main())


def test_idle_helper_exits(tmp_path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "s"))
    sock.listen(1)
    t0 = time.monotonic()
    serve(sock, session, idle_exit=1)
    assert 1 < time.monotonic() - t0 < 10
    assert helper.MAX_CONNECTIONS >= 2  # a restarting daemon's new connection fits


def test_config_names_the_helper_socket() -> None:
    assert parse_config('[probes]\nhelper = "/run/vgpud-probes.sock"\n', "c").probes.helper \
        == Path("/run/vgpud-probes.sock")
    assert parse_config("", "c").probes.helper is None
    for bad in ('"run/x.sock"', '""', "3"):
        with pytest.raises(ConfigError, match=r"probes\.helper"):
            parse_config(f"[probes]\nhelper = {bad}\n", "c")


def test_stop_while_loading_ends_the_wait(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper that never answers LOAD (one that cannot start): the daemon's
    stop closes the connection, so no worker thread is left waiting on it."""
    path = tmp_path / "mute.sock"
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(str(path))
    mute.listen(1)  # connections queue; nothing accepts them
    monkeypatch.setattr(remote, "LOAD_TIMEOUT_S", 15.0)  # without the close: 15 s, a failure

    async def main() -> float:
        svc = ProbeService(lambda _: None, helper=path)
        svc.start()
        await asyncio.sleep(0.3)
        assert svc.status == "loading"
        t0 = time.monotonic()
        await svc.stop()
        assert svc.status == "off: stopped"
        return time.monotonic() - t0

    t0 = time.monotonic()
    stopped_in = asyncio.run(main())  # returns once the executor's threads are done
    assert stopped_in < 5 and time.monotonic() - t0 < 10
    mute.close()
