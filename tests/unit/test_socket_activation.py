"""The helpers' sockets: the one systemd passes (sd_listen_fds(3)), or one
they bind themselves for --listen."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from vgpud.host.systemd import listen_unix, passed_socket

# A child that puts one end of a socketpair at fd 3 and, as systemd would,
# names itself in LISTEN_PID (or not), then sends through passed_socket().
CHILD = """
import os, socket, sys
from vgpud.host.systemd import passed_socket
a, b = socket.socketpair()
os.dup2(a.fileno(), 3)
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_PID"] = str(os.getpid() + int(sys.argv[1]))
try:
    passed_socket("connection").sendall(b"hello")
except LookupError as exc:
    print(exc)
else:
    print(b.recv(5).decode())
"""


@pytest.mark.parametrize(("pid_offset", "says"), [
    (0, "hello"),
    (1, "no connection from systemd (LISTEN_FDS): use --listen"),
])
def test_the_passed_socket_is_fd_3_for_this_pid_only(pid_offset: int, says: str) -> None:
    out = subprocess.run([sys.executable, "-c", CHILD, str(pid_offset)], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    assert out == says + "\n"


def test_without_systemd_there_is_no_passed_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LISTEN_FDS", raising=False)
    with pytest.raises(LookupError, match="no socket from systemd"):
        passed_socket("socket")


def test_listen_unix_replaces_a_stale_socket_and_is_0600(tmp_path: Path) -> None:
    path = tmp_path / "helper.sock"
    path.write_text("stale")
    umask = os.umask(0o022)
    os.umask(umask)
    with listen_unix(str(path)) as server:
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
            conn, _ = server.accept()
            conn.close()
    assert os.umask(umask) == umask  # the process's umask is left as it was
