"""Fixtures of the VM tier: real modules in a real kernel, the real daemon.

These tests run as root inside the guest booted by scripts/vm-run; on any
other machine they are skipped, since the kernel modules cannot be loaded.
Helpers that are not fixtures live in tests/support (guest.py: the modules
and cgroups).

In the guest the tier fails loudly: a skip not in ALLOWED_SKIPS fails its
test (a failed nvsim load or a missing tool must not shrink the tier into a
pass), and a line of the kernel log that reports a bug (tests/support/kmsg.py)
fails the run, with the test each line followed.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Generator, Iterator
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
from tests.support.kmsg import KMSG, KernelLog
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

IN_GUEST = in_guest()


def _pid1_is_systemd() -> bool:
    """The image booted by scripts/sysimage-run (vm-run's guest has virtme-ng's init)."""
    try:
        return Path("/proc/1/comm").read_text().strip() == "systemd"
    except OSError:
        return False


# The skips the VM tier allows in the guest, each (test file, reason as the
# skip gives it) -> (when it is allowed, why it is legitimate). Any other skip
# there fails its test. The normal tier (scripts/test-vm) skips these 12: the
# 11 of test_systemd_boot.py and test_kmemleak_clean; the 6.12 smoke
# (scripts/test-vm-612) skips test_kmemleak_clean; make test-debug and the
# booted system (scripts/sysimage-run) skip none.
ALLOWED_SKIPS: dict[tuple[str, str], tuple[Callable[[], bool], str]] = {
    ("tests/vm/test_systemd_boot.py", "needs the booted image (scripts/sysimage-run)"): (
        lambda: not _pid1_is_systemd(),
        "its tests need systemd as PID 1 and vgpud installed the packaged way: "
        "scripts/sysimage-run runs them in the booted image (make test), where "
        "this skip is not allowed"),
    ("tests/vm/test_vgpu_forwarding.py", "kernel without CONFIG_DEBUG_KMEMLEAK"): (
        lambda: not KMEMLEAK.exists(),
        "Debian's kernel has no kmemleak; the debug kernel of make test-debug "
        "has it, and there the test runs"),
}


def _skip_reason(rep: pytest.TestReport | pytest.CollectReport) -> str:
    if isinstance(rep.longrepr, tuple):
        return rep.longrepr[2].removeprefix("Skipped: ")
    return str(rep.longrepr)


def _forbidden_skip(nodeid: str, rep: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The failure text for a skip the tier does not allow, else None."""
    reason = _skip_reason(rep)
    allowed = ALLOWED_SKIPS.get((nodeid.split("::", 1)[0], reason))
    if allowed is not None and allowed[0]():
        return None
    return (f"skipped in the VM tier: {reason!r}; a skip there fails unless "
            "ALLOWED_SKIPS in tests/vm/conftest.py allows it (a failed module load "
            "or a missing tool is a failure)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None],
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    rep = yield
    if IN_GUEST and rep.skipped and not hasattr(rep, "wasxfail"):
        failure = _forbidden_skip(item.nodeid, rep)
        if failure is not None:
            rep.outcome = "failed"
            rep.longrepr = failure
    return rep


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector,
                               ) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """A whole module skipped (pytest.skip(allow_module_level=True), importorskip)."""
    rep = yield
    if IN_GUEST and rep.skipped:
        failure = _forbidden_skip(rep.nodeid, rep)
        if failure is not None:
            rep.outcome = "failed"
            rep.longrepr = failure
    return rep


# The kernel log: read from the tier's start, after each test and at the end.
_KLOG = pytest.StashKey[KernelLog]()
_KLOG_BAD = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    if IN_GUEST:
        config.stash[_KLOG] = KernelLog()
        config.stash[_KLOG_BAD] = []


def _read_kernel_log(config: pytest.Config, after: str) -> None:
    log = config.stash.get(_KLOG, None)
    if log is not None:
        config.stash[_KLOG_BAD] += [f"{line}   (after {after})" for line in log.read()]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None,
                            ) -> Generator[None, object, object]:
    try:
        return (yield)
    finally:
        _read_kernel_log(item.config, item.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A line of the kernel log that reports a bug, or one lost unread, fails the run."""
    config = session.config
    log = config.stash.get(_KLOG, None)
    if log is None:
        return
    _read_kernel_log(config, "the last test")
    if ((config.stash[_KLOG_BAD] or log.lost)
            and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    log = config.stash.get(_KLOG, None)
    if log is None:
        return
    bad = config.stash[_KLOG_BAD]
    if not (bad or log.lost):
        terminalreporter.write_line(
            f"kernel log: clean ({log.records} records read from {KMSG} while the tests ran)")
        return
    terminalreporter.section(f"kernel log: {len(bad)} line(s) report a bug; the run fails",
                             sep="=", red=True, bold=True)
    for line in bad:
        terminalreporter.write_line(line)
    if log.lost:
        terminalreporter.write_line(
            f"{log.lost} records were overwritten in the ring buffer before they were read "
            "(unjudged: the run fails)")


def pytest_unconfigure(config: pytest.Config) -> None:
    log = config.stash.get(_KLOG, None)
    if log is not None:
        log.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if IN_GUEST:
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
