"""The real vgpud as a subprocess, ready when it says READY=1 (sd_notify).

Shared by the VM tests (tests/vm/conftest.py), the demo and the benchmark.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# vgpud's lifecycle over a test policy (--policy, --filter): tests.support.testdaemon.
TEST_DAEMON = "tests.support.testdaemon"


class Daemon:
    """`python -m vgpud.daemon ARGS` with a NOTIFY_SOCKET of its own.

    Its output goes to a log file (`log()`), or to ours with `echo=True`.
    """

    def __init__(self, *args: str, log_level: str = "debug", echo: bool = False,
                 probes: bool = False, fs: bool = False, prefix: tuple[str, ...] = (),
                 entry: str = "vgpud.daemon") -> None:
        """``probes``: load the latency probes (a bcc compile: 6-20 s of the
        guest's CPU); off unless a test is about them. ``fs``: mount the file
        view (vgpud.fsview); off unless a test is about it. ``prefix``: a
        command to run it under (setpriv dropping a capability). ``entry``:
        the module run, TEST_DAEMON for a test policy."""
        self.args = ("--log-level", log_level, *(() if probes else ("--no-probes",)),
                     *(() if fs else ("--no-fs",)), *args)
        self.echo = echo
        self.prefix = prefix
        self.entry = entry
        self.dir = tempfile.mkdtemp(prefix="vgpud-")
        self.log_path = Path(self.dir) / "vgpud.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._notify: socket.socket | None = None

    def start(self, timeout: float = 180.0) -> Daemon:
        """Start it; wait for READY=1 (a loaded TCG guest can take a minute)."""
        sock_path = os.path.join(self.dir, f"notify-{time.monotonic_ns()}")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(sock_path)
        notify.settimeout(timeout)
        env = dict(os.environ, NOTIFY_SOCKET=sock_path)
        with open(self.log_path, "ab") as log:
            out = None if self.echo else log
            self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", self.entry,
                                          *self.args],
                                         stdout=out, stderr=subprocess.STDOUT, env=env)
        self._notify = notify  # kept bound until the daemon is gone (STOPPING=1)
        try:
            while "READY=1" not in notify.recv(4096).decode().split("\n"):
                pass
        except TimeoutError:
            self.kill()
            raise AssertionError(f"vgpud not ready in {timeout}s:\n{self.log()}") from None
        return self

    def _close_notify(self) -> None:
        if self._notify is not None:
            path = self._notify.getsockname()
            self._notify.close()
            os.unlink(path)
            self._notify = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_notify()

    def stop(self) -> int:
        """SIGTERM and wait: a graceful drain exits 0."""
        assert self.proc is not None
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                return self.proc.wait(timeout=30)
            return self.proc.returncode
        finally:
            self._close_notify()
