"""SchedulerService in virtual time: a fake clock, call_later on virtual timers, and
an actuator that records each call; with a config of three tenants (50/30/20)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from vgpud.kernel.uapi import Sched
from vgpud.sched.actuator import ActuatorStats

MS = 1_000_000  # ns
CONFIG = """\
[daemon]
state_path = "{state}"
frame_ms = 100

[[tenant]]
name = "a"
weight = 50

[[tenant]]
name = "b"
weight = 30

[[tenant]]
name = "c"
weight = 20
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1_000 * MS

    def __call__(self) -> int:
        return self.now


class Timer:
    def __init__(self, timers: Timers, key: tuple[int, int]) -> None:
        self._timers, self._key = timers, key

    def cancel(self) -> None:
        self._timers.cancelled.add(self._key)


class Timers:
    """call_later in virtual time: due = clock + delay."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.heap: list[tuple[int, int, Callable[..., None], tuple[Any, ...]]] = []
        self.cancelled: set[tuple[int, int]] = set()
        self.seq = itertools.count()

    def __call__(self, delay: float, callback: Callable[..., None], *args: Any) -> Timer:
        key = (self.clock.now + round(delay * 1e9), next(self.seq))
        heapq.heappush(self.heap, (*key, callback, args))
        return Timer(self, key)

    def next_due(self) -> int | None:
        while self.heap and (self.heap[0][0], self.heap[0][1]) in self.cancelled:
            heapq.heappop(self.heap)
        return self.heap[0][0] if self.heap else None

    async def run_until(self, end_ns: int) -> None:
        while (due := self.next_due()) is not None and due <= end_ns:
            _, _, callback, args = heapq.heappop(self.heap)
            self.clock.now = due
            callback(*args)
            await settle()
        self.clock.now = end_ns
        await settle()


class Recorder:
    """The actuator: records each call with the virtual time it was made at."""

    def __init__(self, clock: Clock) -> None:
        self.stats = ActuatorStats()
        self.clock = clock
        self.calls: list[tuple[int, list[Sched]]] = []
        self.on: dict[tuple[int, int], bool] = {}  # as the driver has them
        self.most_clients_on = 0  # tenants have one client per GPU here

    async def apply(self, entries: Sequence[Sched]) -> None:
        self.calls.append((self.clock.now, list(entries)))
        for e in entries:
            self.on[(e.h_client, e.h_object)] = e.enable
        clients = {client for (client, _), on in self.on.items() if on}
        self.most_clients_on = max(self.most_clients_on, len(clients))


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)
