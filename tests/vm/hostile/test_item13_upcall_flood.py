"""Item 13: no fairness between tenants on the upcall socket.

Every upcall went out on the daemon's one netlink socket, whatever its
sender had in flight: a tenant with many threads, each on a context of its
own, filled the socket's receive buffer, and the module then failed the
other tenants' upcalls as lost (EHOSTDOWN, or forwarded them unchecked with
fail-open). Now a context has at most `upcalls_per_ctx` upcalls in flight,
an opener (uid and cgroup) at most `upcalls_per_opener`, the module at most
`upcalls_max`; a caller over a bound waits, killable, for a slot (counted
as `throttled`) instead of sending.

Tenant "a" (uid 1003) floods from 16 processes of 64 threads, each thread on
its own context, alternating RM_FREE and RM_CONTROL with a 16 KiB params
block (the largest upcall a tenant can make), for at least 10 s; tenant "b"
(uid 1004) allocates and frees 4 MiB in a loop, once alone and once under
the flood, in the same run. Judged by the module's own counters over b's
window (no upcall lost, none failed closed or forwarded open), by b's calls
(every one answered and done, and at least 100 of them under the flood),
and by nvsim (what it holds never exceeds b's quota).

b's p99 call latency under the flood against alone (the issue's target: at
most 3x) is printed and recorded in docs/performance.md, not asserted: in a
TCG guest on a shared 2-core host the ratio of two p99s swings from 1.2x to
8.6x between runs of the same code (docs/threat-model.md, item 13).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import nvclient as nv
from tests.support import vgpu_genl
from tests.support.guest import ROOT, set_param
from tests.support.hostile import TENANT_UID, attacker_binary, spawn_tenant, start_daemon
from tests.support.nvsim import Fds, HeapSampler
from tests.support.vgpud_proc import Daemon

pytestmark = pytest.mark.vm

MIB = 2**20
QUOTA = 64 * MIB
B_UID = 1004
SIZE = 4 * MIB
PROCS, THREADS = 16, 64
FLOOD_S = 30.0
RAMP_S = 6.0  # the flood's threads open their files and start
ITERATIONS = 400  # alloc + free each: 800 calls per phase

TWO_TENANTS = f"""\
[[tenant]]
name = "a"
memory = "64MiB"
match = [{{ uid = {TENANT_UID} }}]

[[tenant]]
name = "b"
memory = "{QUOTA // MIB}MiB"
match = [{{ uid = {B_UID} }}]
"""

# Tenant b: for each line "N SECONDS" on stdin, up to N rounds of alloc +
# free (stopping after SECONDS), then one JSON line: each call's latency
# (ns) and the calls that failed.
B_WORKLOAD = r"""
import json, os, sys, time
from tests.support import nvclient as nv
fd = os.open("/dev/vgpu/nvidiactl", os.O_RDWR)
tree = nv.build_tree(fd)
print("ready", flush=True)
clock = time.perf_counter_ns
for line in sys.stdin:
    n, seconds = line.split()
    end = time.monotonic() + float(seconds)
    lat, bad = [], []
    for i in range(int(n)):
        if time.monotonic() > end:
            break
        t0 = clock()
        r = nv.alloc_memory(fd, tree.client, tree.subdevice, SIZE)
        lat.append(clock() - t0)
        if r.errno or r.status:
            bad.append(["alloc", r.errno, r.status])
            continue
        t0 = clock()
        e, st = nv.rm_free(fd, tree.client, tree.subdevice, r.handle)
        lat.append(clock() - t0)
        if e or st:
            bad.append(["free", e, st])
    print(json.dumps({"lat": lat, "bad": bad}), flush=True)
""".replace("SIZE", str(SIZE))


@pytest.fixture
def daemon(vgpu: Path, daemon_factory, tmp_path: Path) -> Iterator[Daemon]:
    # The module's default, not the fixture's 2 s for failure tests: a loaded
    # TCG guest stalls the daemon for seconds now and then, flood or not.
    set_param("vgpu", "upcall_timeout_ms", "5000")
    d = start_daemon(daemon_factory, tmp_path, TWO_TENANTS)
    yield d
    print(d.log()[-4000:])


@pytest.fixture(scope="module")
def flooder() -> Iterator[Path]:
    with attacker_binary("attack_flood") as exe:
        yield exe


def spawn_b() -> subprocess.Popen[str]:
    argv = ["setpriv", f"--reuid={B_UID}", f"--regid={B_UID}", "--clear-groups",
            "--inh-caps=-all", sys.executable, "-c", B_WORKLOAD]
    return subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def b_phase(b: subprocess.Popen[str], n: int, seconds: float) -> dict:
    assert b.stdin is not None and b.stdout is not None
    b.stdin.write(f"{n} {seconds}\n")
    b.stdin.flush()
    line = b.stdout.readline()
    assert line, f"tenant b died: {b.stderr.read() if b.stderr else ''}"
    return json.loads(line)


def p99(lat: list[int]) -> float:
    s = sorted(lat)
    return s[min(len(s) - 1, int(len(s) * 0.99))] / 1e6


def p50(lat: list[int]) -> float:
    return sorted(lat)[len(lat) // 2] / 1e6


def test_a_flood_loses_no_upcall_of_another_tenant(daemon: Daemon, vgpu: Path, nvsim: Path,
                                                    flooder: Path) -> None:
    fds = Fds(nv.NvNodes(nvsim))
    b = spawn_b()
    flood = None
    try:
        assert b.stdout is not None and b.stdout.readline().strip() == "ready", (
            b.stderr.read() if b.stderr else "")
        with HeapSampler(fds) as heap:
            b_phase(b, 50, 60)  # warm: imports, first calls
            base = b_phase(b, ITERATIONS, 300)
            before = vgpu_genl.stats()
            args = [str(flooder), str(vgpu / "nvidiactl"), str(PROCS), str(THREADS),
                    str(FLOOD_S)]
            flood = spawn_tenant(f"import subprocess, sys\n"
                                 f"r = subprocess.run({args!r}, capture_output=True, text=True)\n"
                                 f"print(r.stdout.strip()); print(r.stderr, file=sys.stderr)\n"
                                 f"sys.exit(r.returncode)\n")
            time.sleep(RAMP_S)
            t0 = time.monotonic()
            under = b_phase(b, ITERATIONS, FLOOD_S - RAMP_S - 4)
            b_s = time.monotonic() - t0
            # b's window, the flood still running: its end (a's 1024 files
            # closed at once, CLOSE events the slots do not bound; the
            # threat model's residual) is counted apart.
            mid = vgpu_genl.stats()
            out, err = flood.communicate(timeout=FLOOD_S + 600)
            after = vgpu_genl.stats()
        delta = {k: mid[k] - before[k] for k in mid if k not in ("version", "daemon_portid")}
        end = {k: after[k] - mid[k] for k in after if k not in ("version", "daemon_portid")}
        print(f"flood (tenant a, uid {TENANT_UID}): {out.strip()} in {FLOOD_S:.0f} s")
        print(f"tenant b (uid {B_UID}): alone {len(base['lat'])} calls, p50 "
              f"{p50(base['lat']):.2f} ms, p99 {p99(base['lat']):.2f} ms; under the flood "
              f"{len(under['lat'])} calls in {b_s:.1f} s, p50 {p50(under['lat']):.2f} ms, p99 "
              f"{p99(under['lat']):.2f} ms "
              f"(ratio {p99(under['lat']) / p99(base['lat']):.2f}, target <= 3); "
              f"failed alone {len(base['bad'])}, under the flood {len(under['bad'])} "
              f"{under['bad'][:5]}")
        names = ("upcalls", "verdicts", "lost", "timeouts", "fail_open", "fail_closed", "killed",
                 "events_lost", "throttled")
        print("module counters during b's calls under the flood: " + ", ".join(
            f"{k} {delta[k]}" for k in names if k in delta))
        print("module counters from then to the flood's end: " + ", ".join(
            f"{k} {end[k]}" for k in names if k in end))
        print(f"nvsim held at most {max(heap.samples) // MIB} MiB in {len(heap.samples)} "
              f"samples (b's quota {QUOTA // MIB} MiB)")
        assert flood.returncode == 0, err
        assert int(out.split()[1]) > 0
        assert base["bad"] == []
        assert under["bad"] == []
        assert len(under["lat"]) >= 100
        assert delta["lost"] == 0
        assert delta["fail_closed"] == 0 and delta["fail_open"] == 0
        assert max(heap.samples) <= QUOTA
        # The latency target (p99 under the flood <= 3x alone) is a
        # figure, printed above and recorded in docs/performance.md, not an
        # assertion: in a TCG guest on a shared 2-core host the ratio of two
        # p99s swings from 1.2x to 8.6x between runs with the same code.
    finally:
        if flood is not None:
            flood.kill()
        b.kill()
        fds.close_all()
