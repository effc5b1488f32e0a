"""Tenant workloads as processes: tests/support/tenant_workload.py started
inside a cgroup (VM tests), and write(2) of a file view's values."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

from tests.support import tenant_workload

ROOT = Path(__file__).resolve().parents[2]


class CgroupWorkload:
    """tests/support/tenant_workload.py started inside ``cgroup``."""

    def __init__(self, cgroup: Path, *args: str) -> None:
        procs = str(cgroup / "cgroup.procs")

        def enter() -> None:
            Path(procs).write_text(str(os.getpid()))

        self.proc = subprocess.Popen(tenant_workload.command("/dev/vgpu", *args), cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=enter)

    def lines(self, n: int) -> list[dict]:
        assert self.proc.stdout is not None
        return [json.loads(self.proc.stdout.readline()) for _ in range(n)]

    def statuses(self, n: int) -> list[int]:
        return [line["status"] for line in self.lines(n)]

    def wait_holding(self) -> None:
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "holding"

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.communicate("\n", timeout=60)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def writes(path: Path, *chunks: bytes) -> list[int | str]:
    """write(2) each chunk on one open file: bytes written or the errno name."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    out: list[int | str] = []
    try:
        for chunk in chunks:
            try:
                out.append(os.write(fd, chunk))
            except OSError as exc:
                out.append(errno.errorcode[exc.errno or 0])
    finally:
        os.close(fd)
    return out
