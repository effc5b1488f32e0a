"""scripts/gpu-quota-check (step 5 of gpu-check) rehearsed over nvsim.

On a GPU machine the script loads vgpu over /dev, starts vgpud with a 2 GiB
tenant and runs a PyTorch program with the emulated nodes bound over
/dev/nvidia* in a mount namespace. Here the same script runs over
/dev/nvsim (GPUs of 4 GiB, so that only the quota can refuse 3 GiB), with a
program of tests' own client that opens /dev/nvidiactl: 1 GiB must pass,
3 GiB more must fail with NV_ERR_NO_MEMORY, and everything must be undone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.guest import (
    NVSIM_DIR,
    NVSIM_KO,
    VGPU_OVER_NVSIM,
    insmod,
    loaded,
    rmmod,
    wait_path,
)

pytestmark = pytest.mark.vm

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tests.support import nvclient as nv
ctl = nv.NvNodes("/dev").open_ctl()
t = nv.build_tree(ctl)
one = nv.alloc_memory(ctl, t.client, t.device, 1 << 30)
three = nv.alloc_memory(ctl, t.client, t.device, 3 << 30)
print("1 GiB status", hex(one.status), "3 GiB status", hex(three.status))
sys.exit(0 if (one.errno, one.status, three.errno, three.status) == (0, 0, 0, 0x51) else 1)
"""


@pytest.fixture
def placeholders() -> Iterator[None]:
    """The names a program opens under /dev, which this guest has no driver for."""
    made = []
    for name in ("nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm"):
        p = Path("/dev") / name
        if not p.exists():
            p.touch()
            made.append(p)
    yield
    for p in made:
        p.unlink()


def test_quota_step_over_nvsim(placeholders: None, tmp_path: Path) -> None:
    insmod(NVSIM_KO, "gpus=2", "mem_mib=4096")
    wait_path(NVSIM_DIR / "nvidiactl")
    try:
        res = subprocess.run([str(ROOT / "scripts/gpu-quota-check"), str(tmp_path),
                              str(NVSIM_DIR), sys.executable, "-c", PROGRAM],
                             capture_output=True, text=True, timeout=600,
                             env={**os.environ, "VGPU_PARAMS": " ".join(VGPU_OVER_NVSIM[1:])})
    finally:
        assert not loaded("vgpu")  # the script unloaded it
        assert rmmod("nvsim").returncode == 0
    report = (tmp_path / "quota.txt").read_text()
    print(res.stdout, res.stderr, report)
    assert res.returncode == 0
    assert "(bound over /dev: nvidia-uvm nvidia0 nvidia1 nvidiactl)" in report
    assert "1 GiB status 0x0 3 GiB status 0x51" in report
    assert "quota: gpu-check asked 3221225472 bytes" in report
