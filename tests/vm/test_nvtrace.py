"""The recorder against nvsim: tests' own client recorded, checked and re-issued.

A varied run of tests/support/nvclient.py (tests/vm/nvtrace_scenario.py) is recorded
by libnvtrace.so straight on /dev/nvsim, and through /dev/vgpu with the
quota daemon running. Each recording must
- say what the client saw (its client handle, held memory, refused calls);
- pass the replay check (decoders, sizes, the ledger against the trace);
- replay to the same statuses: every call re-issued against a fresh nvsim
  gives the recorded errno and NVIDIA status.
With NVTRACE_SAVE=DIR set, the traces are also copied there, compressed
(that is how tests/data/traces/ was made; see its README).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.guest import (
    NVSIM_DIR,
    NVSIM_KO,
    VGPU_DIR,
    VGPU_KO,
    VGPU_OVER_NVSIM,
    insmod,
    rmmod,
    wait_path,
)
from tools.nvtrace.calls import Ioctl, events
from tools.nvtrace.check import check_traces, format_text
from tools.nvtrace.fmt import Trace, read_trace
from tools.nvtrace.nvsim_src import read_nvsim
from vgpud.nvidia.escapes import Escape

pytestmark = pytest.mark.vm

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "tools/nvtrace/libnvtrace.so"
SCENARIO = Path(__file__).with_name("nvtrace_scenario.py")
MIB = 1 << 20
NV_ERR_INVALID_OBJECT_HANDLE, NV_ERR_NO_MEMORY, EINVAL = 0x33, 0x51, 22

CONFIG = """\
[daemon]
default_tenant = "t"
state_path = "{state}"
charges_path = "{charges}"

[[tenant]]
name = "t"
memory = "512MiB"
"""


@pytest.fixture(scope="module")
def lib() -> Path:
    subprocess.run(["make", "-s", "-C", str(LIB.parent)], check=True)
    return LIB


def record(lib: Path, nodes: Path, out: Path) -> tuple[dict, list[Trace]]:
    """The scenario on ``nodes`` under the recorder: its JSON line, and its traces."""
    out.mkdir()
    env = {**os.environ, "LD_PRELOAD": str(lib), "NVTRACE_DIR": str(out),
           "NVTRACE_PREFIXES": f"{nodes}/"}
    res = subprocess.run([sys.executable, str(SCENARIO), str(nodes)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    traces = sorted((read_trace(p) for p in out.iterdir()), key=lambda t: t.header.pid)
    save = os.environ.get("NVTRACE_SAVE")
    if save:
        Path(save).mkdir(parents=True, exist_ok=True)
        for t, role in zip(traces, ("client", "child"), strict=True):
            name = f"nvclient-{nodes.name}-{role}.nvtrace.gz"
            (Path(save) / name).write_bytes(gzip.compress(Path(t.path).read_bytes(), mtime=0))
    return json.loads(res.stdout), traces


def assert_recorded(seen: dict, traces: list[Trace]) -> None:
    """The trace says what the client saw, and passes the replay check."""
    parent, child = traces
    assert child.header.ppid == parent.header.pid
    calls = [ev for ev in events(parent) if isinstance(ev, Ioctl)]
    first_alloc = next(c for c in calls if c.nr == Escape.RM_ALLOC)
    assert first_alloc.params_out is not None
    assert int.from_bytes(first_alloc.params_out[8:12], "little") == seen["client"]
    failed = [c.status for c in calls if c.status not in (None, 0)]
    assert NV_ERR_NO_MEMORY in failed and NV_ERR_INVALID_OBJECT_HANDLE in failed
    assert any(c.err == EINVAL for c in calls)
    assert any(c.xfer for c in calls)
    res = check_traces(traces, nvsim=read_nvsim())
    print(format_text(res))
    assert res.ok, res.all_findings
    assert [lr.held_end for lr in res.ledger] == [seen["held"], 2 * MIB]
    assert all(lr.ledger_end == lr.held_end and lr.after_close == 0 for lr in res.ledger)


def reissue_on_fresh_nvsim(trace_dir: Path) -> None:
    """Every call sent again to a freshly loaded nvsim gives the recorded outcome."""
    assert rmmod("nvsim").returncode == 0
    insmod(NVSIM_KO, "gpus=2", "mem_mib=1024")
    wait_path(NVSIM_DIR / "nvidiactl")
    # The command line of docs/nvtrace.md: run from the repository root.
    res = subprocess.run([sys.executable, "-m", "tools.nvtrace", "reissue", "--nodes",
                          str(NVSIM_DIR), str(trace_dir)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    print(res.stdout, res.stderr)
    assert res.returncode == 0
    assert "skipped" not in res.stdout
    assert res.stdout.count(" differ") == 2 and ", 0 differ" in res.stdout


def test_record_on_nvsim_checks_and_replays(lib: Path, nvsim: Path, tmp_path: Path) -> None:
    seen, traces = record(lib, nvsim, tmp_path / "traces")
    assert seen["held"] == 76 * MIB + 4 * MIB + 64 * 1024
    assert seen["statuses"] == [NV_ERR_NO_MEMORY, NV_ERR_INVALID_OBJECT_HANDLE, EINVAL]
    assert_recorded(seen, traces)
    reissue_on_fresh_nvsim(tmp_path / "traces")


def test_record_through_vgpu_with_the_daemon(lib: Path, nvsim: Path, daemon_factory,
                                             tmp_path: Path) -> None:
    insmod(VGPU_KO, *VGPU_OVER_NVSIM, "upcall_timeout_ms=5000")
    wait_path(VGPU_DIR / "nvidiactl")
    config = tmp_path / "vgpud.toml"
    config.write_text(CONFIG.format(state=tmp_path / "state.json",
                                    charges=tmp_path / "charges"))
    daemon = daemon_factory("--config", str(config), "--no-dbus").start(timeout=300)
    try:
        seen, traces = record(lib, VGPU_DIR, tmp_path / "traces")
    finally:
        daemon.stop()
        print(daemon.log())
        assert rmmod("vgpu").returncode == 0
    assert "quota:" in daemon.log()  # the 1 TiB alloc was refused by the policy
    assert seen["statuses"] == [NV_ERR_NO_MEMORY, NV_ERR_INVALID_OBJECT_HANDLE, EINVAL]
    assert_recorded(seen, traces)
    reissue_on_fresh_nvsim(tmp_path / "traces")
