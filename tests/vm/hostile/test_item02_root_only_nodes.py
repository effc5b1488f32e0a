"""Item 2: the real nodes are root-only, and tenants still work through vgpu.

vgpu once opened the backing node with the caller's credentials, so the real
nodes had to stay open to every tenant, who could then simply open them and
bypass everything. Now the module opens them with the credentials it was
loaded with: nvsim is loaded with node_mode=0600 (as systemd/
nvidia-root-only.conf and udev/71-nvidia-root-only.rules make NVIDIA's
nodes), uid 1003 cannot open /dev/nvsim/* (not even as root of its own user
namespace), and works through /dev/vgpu/* - directly, or with
scripts/vgpu-run, which binds the emulated nodes over /dev/nvidia* for a
host tenant.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.guest import NVSIM_DIR, ROOT, VGPU_DIR, get_param, nvsim_loaded
from tests.support.hostile import TENANT_UID, run_tenant, tenant_argv

pytestmark = pytest.mark.vm

NODES = ("nvidiactl", "nvidia0", "nvidia1", "nvidia-uvm")

# Tries every node of DIR; reports the errno of each open (0: opened) and,
# through nvidiactl, CARD_INFO's result and a root client.
PROBE = r"""
import json, os
from tests.support import nvclient as nv
out = {"uid": os.getuid(), "opens": {}}
for name in NAMES:
    try:
        fd = os.open(os.path.join(DIR, name), os.O_RDWR)
    except OSError as e:
        out["opens"][name] = e.errno
        continue
    out["opens"][name] = 0
    if name == "nvidiactl":
        out["card_info"] = nv.card_info(fd)[0]
        out["client"] = nv.alloc_client(fd)
        out["rdev"] = os.fstat(fd).st_rdev
print(json.dumps(out))
"""


def probe(directory: Path | str, *, userns: bool = False) -> dict:
    code = f"DIR = {str(directory)!r}\nNAMES = {NODES!r}\n{PROBE}"
    res = run_tenant(code, userns=userns, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


@pytest.fixture
def nvsim() -> Iterator[Path]:
    """nvsim with root-only nodes: overrides tests/vm's, under its `vgpu` fixture."""
    yield from nvsim_loaded(1024, "node_mode=0600")


def test_backing_nodes_are_root_only(vgpu: Path) -> None:
    for name in NODES:
        st = os.stat(NVSIM_DIR / name)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, 0, 0), name


@pytest.mark.parametrize("userns", [False, True], ids=["uid-1003", "unshare-Urm"])
def test_tenant_cannot_open_the_real_nodes(vgpu: Path, userns: bool) -> None:
    calls = get_param("nvsim", "rm_calls")
    seen = probe(NVSIM_DIR, userns=userns)
    assert seen["opens"] == {name: errno.EACCES for name in NODES}
    assert get_param("nvsim", "rm_calls") == calls


def test_tenant_works_through_vgpu(vgpu: Path) -> None:
    calls = int(get_param("nvsim", "rm_calls"))
    seen = probe(VGPU_DIR)
    assert seen["opens"] == {name: 0 for name in NODES}
    assert (seen["uid"], seen["card_info"]) == (TENANT_UID, 0) and seen["client"] != 0
    assert int(get_param("nvsim", "rm_calls")) == calls + 2


@pytest.fixture
def real_nodes(vgpu: Path) -> Iterator[list[Path]]:
    """Stand-ins for a GPU host's /dev/nvidia*: nvsim's devices, root-only."""
    made = []
    try:
        for name in NODES:
            path = Path("/dev") / name
            assert not path.exists(), f"{path} exists in the guest"
            os.mknod(path, 0o600 | stat.S_IFCHR, os.stat(NVSIM_DIR / name).st_rdev)
            made.append(path)
        yield made
    finally:
        for path in made:
            path.unlink()


def test_vgpu_run_gives_a_host_tenant_the_emulated_nodes(real_nodes: list[Path]) -> None:
    assert probe("/dev")["opens"] == {name: errno.EACCES for name in NODES}
    calls = int(get_param("nvsim", "rm_calls"))
    code = f"DIR = '/dev'\nNAMES = {NODES!r}\n{PROBE}"
    argv = tenant_argv(code)
    at = argv.index(sys.executable)
    argv[at:at] = [str(ROOT / "scripts/vgpu-run")]
    res = subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout.splitlines()[-1])
    assert seen["opens"] == {name: 0 for name in NODES}
    assert (seen["uid"], seen["card_info"]) == (TENANT_UID, 0) and seen["client"] != 0
    assert seen["rdev"] == os.stat(VGPU_DIR / "nvidiactl").st_rdev  # the emulated node
    assert int(get_param("nvsim", "rm_calls")) == calls + 2
