"""A bound cgroup (vgpuctl bind-cgroup) claims its whole subtree, whatever
the tenant does inside it: a hostile tenant (an unprivileged uid) that was
delegated the bound cgroup makes a child cgroup, moves into it, forks, and
the forked process opens and allocates: it is still the bound tenant's,
held to that tenant's limit, not the tenant its uid's rule names.

Judged by nvsim's own free video memory and the daemon's per-tenant usage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.bus import PrivateBus
from tests.support.guest import NVSIM_DIR, remove_cgroup
from tests.support.hostile import TENANT_GID, TENANT_UID, spawn_tenant
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm

MiB = 1 << 20
NV_ERR_NO_MEMORY = 0x51
CGROOT = Path("/sys/fs/cgroup")

# "t" has no rule: only the binding puts anything in it. "u" claims the
# tenant's uid with a limit that would grant both blocks.
CONFIG = f"""\
[daemon]
state_path = "{{state}}"
charges_path = "{{charges}}"

[[tenant]]
name = "t"
memory = "64MiB"

[[tenant]]
name = "u"
memory = "512MiB"
match = [{{{{ uid = {TENANT_UID} }}}}]
"""

# Runs as the tenant's uid in the cgroup it was delegated: a child cgroup of
# its own, the process moved there, then a fork; the child allocates two
# 48 MiB blocks, reports, and holds them until a line on stdin.
ESCAPE = r"""
import json, os, sys
from tests.support import nvclient as nv
mine = "/sys/fs/cgroup" + open("/proc/self/cgroup").read().split("0::")[1].strip()
os.mkdir(mine + "/escape")
with open(mine + "/escape/cgroup.procs", "w") as f:
    f.write(str(os.getpid()))
pid = os.fork()
if pid == 0:
    fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
    tree = nv.build_tree(fd)
    rs = [nv.alloc_memory(fd, tree.client, tree.subdevice, 48 << 20) for _ in range(2)]
    cgroup = open("/proc/self/cgroup").read().split("0::")[1].strip()
    print(json.dumps({"cgroup": cgroup, "allocs": [[r.errno, r.status] for r in rs]}),
          flush=True)
    sys.stdin.readline()
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.fixture
def bind_daemon(vgpu: Path, daemon_factory: type[Daemon], tmp_path: Path) -> Iterator[Daemon]:
    bus = PrivateBus()
    os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = bus.address
    config = tmp_path / "vgpud.toml"
    config.write_text(CONFIG.format(state=tmp_path / "state.json",
                                    charges=tmp_path / "run" / "charges"))
    daemon = daemon_factory("--config", str(config)).start()
    try:
        yield daemon
    finally:
        daemon.kill()
        print(daemon.log())  # shown by pytest when the test fails
        bus.close()
        del os.environ["DBUS_SYSTEM_BUS_ADDRESS"]


@pytest.fixture
def delegated() -> Iterator[Path]:
    """A cgroup handed to the tenant's uid (its directory and cgroup.procs),
    as a runtime delegates one to a rootless container."""
    if not (CGROOT / "cgroup.controllers").exists():
        pytest.skip("cgroup v2 is not mounted at /sys/fs/cgroup in this guest")
    path = CGROOT / "vgpu-bind-test"
    path.mkdir()
    for p in (path, path / "cgroup.procs"):
        os.chown(p, TENANT_UID, TENANT_GID)
    yield path
    if (path / "escape").exists():
        remove_cgroup(path / "escape")
    remove_cgroup(path)


def vgpuctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpud.cli", *args], capture_output=True,
                          text=True, check=False, timeout=300)


def used() -> dict[str, int]:
    res = vgpuctl("tenant", "list", "--json")
    assert res.returncode == 0, res.stderr
    return {t["name"]: sum(int(v) for v in t["memory_used"].values())
            for t in json.loads(res.stdout)}


def gpu0_free_kib() -> int:
    ctl = nv.NvNodes(str(NVSIM_DIR)).open_ctl()
    try:
        return nv.heap_free_kib(ctl, nv.build_tree(ctl))
    finally:
        os.close(ctl)


def escape(cgroup: Path) -> tuple[dict, subprocess.Popen[str]]:
    tenant = spawn_tenant(ESCAPE, cgroup=cgroup, stdin=True)
    assert tenant.stdout is not None
    line = tenant.stdout.readline()
    assert line, tenant.communicate(timeout=60)
    return json.loads(line), tenant


def release(tenant: subprocess.Popen[str]) -> None:
    out, err = tenant.communicate("\n", timeout=120)
    assert tenant.returncode == 0, (out, err)


@pytest.mark.timeout(1200)
def test_a_child_cgroup_of_a_bound_cgroup_is_the_bound_tenants(
        bind_daemon: Daemon, delegated: Path) -> None:
    free = gpu0_free_kib()
    # Unbound, the same moves land in "u" by the uid rule: both blocks granted.
    report, tenant = escape(delegated)
    try:
        assert report["allocs"] == [[0, 0], [0, 0]], report
        assert used() == {"t": 0, "u": 96 * MiB}
        assert gpu0_free_kib() == free - (96 * MiB >> 10)
    finally:
        release(tenant)
    remove_cgroup(delegated / "escape")
    assert used() == {"t": 0, "u": 0}

    res = vgpuctl("bind-cgroup", "/vgpu-bind-test", "t")
    assert res.returncode == 0, res.stderr
    report, tenant = escape(delegated)
    try:
        assert report["cgroup"] == "/vgpu-bind-test/escape"
        # t's 64 MiB: the first block, then an ordinary out-of-memory that
        # nvsim never sees.
        assert report["allocs"] == [[0, 0], [0, NV_ERR_NO_MEMORY]], report
        assert used() == {"t": 48 * MiB, "u": 0}
        assert gpu0_free_kib() == free - (48 * MiB >> 10)
    finally:
        release(tenant)
    assert used() == {"t": 0, "u": 0}
    assert gpu0_free_kib() == free


@pytest.mark.timeout(1200)
def test_a_cgroup_removed_and_made_again_is_not_bound(bind_daemon: Daemon,
                                                      delegated: Path) -> None:
    """The tenant cannot keep a binding by remaking the bound cgroup: the
    binding names the cgroup the daemon saw (its id), not the path."""
    (delegated / "inner").mkdir()
    res = vgpuctl("bind-cgroup", "/vgpu-bind-test/inner", "t")
    assert res.returncode == 0, res.stderr
    (delegated / "inner").rmdir()
    (delegated / "inner").mkdir()
    os.chown(delegated / "inner", TENANT_UID, TENANT_GID)
    os.chown(delegated / "inner" / "cgroup.procs", TENANT_UID, TENANT_GID)
    try:
        report, tenant = escape(delegated / "inner")
        try:
            assert report["cgroup"] == "/vgpu-bind-test/inner/escape"
            assert report["allocs"] == [[0, 0], [0, 0]], report  # "u"'s, by its uid
            assert used() == {"t": 0, "u": 96 * MiB}
        finally:
            release(tenant)
    finally:
        if (delegated / "inner" / "escape").exists():
            remove_cgroup(delegated / "inner" / "escape")
        remove_cgroup(delegated / "inner")
