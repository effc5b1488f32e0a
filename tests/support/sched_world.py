"""SchedulerService in virtual time (World): a fake clock, call_later on virtual
timers, and an actuator that records each call; with a config of three tenants (50/30/20),
in frame mode (RUNLIST_CONFIG: the same in runlist mode)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from vgpud.admin.manager import Manager
from vgpud.core.groups import Group, GroupTracker
from vgpud.core.ledger import Ledger
from vgpud.kernel.uapi import Sched, SchedResult, SchedState
from vgpud.sched.activity import Activity
from vgpud.sched.actuator import ActuatorStats
from vgpud.sched.service import SchedulerService
from vgpud.store.config import parse_config
from vgpud.store.state import RuntimeState

MS = 1_000_000  # ns
CONFIG = """\
[daemon]
state_path = "{state}"
frame_ms = 100
sched_mode = "frame"

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
SWITCHES = (SchedState.OFF, SchedState.ON, SchedState.OWNER_OFF)
GIB = 2**30
RUNLIST_CONFIG = CONFIG.replace('sched_mode = "frame"', 'sched_mode = "runlist"')


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
        self.timeslice: dict[tuple[int, int], int] = {}  # as the driver has them
        self.refuse: SchedResult | None = None  # the answer to every TIMESLICE entry
        self.level: dict[tuple[int, int], int] = {}  # as the driver has them (none: MEDIUM)
        self.refuse_level: SchedResult | None = None  # the answer to every INTERLEAVE entry

    async def apply(self, entries: Sequence[Sched]) -> None:
        await self.run(entries)

    async def run(self, entries: Sequence[Sched]) -> list[SchedResult | None]:
        self.calls.append((self.clock.now, list(entries)))
        results: list[SchedResult | None] = []
        for e in entries:
            key = (e.h_client, e.h_object)
            if e.enable == SchedState.TIMESLICE:
                if self.refuse is not None:
                    results.append(self.refuse)
                    continue
                self.timeslice[key] = e.arg
            elif e.enable == SchedState.INTERLEAVE:
                if self.refuse_level is not None:
                    results.append(self.refuse_level)
                    continue
                self.level[key] = e.arg
            elif e.enable != SchedState.PREEMPT:
                self.on[key] = e.enable in (SchedState.ON, True)
            results.append(SchedResult(0, 0))
        clients = {client for (client, _), on in self.on.items() if on}
        self.most_clients_on = max(self.most_clients_on, len(clients))
        return results


class World:
    def __init__(self, tmp: Path, activity: Any = None, config: str = CONFIG) -> None:
        text = config.format(state=tmp / "state.json")
        (tmp / "vgpud.toml").write_text(text)
        self.manager = Manager(tmp / "vgpud.toml", parse_config(text), RuntimeState(), Ledger(),
                               [(0, "sim", GIB), (1, "sim", GIB)])
        self.clock = Clock()
        self.timers = Timers(self.clock)
        self.tracker = GroupTracker()
        self.service = SchedulerService(self.manager, self.tracker, activity=activity,
                                        clock=self.clock, call_later=self.timers,
                                        share_interval=1e6)
        # as vgpud.app subscribes it
        self.tracker.observers.subscribe(self.service)
        self.manager.observers.subscribe(self.service)
        self.actuator = Recorder(self.clock)
        self.handles = itertools.count(0x100)

    def group(self, tenant: str, gpu: int = 0, ctx: int | None = None) -> Group:
        client = {"a": 0xA0, "b": 0xB0, "c": 0xC0, "d": 0xD0}[tenant] + gpu
        group = Group(ctx if ctx is not None else client, tenant, gpu, client,
                      next(self.handles), 0x10, 1000 + client)
        self.actuator.on[(client, group.handle)] = True  # the driver's default
        self.tracker.add(group)
        return group

    def on_time(self, start: int, end: int) -> dict[tuple[int, int], int]:
        """ns each group was on in [start, end], from the actuator's calls (their
        ON / OFF / OWNER_OFF entries)."""
        on: dict[tuple[int, int], int] = {}
        since: dict[tuple[int, int], int] = {}
        for t, entries in self.actuator.calls:
            for e in entries:
                if e.enable not in SWITCHES:
                    continue
                key = (e.h_client, e.h_object)
                if e.enable and key not in since:
                    since[key] = t
                elif not e.enable and key in since:
                    t0 = since.pop(key)
                    on[key] = on.get(key, 0) + max(0, min(t, end) - max(t0, start))
        for key, t0 in since.items():
            on[key] = on.get(key, 0) + max(0, end - max(t0, start))
        return on


class FakeSource:
    """An activity source whose runnable set and busy times a test sets."""

    name = "fake"
    interval = 1e6
    blocking = False

    def __init__(self) -> None:
        self.runnable: set[tuple[int, str]] = set()
        self.busy: dict[tuple[int, str], int] = {}
        self.switched_on: list[Mapping[int, AbstractSet[str]]] = []

    def read(self) -> str:
        return "raw"

    def update(self, raw: str, groups: GroupTracker, switched_on: Mapping[int, AbstractSet[str]],
               now_ns: int) -> Activity:
        assert raw == "raw"
        self.switched_on.append(switched_on)
        return Activity(frozenset(self.runnable), dict(self.busy))

    def close(self) -> None:
        pass


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)
