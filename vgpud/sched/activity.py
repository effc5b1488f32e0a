"""Activity sources: which tenants have work on each GPU, and the GPU time they got.

The scheduler polls a source every ``interval`` seconds: ``read()`` fetches
the raw figures (in a worker thread when ``blocking``), ``update()`` maps them
to tenants through the tracked channel groups, on the event loop.

- nvsim (tests; /proc/driver/nvsim exists): /proc/driver/nvsim/groups gives
  each channel group's pending and busy nanoseconds. A tenant is runnable on
  a GPU while one of its groups there that its owner has not paused has
  pending work (it shows even while the group is switched off); busy time is
  exact.
- NVML (real GPUs): nvmlDeviceGetProcessUtilization samples (pid, SM %)
  mapped to tenants through the processes that opened their contexts. NVML
  only sees work that runs, and a tenant switched off shows none: a tenant is
  runnable while it showed SM use within its last ``hold`` seconds of GPU
  time; one found idle is probed again after ``probe`` seconds (it gets slots
  until it has run ``hold`` seconds without use). Busy time is estimated from
  the SM percentages.
- none (neither): the service treats every tenant with a group on a GPU as
  runnable there; scheduling then only enforces the slots.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from vgpud.core.groups import GroupTracker
from vgpud.host.inventory import import_nvml

__all__ = [
    "Activity",
    "ActivitySource",
    "NvmlActivity",
    "NvsimActivity",
    "choose_source",
]

log = logging.getLogger(__name__)

NVSIM_PROC = Path("/proc/driver/nvsim")
READ_SIZE = 1 << 16
NVML_SUCCESS = 0
NVML_ERROR_NOT_FOUND = 6

GpuTenant = tuple[int, str]


@dataclass(frozen=True, slots=True)
class Activity:
    runnable: frozenset[GpuTenant]  # (GPU, tenant) pairs with work
    busy_ns: Mapping[GpuTenant, int]  # GPU time each got since the source started


class ActivitySource(Protocol):
    name: str
    interval: float  # seconds between polls
    blocking: bool  # read() may block: call it in a worker thread

    def read(self) -> Any:
        """The raw figures; must not touch the tracker (it may run in a thread)."""
        ...

    def update(self, raw: Any, groups: GroupTracker, switched_on: Mapping[int, AbstractSet[str]],
               now_ns: int) -> Activity:
        """Map ``raw`` to tenants; ``switched_on``: the tenants whose groups are
        on, per GPU (frame mode: the running one; runlist mode: every tenant
        but one in a cap's off phase)."""
        ...

    def close(self) -> None: ...


# --- nvsim ------------------------------------------------------------------


class NvsimActivity:
    """Polls /proc/driver/nvsim/groups (see the module doc)."""

    name = "nvsim"
    blocking = False  # a procfs read of a few KiB

    def __init__(self, path: Path = NVSIM_PROC / "groups", interval: float = 0.02) -> None:
        self.path = path
        self.interval = interval
        self.bad_lines = 0
        self._fd: int | None = None
        self._last: dict[int, int] = {}  # group id -> busy_ns seen
        self._busy: dict[GpuTenant, int] = {}

    def read(self) -> bytes:
        """The file from offset 0 of one open fd (a seq_file regenerates it)."""
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            chunks, offset = [], 0
            while chunk := os.pread(self._fd, READ_SIZE, offset):
                chunks.append(chunk)
                offset += len(chunk)
            return b"".join(chunks)
        except OSError as exc:
            log.warning("activity: %s: %s", self.path, exc)
            self.close()
            return b""

    def update(self, raw: bytes, groups: GroupTracker, switched_on: Mapping[int, AbstractSet[str]],
               now_ns: int) -> Activity:
        runnable: set[GpuTenant] = set()
        seen: dict[int, int] = {}
        last, busy, by_id = self._last, self._busy, groups.by_id
        for line in raw.split(b"\n")[1:]:
            fields = line.split()
            if len(fields) < 8:  # later columns (wait_ns) are not read
                if line:
                    self.bad_lines += 1
                continue
            try:
                gid = int(fields[1], 16) << 32 | int(fields[2], 16)
                group = by_id.get(gid)
                if group is None:
                    continue  # not one of ours (or not learned yet)
                busy_now = int(fields[7])
            except ValueError:
                self.bad_lines += 1
                continue
            key = (group.gpu, group.tenant)
            if fields[6] != b"0" and not groups.paused(group):  # a paused group cannot run
                runnable.add(key)
            seen[gid] = busy_now
            delta = busy_now - last.get(gid, 0)
            if delta > 0:
                busy[key] = busy.get(key, 0) + delta
        self._last = seen
        return Activity(frozenset(runnable), dict(busy))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# --- NVML -------------------------------------------------------------------


@dataclass(slots=True)
class _Seen:
    runnable: bool = True
    active_ns: int = 0  # when it last showed SM use
    on_ns: int = 0  # GPU time (switched on) since then
    idle_since: int = 0
    was_on: bool = False  # running at the previous poll


@dataclass(slots=True)
class _Samples:
    by_gpu: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # pid, ts, sm


class NvmlActivity:
    """nvmlDeviceGetProcessUtilization per GPU (see the module doc)."""

    name = "nvml"
    blocking = True

    def __init__(self, nvml: Any, gpus: Sequence[int], *, interval: float = 0.1,
                 hold: float = 0.3, probe: float = 5.0) -> None:
        self.nvml = nvml
        self.gpus = tuple(gpus)
        self.interval = interval
        self.hold_ns = int(hold * 1e9)
        self.probe_ns = int(probe * 1e9)
        self.errors = 0
        self._handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in self.gpus}
        self._last_ts = dict.fromkeys(self.gpus, 0)  # read() only
        self._last_sample: dict[int, int] = {}  # GPU -> last sample time (us)
        self._seen: dict[GpuTenant, _Seen] = {}
        self._busy: dict[GpuTenant, int] = {}
        self._prev_ns: int | None = None

    def read(self) -> _Samples:
        nvml, out = self.nvml, _Samples()
        for gpu, handle in self._handles.items():
            try:
                samples = nvml.nvmlDeviceGetProcessUtilization(handle, self._last_ts[gpu])
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) not in (NVML_SUCCESS, NVML_ERROR_NOT_FOUND):
                    self.errors += 1
                    log.debug("activity: NVML GPU %d: %s", gpu, exc)
                continue  # no samples since the last call
            rows = [(int(s.pid), int(s.timeStamp), int(s.smUtil)) for s in samples]
            if rows:
                self._last_ts[gpu] = max(ts for _, ts, _ in rows)
            out.by_gpu[gpu] = rows
        return out

    def update(self, raw: _Samples, groups: GroupTracker,
               switched_on: Mapping[int, AbstractSet[str]],
               now_ns: int) -> Activity:
        owners: dict[tuple[int, int], str] = {}  # (GPU, pid) -> tenant
        present: set[GpuTenant] = set()
        for group in groups:
            owners[(group.gpu, group.tgid)] = group.tenant
            present.add((group.gpu, group.tenant))
        active: set[GpuTenant] = set()
        for gpu, rows in raw.by_gpu.items():
            prev = self._last_sample.get(gpu)  # each sample covers the time since the last
            for ts in sorted({ts for _, ts, _ in rows}):
                period_us = ts - prev if prev is not None and ts > prev else 0
                for pid, when, sm in rows:
                    tenant = owners.get((gpu, pid))
                    if when != ts or tenant is None or sm <= 0:
                        continue
                    key = (gpu, tenant)
                    active.add(key)
                    if period_us:  # percent of microseconds -> nanoseconds
                        self._busy[key] = self._busy.get(key, 0) + sm * period_us * 10
                prev = ts if prev is None else max(prev, ts)
            if prev is not None:
                self._last_sample[gpu] = prev
        elapsed = 0 if self._prev_ns is None else now_ns - self._prev_ns
        self._prev_ns = now_ns
        for key in list(self._seen):
            if key not in present:
                del self._seen[key]
        runnable: set[GpuTenant] = set()
        for key in present:
            seen = self._seen.setdefault(key, _Seen(active_ns=now_ns, idle_since=now_ns))
            on = key[1] in switched_on.get(key[0], ())
            if key in active:
                seen.runnable, seen.active_ns, seen.on_ns = True, now_ns, 0
            elif on:
                if seen.was_on:
                    seen.on_ns += elapsed
                if seen.runnable and seen.on_ns >= self.hold_ns:
                    seen.runnable, seen.idle_since = False, now_ns
            elif not seen.runnable and now_ns - seen.idle_since >= self.probe_ns:
                seen.runnable, seen.on_ns = True, 0  # probe: give it slots again
            seen.was_on = on
            if seen.runnable:
                runnable.add(key)
        return Activity(frozenset(runnable), dict(self._busy))

    def close(self) -> None:
        with suppress(self.nvml.NVMLError):
            self.nvml.nvmlShutdown()


# --- choice -----------------------------------------------------------------


def choose_source(gpus: Sequence[int], *, nvsim: Path = NVSIM_PROC,
                  nvml: Callable[[], Any] | None = None) -> ActivitySource | None:
    """nvsim when /proc/driver/nvsim exists, else NVML, else None (with a log line why)."""
    if nvsim.exists():
        log.info("scheduler activity: nvsim (%s)", nvsim / "groups")
        return NvsimActivity(nvsim / "groups")
    try:
        module = nvml() if nvml is not None else import_nvml()
        module.nvmlInit()
    except Exception as exc:  # ImportError, NVMLError (no library, no driver)
        log.info("scheduler activity: none (NVML unavailable: %s): every tenant with a "
                 "channel group counts as runnable", exc)
        return None
    try:
        source = NvmlActivity(module, gpus)
    except module.NVMLError as exc:
        with suppress(module.NVMLError):
            module.nvmlShutdown()
        log.info("scheduler activity: none (NVML: %s)", exc)
        return None
    log.info("scheduler activity: NVML process utilization on %d GPUs", len(gpus))
    return source
