"""Host benchmark of the helpers' wire encoding at its two largest messages.

1. a full probes map READ reply (vgpud.probes.wire.encode_reply, then
   decode_reply): HIST_ENTRIES entries of a key (3 u64) and 66 counts,
   once as the probes leave it (counts mostly zero, a few small) and once
   as the worst case (every value a random u64);
2. a metrics Snapshot of 8 GPUs x 4096 tenants (vgpud.metrics.wire.encode,
   then decode), and for the loop's share at the usual sizes, of 64
   tenants on 1 and on 8 GPUs.

Each figure is the best of ``--runs`` runs, in ms of CPU on this host, with
the body's size. It uses only those four functions, so that the same script
measures another tree's codecs: ``PYTHONPATH=/path/to/other/tree
.venv/bin/python tests/bench/bench_wire.py``.

Run: .venv/bin/python tests/bench/bench_wire.py [--runs N]
Prints figures; asserts nothing (docs/performance.md).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import TypeVar

from vgpud.kernel.uapi import Stats, Stats4
from vgpud.metrics import wire as metrics_wire
from vgpud.metrics.snapshot import DaemonFigures, Snapshot, TenantGpu
from vgpud.probes import wire as probes_wire

HIST_ENTRIES = 16384  # vgpud.probes.bcc_probes (not imported: it loads bcc)
WIDTH = 66  # u64s of one map value (struct vgpu_lat_val)
SIZES = ((1, 64), (8, 64), (8, 4096))  # GPUs x tenants of a metrics snapshot

T = TypeVar("T")


def best(fn: Callable[[], T], runs: int) -> tuple[float, T]:
    """The best time of ``runs`` calls, in ms, and the last result."""
    fastest, out = float("inf"), None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        fastest = min(fastest, time.perf_counter() - t0)
    assert out is not None
    return fastest * 1e3, out


def probes_map(rng: random.Random, worst: bool) -> dict[tuple[int, int, int], list[int]]:
    counts: dict[tuple[int, int, int], list[int]] = {}
    while len(counts) < HIST_ENTRIES:
        if worst:
            counts[(rng.getrandbits(64), rng.getrandbits(64), rng.getrandbits(64))] = [
                rng.getrandbits(64) for _ in range(WIDTH)]
            continue
        # A context id, a histogram, a call (an escape, or the upcall's mark).
        key = (rng.getrandbits(40), rng.randrange(3),
               0xFFFFFFFF00000000 if rng.random() < 0.1 else rng.getrandbits(32))
        value = [0] * WIDTH
        value[0] = rng.getrandbits(24)  # the sum of ns
        for slot in rng.sample(range(10, 40), 6):
            value[1 + slot] = rng.getrandbits(16)
        counts[key] = value
    return counts


def snapshot(rng: random.Random, gpus: int, tenants: int) -> Snapshot:
    uuids = [f"GPU-{rng.getrandbits(128):032x}" for _ in range(gpus)]
    rows = tuple(
        TenantGpu(f"tenant-{t:04d}", g, uuids[g], rng.getrandbits(34), 16 << 30,
                  rng.randrange(100), rng.getrandbits(40), 100 / tenants,
                  rng.random() * 100 / tenants * 2)
        for t in range(tenants) for g in range(gpus))
    daemon = DaemonFigures(rng.getrandbits(32), {"allow": 1, "deny": 2, "post": 3}, 0, 0, 0,
                           tuple(rng.getrandbits(20) for _ in range(64)), rng.getrandbits(50))
    stats = Stats(*(rng.getrandbits(32) for _ in Stats.__dataclass_fields__))
    stats4 = Stats4(*(rng.getrandbits(32) for _ in Stats4.__dataclass_fields__))
    return Snapshot(rows, daemon, stats, stats4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(7)
    print(f"codec: {probes_wire.__file__}")
    op, ok = probes_wire.Op.READ, probes_wire.Status.OK
    for name, worst in (("as the probes leave it", False), ("worst case", True)):
        counts = probes_map(rng, worst)
        reply = probes_wire.Reply(ok, counts)
        enc, body = best(lambda r=reply: probes_wire.encode_reply(op, r), args.runs)
        dec, back = best(lambda b=body: probes_wire.decode_reply(op, b), args.runs)
        assert back == reply
        print(f"probes READ, {HIST_ENTRIES} entries, {name}: {len(body) / 2**20:.1f} MiB, "
              f"encode {enc:.0f} ms + decode {dec:.0f} ms = {enc + dec:.0f} ms")
    for gpus, tenants in SIZES:
        snap = snapshot(rng, gpus, tenants)
        runs = args.runs if tenants > 64 else 100 * args.runs
        enc, payload = best(lambda s=snap: metrics_wire.encode(s), runs)
        dec, back_snap = best(lambda p=payload: metrics_wire.decode(p), runs)
        assert back_snap == snap
        print(f"metrics Snapshot, {gpus} GPUs x {tenants} tenants: "
              f"{len(payload) / 2**10:,.0f} KiB, encode {enc:.3f} ms + decode {dec:.3f} ms")

if __name__ == "__main__":
    main()
