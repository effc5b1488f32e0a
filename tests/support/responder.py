"""tests/support/c_responder.c, the minimal C responder of the upcall protocol, as
the tests use it: compiled once per session, started with a filter and an
action, its output lines ("ready", "upcall k=v ...", "event k=v ...") read in
a thread.
"""

from __future__ import annotations

import queue
import select
import subprocess
import threading
import time
from pathlib import Path

from tests.support.calls import RM_ALLOC
from tests.support.guest import ROOT

SOURCE = ROOT / "tests/support/c_responder.c"
# A rule for RM_ALLOC (NVOS21) of class 0x40 (hClass at offset 12).
CLASS40 = ("-f", f"ctl:{RM_ALLOC:#x}:0:12:-:-:0x40")


def build(out_dir: Path) -> Path:
    """Compile the responder into out_dir; returns the binary."""
    out = out_dir / "c_responder"
    res = subprocess.run(["gcc", "-O2", "-Wall", "-I", str(ROOT / "kmod/include/uapi"), "-o",
                          str(out), str(SOURCE)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    return out


class Responder:
    """The responder as a process, registered and ready when made."""

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


def start(responders: list[Responder], binary: Path, *args: str) -> Responder:
    """A responder, killed when the test ends (the `responders` fixture)."""
    r = Responder(binary, *args)
    responders.append(r)
    return r
