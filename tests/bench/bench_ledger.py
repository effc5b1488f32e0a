"""Decisions per second of the pure memory ledger, and the process RSS.

64 tenants, each with 4 contexts (client -> device), hold 10,000 live
allocations; then a steady mix runs on one core: reserve + commit of a new
allocation, free of an old one, some dups (and frees of them), some failed
allocations (release), and denials from tenants at their limit. Every ledger
call counts as one decision. With --journal DIR the ledger's durable changes
are appended to a charge journal there (vgpud.store.journal; use a tmpfs), as the
daemon does.

    .venv/bin/python tests/bench/bench_ledger.py [--ops N] [--journal /dev/shm/x]

Targets: >= 50,000 decisions/s; RSS < 80 MiB (this process; the whole daemon's
is tests/bench/bench_daemon_rss.py).
"""

from __future__ import annotations

import argparse
import random
import resource
import time
from pathlib import Path

from vgpud.core.ledger import Key, Ledger, Reservation

TENANTS = 64
CONTEXTS_PER_TENANT = 4
LIVE = 10_000
MiB = 2**20
CLIENT_BASE = 0xC1D00000  # client handle of context n: CLIENT_BASE + n


def setup(ledger: Ledger, rng: random.Random) -> tuple[list[tuple[int, Key]], list[Key]]:
    """Contexts with a client and a device each; LIVE allocations spread over them."""
    devices: list[tuple[int, Key]] = []
    for t in range(TENANTS):
        # every 8th tenant sits at a tight limit: its allocations are often denied
        limit = 64 * MiB * (LIVE // TENANTS) if t % 8 else 40 * MiB * (LIVE // TENANTS)
        ledger.set_limit(f"tenant-{t}", 0, limit)
        for c in range(CONTEXTS_PER_TENANT):
            ctx = t * CONTEXTS_PER_TENANT + c + 1
            client = CLIENT_BASE + ctx
            ledger.open(ctx, f"tenant-{t}")
            ledger.track(ctx, Key(client, client))
            ledger.track(ctx, Key(client, 0x80), Key(client, client))
            devices.append((ctx, Key(client, 0x80)))
    live: list[Key] = []
    for i in range(LIVE):
        ctx, device = devices[i % len(devices)]
        r = ledger.reserve(ctx, 0, rng.choice((2, 8, 32, 64)) * MiB, device)
        assert isinstance(r, Reservation)
        key = Key(device.client, 0x1000 + i)
        ledger.commit(r, key)
        live.append(key)
    return devices, live


def run(ledger: Ledger, devices: list[tuple[int, Key]], live: list[Key], ops: int) -> dict:
    rng = random.Random(2)
    counts = dict.fromkeys(("reserve", "denied", "commit", "release", "free", "dup"), 0)
    next_handle = 0x100000
    sizes = [rng.choice((2, 8, 32, 64, 256)) * MiB for _ in range(1024)]
    start = time.perf_counter()
    for i in range(ops):
        ctx, device = devices[rng.randrange(len(devices))]
        decision = ledger.reserve(ctx, 0, sizes[i & 1023], device)
        counts["reserve"] += 1
        if not isinstance(decision, Reservation):
            counts["denied"] += 1
        elif i % 20 == 0:  # the driver failed it
            ledger.release(decision)
            counts["release"] += 1
        else:
            next_handle += 1
            key = Key(device.client, next_handle)
            ledger.commit(decision, key)
            counts["commit"] += 1
            live.append(key)
        if i % 10 == 0:  # a second handle to some live memory
            existing = live[rng.randrange(len(live))]
            next_handle += 1
            dup = Key(existing.client, next_handle)
            ledger.dup(existing.client - CLIENT_BASE, dup, existing, None)
            counts["dup"] += 1
            live.append(dup)
        while len(live) > LIVE:  # keep the live set at its size: free a random old one
            j = rng.randrange(len(live))
            live[j], live[-1] = live[-1], live[j]
            ledger.free(live.pop())
            counts["free"] += 1
    elapsed = time.perf_counter() - start
    decisions = sum(v for k, v in counts.items() if k != "denied")
    return {"elapsed": elapsed, "decisions": decisions, **counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200_000, help="allocation attempts")
    parser.add_argument("--journal", type=Path, help="journal the ledger in this directory")
    args = parser.parse_args()
    ledger = Ledger()
    journal = None
    if args.journal is not None:
        from vgpud.store.journal import ChargeAndGroupJournal, Identity  # (not in the core's RSS)

        args.journal.mkdir(parents=True, exist_ok=True)
        journal = ChargeAndGroupJournal(args.journal / "charges", Identity("bench", "bench"),
                                        ledger)
        assert journal.start()
        ledger.observers.subscribe(journal)
    devices, live = setup(ledger, random.Random(1))
    result = run(ledger, devices, live, args.ops)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rate = result["decisions"] / result["elapsed"]
    print(f"tenants {TENANTS}, contexts {len(devices)}, live allocations {len(live)}")
    print(
        "decisions {decisions} in {elapsed:.2f}s: reserve {reserve} (denied {denied}), "
        "commit {commit}, release {release}, dup {dup}, free {free}".format(**result)
    )
    print(f"rate {rate:,.0f} decisions/s (target >= 50,000)")
    print(f"max RSS {rss_mib:.1f} MiB (target < 80)")
    if journal is not None:
        print(f"journal {journal.path}: {journal.path.stat().st_size / 2**20:.1f} MiB, "
              f"{journal.compactions} compactions")
        journal.close()


if __name__ == "__main__":
    main()
