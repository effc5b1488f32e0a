"""Fixtures for tests that need the nvsim module (run inside the VM tier).

`nvsim_loaded()` (a generator to wrap in a fixture) yields the simulator's
nodes and parameters.  When /dev/nvsim/nvidiactl is missing and we are
root with a built kmod/nvsim/nvsim.ko, it loads the module (gpus=2
mem_mib=1024) for the fixture's scope and unloads it afterwards; set
NVSIM_AUTOLOAD=0 to never load.
Otherwise the tests skip with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import nvclient  # noqa: E402

NVSIM_DIR = "/dev/nvsim"
KO = TESTS.parent / "kmod" / "nvsim" / "nvsim.ko"
PARAMS = Path("/sys/module/nvsim/parameters")


@dataclass
class Nvsim:
    nodes: nvclient.NvNodes
    gpus: int
    mem_mib: int

    @property
    def capacity_kib(self) -> int:
        return self.mem_mib * 1024


def _param(name: str) -> int:
    return int((PARAMS / name).read_text().strip())


def _wait_for(path: str, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if os.path.exists(path):
            return True
        time.sleep(0.05)
    return os.path.exists(path)


def nvsim_loaded():
    """Generator for a fixture: yields Nvsim, loading the module if needed."""
    nodes = nvclient.NvNodes(NVSIM_DIR)
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
