"""Item 14: a tenant uses a GPU outside its `gpus` list.

The daemon once let a tenant with `gpus = [0]` open /dev/vgpu/nvidia1 and
make a device on GPU 1 (and, under a parent it did not know, charged memory
to a GPU it guessed). Now: the open of a GPU outside the list is refused
(EACCES), a device on such a GPU looks absent (NV_ERR_INVALID_CLASS, as the
driver answers a device instance that does not exist), and memory under a
parent that is not a device the daemon saw is refused
(NV_ERR_INVALID_OBJECT_PARENT). Judged by nvsim: its count of opens and of
calls moves only for what was allowed, and GPU 1's free heap does not move.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.guest import get_param
from tests.support.hostile import TENANT_UID, run_tenant, start_daemon
from tests.support.nvsim import Fds, heap_free
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm

ROUNDS = 200

TENANTS = """\
[[tenant]]
name = "t"
memory = "64MiB"
gpus = [0]
match = [{ uid = {uid} }]
"""

# Every way the tenant tries GPU 1, ROUNDS times; then one honest tree on GPU 0.
ATTACK = r"""
import collections, json, os
from tests.support import nvclient as nv
seen = collections.Counter()
ctl = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
client = nv.alloc_client(ctl)
for i in range(ROUNDS):
    try:
        os.close(os.open("/dev/vgpu/nvidia1", os.O_RDWR))
        seen["open1 ok"] += 1
    except OSError as e:
        seen[f"open1 errno {e.errno}"] += 1
    r = nv.rm_alloc(ctl, client, client, 0, nv.NV01_DEVICE_0, nv.device_params(1))
    seen[f"device1 {r.errno}/{r.status:#x}"] += 1
    r = nv.alloc_memory(ctl, client, 0xBAD00 + i, 4 << 20)
    seen[f"orphan memory {r.errno}/{r.status:#x}"] += 1
tree = nv.build_tree(ctl, 0)
r = nv.alloc_memory(ctl, tree.client, tree.subdevice, 4 << 20)
seen[f"gpu0 memory {r.errno}/{r.status:#x}"] += 1
print(json.dumps(seen))
"""


@pytest.fixture
def daemon(vgpu: Path, daemon_factory, tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(daemon_factory, tmp_path, TENANTS.replace("{uid}", str(TENANT_UID)))
    yield d
    print(d.log())


def test_gpu_outside_the_list_is_out_of_reach(daemon: Daemon, nvsim: Path) -> None:
    fds = Fds(nv.NvNodes(nvsim))
    try:
        ctl = fds.ctl()
        gpu1 = nv.build_tree(ctl, 1)
        free1 = heap_free(ctl, gpu1)
        opens, calls = int(get_param("nvsim", "opens")), nv.rm_calls()
        res = run_tenant(f"ROUNDS = {ROUNDS}\n{ATTACK}", timeout=900)
        assert res.returncode == 0, res.stderr
        seen = json.loads(res.stdout.splitlines()[-1])
        print(f"attempts: {3 * ROUNDS} on GPU 1: {seen}")
        assert seen == {
            "open1 errno 13": ROUNDS,
            f"device1 0/{nv.NV_ERR_INVALID_CLASS:#x}": ROUNDS,
            f"orphan memory 0/{nv.NV_ERR_INVALID_OBJECT_PARENT:#x}": ROUNDS,
            "gpu0 memory 0/0x0": 1,
        }
        # nvsim saw one open (nvidiactl) and only the allowed calls: the first
        # client, then client, device, subdevice and memory on GPU 0, and the
        # daemon's three questions about that memory (VGPU_CMD_OBJECT: class,
        # parent, size).
        assert int(get_param("nvsim", "opens")) == opens + 1
        assert nv.rm_calls() == calls + 5 + 3
        assert heap_free(ctl, gpu1) == free1
    finally:
        fds.close_all()
