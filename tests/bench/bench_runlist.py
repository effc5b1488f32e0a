"""Benchmark the runlist planner against the simulated runlist, in virtual time.

Run: PYTHONPATH=. .venv/bin/python tests/bench/bench_runlist.py

n saturating tenants (random weights 1..10, 1 to 3 groups each, every slice
overrunning by OVERRUN_US, SWITCH_US per switch), a BusySample every
SAMPLE_US. Prints, per tenant count: the planner's own CPU time per second of
simulated time (its handle/tick calls only, not the plant's), actions per
second in the last half, the worst share error against weight / total weight
over the last half (percentage points of the busy time), the switching loss,
and when the feedback last changed a timeslice (its windows span 128 planned
rounds, so with many tenants they are long; a boost that moves within the
hysteresis changes none). Then, in samples until every
later sample is within 1 point: 1 group against 8 at 1:1, and a tenant wound
up below its share that then saturates. Last, a priority tenant's submit-to-run
wait (1 ms of work 40 ms after the last ran dry, 100 wakes) behind n saturating
tenants of random weights 1..1000, which the planner hears of (Submitted) 20 ms
late, as an activity poll would: with its group at the HIGH interleave level,
and with levels ignored (a driver that refuses them).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable

from tests.support.runlist_plant import SATURATING, Demand, Loop, Plant
from vgpud.core.runlist import Action, Event, RunlistPlanner, SetInterleave, Submitted

SWITCH_US = 20
OVERRUN_US = 60
SAMPLE_US = 1_000_000


class TimedPlanner(RunlistPlanner):
    """Counts the CPU time spent in the planner."""

    cpu = 0.0
    calls = 0

    def handle(self, event: Event, now_us: int) -> list[Action]:
        start = time.process_time()
        try:
            return super().handle(event, now_us)
        finally:
            self.cpu += time.process_time() - start
            self.calls += 1


def converged(lp: Loop, want: dict[str, float], start: int = 0) -> int:
    first = len(lp.samples)
    for i in range(len(lp.samples) - 1, start - 1, -1):  # from the end: the last miss
        delta = lp.samples[i][1]
        total = sum(delta.values()) or 1
        if any(abs(100 * delta.get(t, 0) / total - w) > 1 for t, w in want.items()):
            break
        first = i
    return first - start


def bench(n: int, seconds: int) -> tuple[float, float, float, float, int]:
    """CPU ms per simulated s, actions/s, share error, switch loss, last correction (s)."""
    rng = random.Random(n)
    planner = TimedPlanner()
    lp = Loop(planner, Plant(switch_us=SWITCH_US), sample_us=SAMPLE_US)
    weights = {f"t{i:02}": rng.randint(1, 10) for i in range(n)}
    for tid, w in weights.items():
        lp.add(tid, w, [Demand(overrun_us=OVERRUN_US)] * rng.randint(1, 3))
    settled, slices = 0, planner.timeslices()
    for second in range(1, seconds + 1):
        if second == seconds // 2 + 1:
            half = len(lp.actions)
        lp.run(SAMPLE_US)
        if planner.timeslices() != slices:
            settled, slices = second, planner.timeslices()
    total = sum(weights.values())
    want = {t: 100 * w / total for t, w in weights.items()}
    shares = lp.busy_shares(len(lp.samples) // 2)
    error = max(abs(shares.get(t, 0) - w) for t, w in want.items())
    loss = lp.plant.switches * SWITCH_US / lp.plant.now
    rate = (len(lp.actions) - half) / (seconds / 2)
    return 1000 * planner.cpu / seconds, rate, error, loss, settled


def one_against_eight() -> tuple[int, float]:
    lp = Loop(RunlistPlanner(), Plant(switch_us=SWITCH_US), sample_us=2_500_000)
    lp.add("one", 1, [Demand(overrun_us=150)])
    lp.add("eight", 1, [Demand(overrun_us=150)] * 8)
    lp.run(14 * lp.sample_us)
    return converged(lp, {"one": 50, "eight": 50}), lp.busy_shares(6)["one"]


def wound_up() -> int:
    lp = Loop(RunlistPlanner(), Plant(switch_us=SWITCH_US), sample_us=500_000)
    lp.add("u", 1, [Demand(rate=0.2)])
    lp.add("s", 1, [SATURATING])
    lp.run(20 * lp.sample_us)
    start = len(lp.samples)
    lp.plant.set_demand("u", SATURATING)
    lp.run(14 * lp.sample_us)
    return converged(lp, {"u": 50, "s": 50}, start)


class LevelBlindPlant(Plant):
    """A runlist whose driver refused the interleave levels."""

    def apply(self, actions: Iterable[Action]) -> None:
        super().apply(a for a in actions if not isinstance(a, SetInterleave))


def priority_waits(n: int, levels: bool, wakes: int = 100) -> list[int]:
    """Submit-to-run waits (us) of a priority tenant behind n saturating ones."""
    rng = random.Random(n)
    plant = Plant(switch_us=SWITCH_US) if levels else LevelBlindPlant(switch_us=SWITCH_US)
    lp = Loop(RunlistPlanner(), plant, sample_us=SAMPLE_US)
    for i in range(n):
        lp.add(f"t{i:02}", rng.randint(1, 1000), [Demand(overrun_us=OVERRUN_US)])
    lp.add("p", 1, [Demand(rate=0.0)], priority=True)
    lp.run(2 * SAMPLE_US)
    waits = []
    for _ in range(wakes):
        lp.run(40_000 + rng.randrange(1_000))
        lp.plant.set_demand("p", Demand(chunk_us=1_000, gap_us=10**9))
        submit = lp.plant.now
        lp.run(20_000)
        lp.event(Submitted("p"))
        while not lp.plant.get("p", n + 1).busy or lp.plant.get("p", n + 1).chunk_left:
            lp.run(1_000)
        waits.append(min(at for tid, at in lp.plant.starts if tid == "p" and at >= submit)
                     - submit)
        lp.plant.get("p", n + 1).busy = 0
        lp.plant.set_demand("p", Demand(rate=0.0))
    return sorted(waits)


def main() -> None:
    print(f"{SWITCH_US} us per switch, {OVERRUN_US} us overrun per slice, "
          f"a busy sample every {SAMPLE_US // 1000} ms")
    print(f"{'tenants':>7} {'sim s':>5} {'planner CPU/s':>13} {'actions/s':>9} "
          f"{'share err pp':>12} {'switch loss':>11} {'last correction':>15}")
    for n, seconds in ((2, 20), (4, 20), (16, 60), (64, 300)):
        cpu, rate, err, loss, conv = bench(n, seconds)
        print(f"{n:>7} {seconds:>5} {cpu:>11.3f}ms {rate:>9.2f} {err:>12.3f} {loss:>11.2%} "
              f"{conv:>13} s")
    samples, share = one_against_eight()
    print(f"1 vs 8 groups at 1:1: {share:.2f}% for the single group, "
          f"converged after {samples} samples of 2.5 s")
    print(f"a tenant wound up at 20% demand, then saturating: converged after "
          f"{wound_up()} samples of 0.5 s")
    print("priority submit-to-run, the planner told 20 ms late (p50 / p99 / max, us):")
    for n in (2, 4, 16, 64):
        row = []
        for levels in (True, False):
            w = priority_waits(n, levels)
            row.append(f"{w[len(w) // 2]} / {w[len(w) * 99 // 100]} / {w[-1]}")
        print(f"{n:>7} tenants: HIGH {row[0]:>22}   levels ignored {row[1]:>22}")


if __name__ == "__main__":
    main()
