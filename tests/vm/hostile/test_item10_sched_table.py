"""Item 10: one tenant fills the module's table of groups turned off.

The module remembers each channel group it turned off, until it is turned
on or its context closes. A group freed while off (RM_FREE of the group,
its device or its client) left its record behind, so a tenant that made
and freed groups with fresh handles filled the table, and from then on
every tenant's "off" failed with ENOSPC: time slicing stopped host-wide.
Now a full table is swept in the daemon's process (each record's "off"
issued again; records of groups that are gone are dropped), so what stays
is at most the groups that exist and are off.

The table is made small (sched_off_max=64) so the attack fills it many times
over. The tenant (uid 1003) makes and frees CHURN groups, each turned off at
alloc by the daemon's verdict (VERDICT_F_SCHED_OFF); then a victim's group
is turned off with SCHEDULE. Judged by nvsim: the victim's group is off, and
the module's table holds no more than its limit.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.calls import Call
from tests.support.guest import get_param, set_param
from tests.support.hostile import spawn_tenant
from tests.support.sched import aio, group_enabled, list_contexts
from tests.support.vgpu_genl import ALLOW, CTL, U_ID, daemon, rule

pytestmark = pytest.mark.vm

CHURN = 1000
TABLE = 64
SCHED_OFF = 1 << 1
SCHED_STATE_OFF = 0
CMD_SCHEDULE, A_SCHED, A_SCHED_RESULT = 9, 13, 14
SCHED = struct.Struct("=QIIII")
TSG_RULES = [rule(CTL, 0x2B, 32, 12, (nv.KEPLER_CHANNEL_GROUP_A,))]

# Makes and frees CHURN channel groups (fresh handles: nvsim's), then waits.
ATTACK = r"""
import json, os, sys
from tests.support import nvclient as nv
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(fd)
made = 0
for _ in range(CHURN):
    r = nv.rm_alloc(fd, tree.client, tree.device, 0, nv.KEPLER_CHANNEL_GROUP_A,
                    nv.TSG_ALLOC.pack(0, 0, 0, 0, 0))
    if r.errno == 0 and r.status == 0:
        made += 1
        nv.rm_free(fd, tree.client, tree.device, r.handle)
print(json.dumps({"made": made}), flush=True)
sys.stdin.readline()
"""


def test_churned_groups_do_not_fill_the_table(vgpu: Path) -> None:
    set_param("vgpu", "sched_off_max", str(TABLE))
    fd = os.open(vgpu / "nvidiactl", os.O_RDWR)
    tenant = None
    try:
        tree = nv.build_tree(fd)
        with daemon(TSG_RULES) as g:
            tenant = spawn_tenant(f"CHURN = {CHURN}\n{ATTACK}", stdin=True)
            for _ in range(CHURN):  # every churned group: off at alloc
                hdr, _ = g.next_upcall(timeout=120)
                g.verdict(hdr[U_ID], ALLOW, flags=SCHED_OFF)
            assert tenant.stdout is not None
            made = json.loads(tenant.stdout.readline())["made"]
            print(f"attempts: {CHURN} groups made and freed by the tenant, {made} made")
            assert made == CHURN
            assert int(get_param("vgpu", "sched_offs")) <= TABLE

            # The victim: a group of ours, turned off by the daemon.
            call = Call(nv.rm_alloc, fd, tree.client, tree.device, 0,
                        nv.KEPLER_CHANNEL_GROUP_A, nv.TSG_ALLOC.pack(0, 0, 0, 0, 0))
            hdr, _ = g.next_upcall()
            g.verdict(hdr[U_ID], ALLOW)
            victim = call.result()
            assert (victim.errno, victim.status) == (0, nv.NV_OK)
            ctx = max(c.ctx_id for c in aio(list_contexts()) if c.tgid == os.getpid())
            _, (reply,) = g.request(CMD_SCHEDULE, [(A_SCHED, SCHED.pack(
                ctx, tree.client, victim.handle, SCHED_STATE_OFF, 0))])
            assert list(struct.iter_unpack("=iI", reply[A_SCHED_RESULT])) == [(0, 0)]
            assert group_enabled(tree.client, victim.handle) is False
            offs = int(get_param("vgpu", "sched_offs"))
            print(f"records after the sweep: {offs} (limit {TABLE})")
            assert offs == 1  # the victim's: the tenant's freed groups were swept
    finally:
        if tenant is not None:
            tenant.kill()
            tenant.wait()
        os.close(fd)
        set_param("vgpu", "sched_off_max", "65536")
