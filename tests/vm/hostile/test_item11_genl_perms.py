"""Items 11 and 16c: a CAP_NET_ADMIN process that is not the daemon.

Any process with CAP_NET_ADMIN could once install a filter (an empty one
sends every call straight to the driver), read the module's counters and
contexts, register as the responder while the daemon restarts, and send the
daemon's netlink port messages that looked like the kernel's. Now SET_FILTER
is the registered daemon's only; REGISTER, GET_STATS and LIST_CONTEXTS need
a sender in the initial pid namespace (host root; GET_STATS and
LIST_CONTEXTS also the daemon); and the daemon's socket is connected to the
kernel, which refuses unicasts to it from any other port.

The attacker is uid 1003 with CAP_NET_ADMIN alone (ambient), pid 1 of a pid
namespace of its own, as a hostNetwork container with NET_ADMIN is. The
tenant (uid 1003, 64 MiB) holds 48 MiB and asks for 48 MiB more after each
attack. Judged by nvsim: its heap holds 48 MiB for the tenant at the end.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support.guest import ROOT
from tests.support.hostile import (
    ALLOC_48MIB_PER_LINE,
    ONE_TENANT,
    TENANT_GID,
    TENANT_UID,
    ask,
    spawn_tenant,
    start_daemon,
)
from tests.support.nvsim import Fds, heap_free
from tests.support.vgpu_genl import stats
from tests.support.vgpud_proc import Daemon
from vgpud.kernel.channel import query_module_contexts

pytestmark = pytest.mark.vm

MIB = 2**20
CAP_NET_ADMIN = 12


PRELUDE = r"""
import json, os, struct
from tests.support import vgpu_genl as vg
out = {"pid": os.getpid()}
for line in open("/proc/self/status"):
    if line.startswith("CapEff:"):
        out["capeff"] = int(line.split()[1], 16)
g = vg.Genl()
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as e:
        out[name] = e.errno
"""

# With the daemon serving: read, rewrite, and speak as the kernel to the daemon
# (a CLOSE event for each of the tenant's contexts: forget its charges).
ATTACK = PRELUDE + r"""
attempt("get_stats", g.stats)
attempt("list_contexts", lambda: g.request(8, [(11, struct.pack("=Q", 0))]))
attempt("set_filter", lambda: g.set_filter([]))
def forge():
    for ctx in CTXS:
        ev = vg.EVENT.pack(ctx, 0, vg.EVENT_CLOSE, 0, 0, 0)
        body = struct.pack("=BBH", vg.CMD_EVENT, 1, 0) + vg.nla(vg.A_EVENT, ev)
        msg = struct.pack("=IHHII", 16 + len(body), g.family, 0, 0, 0) + body
        g.sock.sendto(msg, (PORT, 0))
attempt("forge", forge)
print(json.dumps(out), flush=True)
"""

# In the daemon's restart gap: become the responder and allow the next call.
REGISTER = PRELUDE + r"""
attempt("register", g.register)
print(json.dumps(out), flush=True)
if out["register"] == "ok":
    hdr, _ = g.next_upcall(timeout=300)
    g.verdict(hdr[vg.U_ID], vg.ALLOW)
    print(json.dumps({"allowed": hdr[vg.U_ID]}), flush=True)
"""


def attacker(code: str) -> subprocess.Popen[str]:
    """`code` as uid 1003 with CAP_NET_ADMIN only, pid 1 of a new pid namespace."""
    argv = ["unshare", "--pid", "--fork", "--kill-child",
            "setpriv", f"--reuid={TENANT_UID}", f"--regid={TENANT_GID}", "--clear-groups",
            "--inh-caps=-all,+net_admin", "--ambient-caps=+net_admin",
            "--bounding-set=-all,+net_admin", sys.executable, "-c", code]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(argv, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def first_line(p: subprocess.Popen[str]) -> dict:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line, p.stderr.read() if p.stderr else ""
    out = json.loads(line)
    assert out["pid"] == 1 and out["capeff"] == 1 << CAP_NET_ADMIN, out
    return out






def tenant_contexts() -> list[int]:
    return [c.ctx_id for c in asyncio.run(query_module_contexts()) if c.uid == TENANT_UID]


def test_net_admin_outside_the_host_pid_namespace_changes_nothing(
        daemon: Daemon, daemon_factory, tmp_path: Path, nvsim: Path) -> None:
    fds = Fds(nv.NvNodes(nvsim))
    tenant = spawn_tenant(ALLOC_48MIB_PER_LINE, stdin=True)
    gap: subprocess.Popen[str] | None = None
    try:
        root = nv.build_tree(fds.ctl(), 0)
        free0 = heap_free(fds.fds[0], root)

        def held() -> int:
            return (free0 - heap_free(fds.fds[0], root)) * 1024 // MIB

        assert tenant.stdout is not None and tenant.stdout.readline().strip() == "ready"
        assert ask(tenant) == [0, nv.NV_OK]
        code = f"CTXS = {tenant_contexts()}\nPORT = {stats()['daemon_portid']}\n{ATTACK}"
        p = attacker(code)
        seen = first_line(p)
        p.wait(timeout=120)
        after_attack = ask(tenant)
        print(f"with the daemon serving: {seen}; the tenant's next 48 MiB: {after_attack};"
              f" nvsim holds {held()} MiB for it (quota 64 MiB)")

        assert daemon.stop() == 0
        gap = attacker(REGISTER)
        in_gap = first_line(gap)
        during_gap = ask(tenant)
        gap.kill()  # its port, if registered, goes with it
        gap.wait()
        print(f"in the restart gap: {in_gap}; the tenant's next 48 MiB: {during_gap};"
              f" nvsim holds {held()} MiB")

        start_daemon(daemon_factory, tmp_path, ONE_TENANT)
        restarted = stats()["daemon_portid"]
        after_restart = ask(tenant)
        print(f"daemon back on port {restarted}; the tenant's next 48 MiB: {after_restart};"
              f" nvsim holds {held()} MiB")

        assert {k: seen[k] for k in ("get_stats", "list_contexts", "set_filter", "forge")} == {
            "get_stats": errno.EPERM, "list_contexts": errno.EPERM,
            "set_filter": errno.EPERM, "forge": errno.ECONNREFUSED}
        assert after_attack == [0, nv.NV_ERR_NO_MEMORY]
        assert in_gap["register"] == errno.EPERM
        assert during_gap == [errno.EHOSTDOWN, 0]  # fail-closed: no daemon
        assert restarted != 0
        assert after_restart == [0, nv.NV_ERR_NO_MEMORY]
        assert held() == 48
    finally:
        for proc in (tenant, gap):
            if proc is not None:
                proc.kill()
                proc.wait()
        fds.close_all()
