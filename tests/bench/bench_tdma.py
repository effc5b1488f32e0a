"""Benchmark the TDMA scheduler in virtual time: n saturating tenants for 10 s.

Run: .venv/bin/python tests/bench/bench_tdma.py

A switch (outgoing off, incoming on) costs SWITCH_US of GPU time at the start
of the incoming slot. Prints, per tenant count: the worst share error against
weight / total weight (percentage points), the fraction of time lost to
switching, switches per second, and the scheduler's own CPU time per second of
scheduled time. Weights are random in 1..1000, or all equal (the most switches).
"""

from __future__ import annotations

import random
import time

from vgpud.core.tdma import GroupCreated, Runnable, TdmaConfig, TdmaScheduler, TenantAdded

SECONDS = 10
SWITCH_US = 50


def bench(weights: list[int], config: TdmaConfig) -> tuple[float, float, float, float]:
    sched = TdmaScheduler(config)
    end = SECONDS * 1_000_000
    switches = 0
    used = dict.fromkeys((f"t{i:02}" for i in range(len(weights))), 0)  # from `running`
    cpu = time.process_time()
    for i, weight in enumerate(weights):
        sched.handle(TenantAdded(f"t{i:02}", weight), 0)
        sched.handle(GroupCreated(f"t{i:02}", i), 0)
        sched.handle(Runnable(f"t{i:02}"), 0)
    last = 0
    while (deadline := sched.next_deadline()) is not None and deadline < end:
        before = sched.running
        sched.tick(deadline)
        if before is not None:
            used[before] += deadline - last
        last = deadline
        switches += sched.running != before
    if sched.running is not None:
        used[sched.running] += end - last
    sched.tick(end)
    cpu = time.process_time() - cpu
    error = max(abs(used[f"t{i:02}"] / end - w / sum(weights)) for i, w in enumerate(weights))
    return 100 * error, switches * SWITCH_US / end, switches / SECONDS, cpu / SECONDS


def main() -> None:
    rng = random.Random(1)
    for config in (TdmaConfig(), TdmaConfig(min_slot_us=2560)):
        print(
            f"frame {config.frame_us} us, min slot {config.min_slot_us} us, "
            f"{SECONDS} s virtual, {SWITCH_US} us per switch"
        )
        print(
            f"{'tenants':>14} {'share err pp':>12} {'switch loss':>11} {'switch/s':>9} "
            f"{'sched CPU/s':>11}"
        )
        for n in (2, 4, 16, 64):
            for kind, weights in (
                ("random", [rng.randint(1, 1000) for _ in range(n)]),
                ("equal", [1] * n),
            ):
                err, loss, rate, cpu = bench(weights, config)
                print(
                    f"{n:>4} {kind:>9} {err:>12.3f} {loss:>11.2%} {rate:>9.0f} {1000 * cpu:>9.2f}ms"
                )
        print()


if __name__ == "__main__":
    main()
