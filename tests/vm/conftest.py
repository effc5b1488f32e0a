"""Fixtures of the VM tier: real modules in a real kernel, the real daemon.

These tests run as root inside the guest booted by scripts/vm-run; on any
other machine they are skipped, since the kernel modules cannot be loaded.
Helpers that are not fixtures live in tests/support (guest.py: the modules
and cgroups).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import responder
from tests.support.guest import (
    NVSIM_DIR,
    VGPU_DIR,
    Env,
    in_guest,
    insmod_vgpu,
    loaded,
    nvsim_loaded,
    rmmod,
    set_param,
)
from tests.support.nvsim import Fds, Nvsim, nvsim_module
from tests.support.responder import Responder
from tests.support.sched import TRACEFS
from tests.support.vgpu_genl import set_filter
from tests.support.vgpud_proc import Daemon

# Per test: a loaded host's TCG guest takes minutes where a quiet one takes
# seconds (a Python process of the daemon or a workload starts in tens of s).
VM_TEST_TIMEOUT_S = 900

# Present only in the debug kernel of `make test-debug` (scripts/debug-guest
# mounts debugfs); there every test file ends with a scan.
KMEMLEAK = Path("/sys/kernel/debug/kmemleak")
# kmemleak reports only objects older than 5 s.
KMEMLEAK_MIN_AGE_S = 6


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if in_guest():
        for item in items:
            if "vm" in item.keywords and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(VM_TEST_TIMEOUT_S))
        return
    skip = pytest.mark.skip(reason="needs the VM tier (scripts/test-vm): modules cannot load here")
    for item in items:
        if "vm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def kmemleak_scan() -> Iterator[None]:
    """In a kernel with kmemleak: the file's tests left no unreferenced object."""
    if not (in_guest() and KMEMLEAK.exists()):
        yield
        return
    KMEMLEAK.write_text("clear")
    yield
    time.sleep(KMEMLEAK_MIN_AGE_S)
    KMEMLEAK.write_text("scan")
    report = KMEMLEAK.read_text()
    assert "unreferenced object" not in report, f"kmemleak:\n{report}"


@pytest.fixture
def nvsim() -> Iterator[Path]:
    """nvsim with 2 GPUs of 1 GiB."""
    yield from nvsim_loaded(1024)


@pytest.fixture
def vgpu(nvsim: Path) -> Iterator[Path]:
    """vgpu over nvsim (insmod_vgpu)."""
    assert nvsim == NVSIM_DIR
    insmod_vgpu()
    yield VGPU_DIR
    res = rmmod("vgpu")
    assert res.returncode == 0, f"rmmod vgpu (something still open?): {res.stderr}"


@pytest.fixture
def daemon_factory() -> Iterator[type[Daemon]]:
    started: list[Daemon] = []

    class Tracked(Daemon):
        def start(self, timeout: float = 180.0) -> Daemon:
            started.append(self)
            return super().start(timeout)

    yield Tracked
    for d in started:
        d.kill()


@pytest.fixture
def vg(request: pytest.FixtureRequest) -> Iterator[Env]:
    """The loaded module, reset to no daemon, no filter, fail-closed."""
    if loaded("vgpu") and VGPU_DIR.exists():
        dev = VGPU_DIR
    elif in_guest():
        dev = request.getfixturevalue("vgpu")
    else:
        pytest.skip("no /dev/vgpu: needs vgpu.ko loaded (scripts/vm-run)")
    set_param("vgpu", "fail_open", "0")
    set_param("vgpu", "upcall_timeout_ms", "2000")
    set_filter([])
    yield Env(dev)
    set_filter([])
    set_param("vgpu", "fail_open", "0")


@pytest.fixture(scope="session")
def responder_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/support/c_responder.c, compiled once per session."""
    return responder.build(tmp_path_factory.mktemp("responder"))


@pytest.fixture
def responders(responder_bin: Path) -> Iterator[list[Responder]]:
    """The responders a test started (responder.start), killed at its end."""
    started: list[Responder] = []
    yield started
    for r in started:
        r.kill()


@pytest.fixture
def sched_trace() -> Iterator[Path]:
    """The vgpu_schedule tracepoint, enabled and cleared; lines come from trace()."""
    if not (TRACEFS / "events").exists():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=False)
    event = TRACEFS / "events/vgpu/vgpu_schedule"
    if not event.exists():
        pytest.skip("tracefs is not available in this guest")
    (TRACEFS / "trace").write_text("")
    (event / "enable").write_text("1")
    yield TRACEFS / "trace"
    (event / "enable").write_text("0")


@pytest.fixture(scope="module")
def nvsim_env() -> Iterator[Nvsim]:
    """nvsim for the tests straight on /dev/nvsim (test_nvsim_*), once per module."""
    yield from nvsim_module()


@pytest.fixture
def fds(nvsim_env: Nvsim) -> Iterator[Fds]:
    """Files of /dev/nvsim, closed when the test ends."""
    f = Fds(nvsim_env.nodes)
    yield f
    f.close_all()


@pytest.fixture
def ctl(fds: Fds) -> int:
    """A /dev/nvsim/nvidiactl file (test files that run over vgpu define their own)."""
    return fds.ctl()
