"""TDMA tenants in the VM: cgroups t0..tN-1 under /sys/fs/cgroup, the daemon's
config giving them weights, their workload (tests/support/tdma_workload.py),
and their GPU time read from nvsim's own counters (/proc/driver/nvsim/groups).
Used by tests/vm/test_tdma.py and tests/bench/bench_tdma_vm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tests.support import nvclient as nv
from tests.support import tdma_workload
from tests.support.guest import ROOT

CGROOT = Path("/sys/fs/cgroup")


def config_text(state: Path, weights: Sequence[int], frame_ms: int = 100) -> str:
    text = f'[daemon]\nstate_path = "{state}"\nframe_ms = {frame_ms}\n'
    for i, weight in enumerate(weights):
        text += (f'\n[[tenant]]\nname = "t{i}"\nweight = {weight}\n'
                 f'match = [{{ cgroup = "/vgpu-tdma-t{i}" }}]\n')
    return text


class Tenants:
    """The workload process(es) and what they allocated; tenant i is cgroup t{i}.

    Each tenant's pending work is kept at `queue_ms` or more, checked every
    `period_ms` (the workload's --target-ms and --period-ms)."""

    def __init__(self, count: int, per_process: int = 16, queue_ms: float = 40.0,
                 period_ms: float = 10.0) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.where: list[tuple[int, int]] = []  # tenant -> (process, index in it)
        self.clients: list[int] = []
        for first in range(0, count, per_process):
            ids = range(first, min(count, first + per_process))
            argv = ["/dev/vgpu", "--target-ms", str(queue_ms), "--period-ms", str(period_ms)]
            for i in ids:
                argv += ["--cgroup", str(CGROOT / f"vgpu-tdma-t{i}")]
            proc = subprocess.Popen(tdma_workload.command(*argv), cwd=ROOT,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.procs.append(proc)
            self.where += [(len(self.procs) - 1, j) for j in range(len(ids))]
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line, "the workload died (see its stderr)"
            self.clients += [t["client"] for t in json.loads(line)["tenants"]]

    def command(self, tenant: int, what: str) -> None:
        proc, index = self.where[tenant]
        stdin = self.procs[proc].stdin
        assert stdin is not None
        stdin.write(f"{what} {index}\n")
        stdin.flush()

    def busy(self) -> list[int]:
        by_client = {g.client: g.busy_ns for g in nv.proc_groups()}
        return [by_client[c] for c in self.clients]

    def pending(self, tenant: int) -> int:
        return next(g.pending_ns for g in nv.proc_groups() if g.client == self.clients[tenant])

    def all_pending(self) -> list[int]:
        by_client = {g.client: g.pending_ns for g in nv.proc_groups()}
        return [by_client[c] for c in self.clients]

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def open_as_tenant(i: int) -> int:
    """A nvidiactl file of tenant i: opened from inside its cgroup, then back home."""
    home = CGROOT / Path(Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
                         ).relative_to("/")
    (CGROOT / f"vgpu-tdma-t{i}" / "cgroup.procs").write_text(str(os.getpid()))
    try:
        return os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
    finally:
        (home / "cgroup.procs").write_text(str(os.getpid()))
