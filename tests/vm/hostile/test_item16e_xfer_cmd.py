"""Item 16e: an XFER wrapper's command is classified as the driver classifies it.

The module took IOCTL_XFER_CMD's inner command as `_IOC_NR(cmd)`, while the
driver (and nvsim) compare the whole value: a wrapper with cmd 0x12B, which
the driver refuses (EINVAL), was upcalled and decided as an RM_ALLOC (0x2B).
Now the module takes the whole value too: no rule selects 0x12B, the wrapper
reaches the driver as read and is refused there.

The tenant (uid 1003, with the real daemon) sends such wrappers around a
charged allocation; judged by nvsim and the module's own counters: nvsim got
each call and refused it, its heap did not move, and no upcall was sent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.hostile import spawn_tenant
from tests.support.nvsim import Fds, heap_free
from tests.support.vgpu_genl import stats
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm

ROUNDS = 200

# ROUNDS wrappers whose cmd has bits above the escape number, around a 16 MiB
# RM_ALLOC of NV01_MEMORY_LOCAL_USER; then the same call wrapped properly.
ATTACK = r"""
import collections, ctypes, json, os
from tests.support import nvclient as nv
seen = collections.Counter()
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(fd)
def wrapped(cmd, handle):
    mem = nv.cbuf(nv.memory_params(16 << 20))
    p = nv.cbuf(nv.NVOS21.pack(tree.client, tree.subdevice, handle, nv.NV01_MEMORY_LOCAL_USER,
                               nv.addr(mem), len(mem), 0xFFFF))
    x = ctypes.create_string_buffer(nv.XFER.pack(cmd, len(p), nv.addr(p)), nv.XFER.size)
    e = nv.raw_ioctl(fd, nv.ioc(nv.ESC_IOCTL_XFER_CMD, nv.XFER.size), x)
    return f"{e}/{nv.NVOS21.unpack(p.raw)[6]:#x}"
for i in range(ROUNDS):
    seen[wrapped(nv.ESC_RM_ALLOC | (0x100 << (i % 3 * 8)), 0xC0000 + i)] += 1
seen["plain " + wrapped(nv.ESC_RM_ALLOC, 0xD0000)] += 1
print(json.dumps(seen), flush=True)
input()  # holds the allocation until the test has looked
"""




def test_wrapper_cmd_is_the_drivers_whole_value(daemon: Daemon, nvsim: Path) -> None:
    fds = Fds(nv.NvNodes(nvsim))
    tenant = None
    try:
        ctl = fds.ctl()
        root = nv.build_tree(ctl, 0)
        free0, calls, upcalls = heap_free(ctl, root), nv.rm_calls(), stats()["upcalls"]
        tenant = spawn_tenant(f"ROUNDS = {ROUNDS}\n{ATTACK}", stdin=True)
        line = tenant.stdout.readline()
        assert line, tenant.communicate(timeout=60)[1]
        seen = json.loads(line)
        sent = stats()["upcalls"] - upcalls
        print(f"attempts: {ROUNDS} wrappers with a high cmd: {seen}; upcalls {sent}")
        assert seen == {"22/0xffff": ROUNDS, "plain 0/0x0": 1}  # EINVAL, params untouched
        # The open, the tree (client, device, subdevice) and the plain alloc
        # with its POST upcall (the driver-truth check) were upcalled; none of
        # the wrappers was.
        assert sent == 6
        # nvsim got every call (the tree, the wrappers, the plain alloc) ...
        # (and the daemon's three questions about that allocation, OBJECT)
        assert nv.rm_calls() - calls == 3 + ROUNDS + 1 + 3
        # ... and holds the plain allocation only.
        assert (free0 - heap_free(ctl, root)) * 1024 == 16 << 20
        tenant.communicate("\n", timeout=60)
        assert tenant.returncode == 0
    finally:
        if tenant is not None:
            tenant.kill()
            tenant.wait()
        fds.close_all()
