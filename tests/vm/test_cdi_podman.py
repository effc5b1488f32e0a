"""CDI end to end with a real consumer: Debian's podman runs containers with
``--device vgpud.io/tenant=NAME`` from the spec the daemon keeps, and an
allocation through the container's /dev/nvidiactl is decided as that tenant,
a forked process's too (the hook binds the container's cgroup, not its pid).

Judged by the daemon's per-tenant usage and by nvsim's own accounting (its
free video memory, read straight from /dev/nvsim). The image is one static
binary (tests/support/cdi_alloc.c) imported from a tarball: no registry, no
network. Podman's storage is a temporary directory (vfs: no overlay over the
guest's overlays), cgroups are managed by podman itself (no systemd in the
guest), and events go to a file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.bus import PrivateBus
from tests.support.guest import NVSIM_DIR, ROOT, VGPU_DIR, wait_for
from tests.support.vgpud_proc import Daemon
from vgpud.cdi.spec import KIND, SPEC_FILE

pytestmark = pytest.mark.vm

MiB = 1 << 20
NV_ERR_NO_MEMORY = 0x51
EACCES = 13
# Podman 4.3.1 reads CDI specs from /etc/cdi and /var/run/cdi only.
SPEC_DIR = Path("/var/run/cdi")
IMAGE = "localhost/vgpud-cdi-alloc:test"
ALLOC_LINE = re.compile(r"alloc \d+ errno (\d+) status 0x([0-9a-f]+)")
# What cdi_alloc prints when it stops early (a refused open, a failed tree).
GAVE_UP = re.compile(r"\b(open|client|device|subdevice) errno")

CONFIG = """\
[daemon]
state_path = "{state}"
charges_path = "{charges}"

[cdi]
enabled = true
spec_dir = "{spec_dir}"

[[tenant]]
name = "a"
memory = "256MiB"
gpus = [0]

[[tenant]]
name = "b"
memory = "512MiB"
"""


class Podman:
    """podman with its storage, state and events under one temporary directory."""

    def __init__(self, top: Path) -> None:
        self.top = top
        self.base = ["podman", "--root", str(top / "root"), "--runroot", str(top / "runroot"),
                     "--storage-driver", "vfs", "--cgroup-manager", "cgroupfs",
                     "--events-backend", "file"]

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=600,
                             check=False)
        assert not check or res.returncode == 0, f"podman {args}: {res.stderr}"
        return res

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self("run", "--network=none", "--log-driver", "k8s-file", *args, check=check)


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    """podman, and the image of cdi_alloc built static and imported."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed (scripts/install-deps)")
    top = tmp_path_factory.mktemp("podman")
    binary = top / "cdi_alloc"
    res = subprocess.run(["gcc", "-static", "-O2", "-Wall", "-o", str(binary),
                          str(ROOT / "tests/support/cdi_alloc.c")], capture_output=True,
                         text=True, check=False)
    assert res.returncode == 0, res.stderr
    with tarfile.open(top / "image.tar", "w") as tar:
        tar.add(binary, arcname="cdi_alloc")
    p = Podman(top)
    p("import", str(top / "image.tar"), IMAGE)
    yield p
    p("rm", "--all", "--force", "--time", "0", check=False)
    shutil.rmtree(top / "root", ignore_errors=True)


@pytest.fixture
def cdi_daemon(vgpu: Path, daemon_factory: type[Daemon], tmp_path: Path) -> Iterator[Daemon]:
    bus = PrivateBus()
    os.environ["DBUS_SYSTEM_BUS_ADDRESS"] = bus.address
    config = tmp_path / "vgpud.toml"
    config.write_text(CONFIG.format(state=tmp_path / "state.json",
                                    charges=tmp_path / "run" / "charges", spec_dir=SPEC_DIR))
    daemon = daemon_factory("--config", str(config)).start()
    try:
        yield daemon
    finally:
        daemon.kill()
        print(daemon.log())  # shown by pytest when the test fails
        bus.close()
        del os.environ["DBUS_SYSTEM_BUS_ADDRESS"]
        (SPEC_DIR / SPEC_FILE).unlink(missing_ok=True)  # a SIGKILLed daemon leaves it


def vgpuctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vgpud.cli", *args], capture_output=True,
                          text=True, check=False)


def tenants() -> dict[str, dict]:
    """Every tenant's properties, by name (one vgpuctl: a Python start costs
    seconds in a loaded TCG guest)."""
    res = vgpuctl("tenant", "list", "--json")
    assert res.returncode == 0, res.stderr
    return {t["name"]: t for t in json.loads(res.stdout)}


def used() -> tuple[int, int]:
    """Bytes held by tenants a and b."""
    info = tenants()
    a, b = (sum(int(v) for v in info[name]["memory_used"].values()) for name in ("a", "b"))
    return a, b


def spec_devices() -> dict[str, list[str]]:
    """The spec file's devices: name -> container paths of its nodes."""
    spec = json.loads((SPEC_DIR / SPEC_FILE).read_text())
    assert (spec["cdiVersion"], spec["kind"]) == ("0.5.0", KIND)
    return {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]]
            for d in spec["devices"]}


def alloc_lines(output: str) -> list[tuple[int, int]]:
    """(errno, status) of each "alloc I errno E status S" line of cdi_alloc."""
    return [(int(e), int(s, 16)) for e, s in ALLOC_LINE.findall(output)]


class Holder:
    """A detached container of cdi_alloc that holds its memory until removed."""

    def __init__(self, podman: Podman, name: str, device: str, size_mib: int,
                 count: int, *modes: str) -> None:
        self.podman, self.name = podman, name
        # Its log (k8s-file) read straight from the file: no podman per poll.
        self.log = podman.top / f"{name}.log"
        podman.run("--detach", "--name", name, "--log-opt", f"path={self.log}",
                   "--device", device, IMAGE, "/cdi_alloc", str(size_mib), str(count), *modes,
                   "hold")
        wait_for(lambda: "holding" in self.logs() or GAVE_UP.search(self.logs()) is not None,
                 timeout=600, what=f"container {name} to allocate")

    def logs(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def pid(self) -> int:
        return int(self.podman("inspect", "--format", "{{.State.Pid}}", self.name).stdout)

    def cgroup(self) -> str:
        """The container's cgroup v2 path, as the host sees it."""
        text = Path(f"/proc/{self.pid()}/cgroup").read_text()
        return next(line[3:] for line in text.splitlines() if line.startswith("0::"))

    def remove(self) -> None:
        self.podman("rm", "--force", "--time", "5", self.name, check=False)


def gpu0_free_kib() -> int:
    """nvsim's own free video memory on GPU 0, asked on /dev/nvsim directly."""
    ctl = nv.NvNodes(str(NVSIM_DIR)).open_ctl()
    try:
        return nv.heap_free_kib(ctl, nv.build_tree(ctl))
    finally:
        os.close(ctl)


def test_the_spec_follows_the_tenants(cdi_daemon: Daemon) -> None:
    other = SPEC_DIR / "someone-else.json"
    other.write_text("{}")
    try:
        assert spec_devices() == {
            "a": ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0"],
            "b": ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidia1"],
        }
        assert (SPEC_DIR / SPEC_FILE).stat().st_mode & 0o7777 == 0o644
        assert vgpuctl("tenant", "create", "c", "--memory", "128MiB").returncode == 0
        assert list(spec_devices()) == ["a", "b", "c"]
        assert vgpuctl("tenant", "delete", "a").returncode == 0
        assert list(spec_devices()) == ["b", "c"]
        assert cdi_daemon.stop() == 0
        assert not (SPEC_DIR / SPEC_FILE).exists()
        assert other.read_text() == "{}"  # only its own file goes
    finally:
        other.unlink()


# Four containers and a dozen vgpuctl runs: 13 minutes were measured in a
# TCG guest on a 2-core host loaded by other guests (load average 12).
@pytest.mark.timeout(1800)
def test_a_container_allocates_as_its_tenant(cdi_daemon: Daemon, podman: Podman) -> None:
    free = gpu0_free_kib()
    a = Holder(podman, "cdi-a", f"{KIND}=a", 128, 1)
    b = None
    try:
        assert alloc_lines(a.logs()) == [(0, 0)], a.logs()
        # The hook bound the container's cgroup, as the host sees it, to a.
        assert tenants()["a"]["cgroups"] == [a.cgroup()]
        assert tenants()["a"]["pids"] == []
        assert used() == (128 * MiB, 0)
        assert gpu0_free_kib() == free - (128 * MiB >> 10)

        # b's own quota: 384 MiB, more than a's whole limit, all granted.
        b = Holder(podman, "cdi-b", f"{KIND}=b", 128, 3)
        assert alloc_lines(b.logs()) == [(0, 0)] * 3, b.logs()
        assert used() == (128 * MiB, 384 * MiB)
        assert gpu0_free_kib() == free - (512 * MiB >> 10)

        # Over a's quota inside a container: an ordinary out-of-memory that
        # nvsim never sees.
        over = podman.run("--rm", "--device", f"{KIND}=a", IMAGE, "/cdi_alloc", "256", "1")
        assert alloc_lines(over.stdout) == [(0, NV_ERR_NO_MEMORY)], over.stdout
        assert gpu0_free_kib() == free - (512 * MiB >> 10)
        assert used() == (128 * MiB, 384 * MiB)
    finally:
        for holder in (a, b):
            if holder is not None:
                holder.remove()
    wait_for(lambda: used() == (0, 0), timeout=120, what="the charges to go")
    assert gpu0_free_kib() == free
    # The poststop hook unbound both containers' cgroups.
    wait_for(lambda: tenants()["a"]["cgroups"] == tenants()["b"]["cgroups"] == [],
             timeout=120, what="the poststop hooks to unbind")


@pytest.mark.timeout(1800)
def test_a_forked_process_of_the_container_is_its_tenants(cdi_daemon: Daemon,
                                                          podman: Podman) -> None:
    """The container's main process forks; only the child opens the node and
    allocates: it is a's (a bound pid would not claim it), up to a's limit."""
    free = gpu0_free_kib()
    child = Holder(podman, "cdi-fork", f"{KIND}=a", 128, 3, "fork")
    try:
        pid = re.search(r"child pid (\d+)", child.logs())
        assert pid is not None and int(pid.group(1)) != 1, child.logs()  # not the main pid
        # 256 MiB granted, the third block over a's limit: refused, as a's.
        assert alloc_lines(child.logs()) == [(0, 0), (0, 0), (0, NV_ERR_NO_MEMORY)], \
            child.logs()
        assert used() == (256 * MiB, 0)
        assert gpu0_free_kib() == free - (256 * MiB >> 10)
    finally:
        child.remove()
    wait_for(lambda: used() == (0, 0), timeout=120, what="the charges to go")
    assert gpu0_free_kib() == free


def test_nodes_without_the_hook_are_refused(cdi_daemon: Daemon, podman: Podman) -> None:
    # The same node handed by hand: nothing binds the container, and no rule
    # nor default tenant claims it, so the open is refused. The container
    # cannot choose a tenant itself.
    res = podman.run("--rm", "--device", f"{VGPU_DIR}/nvidiactl:/dev/nvidiactl", IMAGE,
                     "/cdi_alloc", "16", "1", check=False)
    assert res.stdout.strip() == f"open errno {EACCES}", (res.stdout, res.stderr)
    # No such tenant, so no such device: podman refuses the container.
    res = podman.run("--rm", "--device", f"{KIND}=nosuch", IMAGE, "/cdi_alloc", "16", "1",
                     check=False)
    assert res.returncode != 0 and "nosuch" in res.stderr, res.stderr
    assert used() == (0, 0)
