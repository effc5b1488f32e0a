"""nvsim driven directly through /dev/nvsim, for its own tests (VM tier).

`nvsim_module()` (a generator for a fixture: `nvsim_env` in
tests/vm/conftest.py) yields the simulator's nodes and parameters; `ctxsw_ns()`
is what a PREEMPT's context switch costs its engine (the /proc views that show
it, `nv.proc_groups()` and `nv.proc_engines()`, are parsed in nvclient). When
/dev/nvsim/nvidiactl is missing and we are root with a built
kmod/nvsim/nvsim.ko, it loads the module (gpus=2 mem_mib=1024) for the
fixture's scope and unloads it afterwards; set NVSIM_AUTOLOAD=0 to never
load. Otherwise the tests skip with the reason. `Fds` and the FB helpers
are what those tests share.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import pytest

from tests.support import nvclient as nv
from tests.support.guest import NVSIM_KO as KO

NVSIM_DIR = "/dev/nvsim"
PARAMS = Path("/sys/module/nvsim/parameters")
MIB = 1 << 20
PAGE = mmap.PAGESIZE
FB_ALL = [nv.FB_RAM_SIZE, nv.FB_TOTAL_RAM_SIZE, nv.FB_HEAP_SIZE, nv.FB_HEAP_FREE,
          nv.FB_USABLE_RAM_SIZE]
BAD_PTR = 0xDEAD000000000000  # non-canonical
KERNEL_PTR = 0xFFFFFFFF81000000


@dataclass
class Nvsim:
    nodes: nv.NvNodes
    gpus: int
    mem_mib: int

    @property
    def capacity_kib(self) -> int:
        return self.mem_mib * 1024


def _param(name: str) -> int:
    return int((PARAMS / name).read_text().strip())


def ctxsw_ns() -> int:
    """The context switch a PREEMPT costs nvsim's engine (module parameter ctxsw_us)."""
    return _param("ctxsw_us") * 1000


def _wait_for(path: str, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if os.path.exists(path):
            return True
        time.sleep(0.05)
    return os.path.exists(path)


def nvsim_module():
    """Generator for a fixture: yields Nvsim, loading the module if needed."""
    nodes = nv.NvNodes(NVSIM_DIR)
    loaded_here = False
    if (not nodes.exists() and os.environ.get("NVSIM_AUTOLOAD", "1") != "0"
            and os.geteuid() == 0 and KO.exists() and not PARAMS.exists()):
        r = subprocess.run(["insmod", str(KO), "gpus=2", "mem_mib=1024"],
                           capture_output=True, text=True, check=False)
        loaded_here = r.returncode == 0
        if loaded_here:
            _wait_for(nodes.path("nvidiactl"))
    if not nodes.exists():
        pytest.skip(f"nvsim not loaded: {NVSIM_DIR}/nvidiactl does not exist "
                    "(run in the VM tier after insmod kmod/nvsim/nvsim.ko)")
    yield Nvsim(nodes, _param("gpus"), _param("mem_mib"))
    if loaded_here:
        subprocess.run(["rmmod", "nvsim"], check=False)


class Fds:
    """Opens files and closes them all at teardown."""

    def __init__(self, nodes: nv.NvNodes):
        self.nodes = nodes
        self.fds: list[int] = []

    def keep(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def ctl(self) -> int:
        return self.keep(self.nodes.open_ctl())

    def gpu(self, i: int = 0) -> int:
        return self.keep(self.nodes.open_gpu(i))

    def close(self, fd: int) -> None:
        self.fds.remove(fd)
        os.close(fd)

    def close_all(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def fb(ctl: int, tree: nv.Tree) -> dict[int, int]:
    e, st, vals = nv.fb_get_info_v2(ctl, tree.client, tree.subdevice, FB_ALL)
    assert (e, st) == (0, nv.NV_OK)
    return vals


def heap_free(ctl: int, tree: nv.Tree) -> int:
    return fb(ctl, tree)[nv.FB_HEAP_FREE]


class Sampler:
    """Samples `measure()` every `period` seconds while the block runs, and
    once at its end, in `samples`."""

    def __init__(self, measure: Callable[[], int], period: float) -> None:
        self.measure = measure
        self.period = period
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append(self.measure())

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.measure())


class HeapSampler(Sampler):
    """Samples, as root through nvsim's own nodes, what GPU 0 holds beyond
    what it held at the start, in bytes."""

    def __init__(self, fds: Fds, period: float = 0.2) -> None:
        self.ctl = fds.ctl()
        self.tree = nv.build_tree(self.ctl, 0)
        self.free0 = heap_free(self.ctl, self.tree)
        super().__init__(self.held, period)

    def held(self) -> int:
        return (self.free0 - heap_free(self.ctl, self.tree)) * 1024


class GroupSampler(Sampler):
    """Samples how many channel groups nvsim holds, of all clients, beyond
    those it held at the start."""

    def __init__(self, period: float = 0.05) -> None:
        self.base = len(nv.proc_groups())
        super().__init__(lambda: len(nv.proc_groups()) - self.base, period)
